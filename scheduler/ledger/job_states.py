"""Each job's state row: its name and schedule as shown, its streaks, its drift."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Connection, or_, select, update

from scheduler.ledger.tables import jobs, upsert


def job_states(conn: Connection) -> dict[int, dict[str, Any]]:
    return {r.job_key: dict(r._mapping) for r in conn.execute(select(jobs))}


def track_jobs(engine: Any, entries: list[tuple[int, str, str]], now: datetime) -> None:
    """Make sure every job has a state row (its streaks, its name and schedule as shown).

    `tracked_since` is when the job was first seen: the missed-tick sweep never
    looks before it (ticks from before a job existed were never due); when a
    schedule changes, the registrations say from when (see `registrations`).
    Unchanged rows are only read, never locked (claims update them all the
    time), and each new or changed row is written in a short transaction of
    its own, so a slow or frozen starting replica holds no job row for long.
    """
    if not entries:
        return
    with engine.connect() as conn:
        known = {
            row.job_key: (row.job_name, row.schedule)
            for row in conn.execute(select(jobs.c.job_key, jobs.c.job_name, jobs.c.schedule))
        }
    new = [
        {"job_key": key, "job_name": name, "schedule": schedule, "tracked_since": now}
        for key, name, schedule in sorted(entries)
        if key not in known
    ]
    if new:  # new rows lock nothing another transaction holds: one statement, in key order
        with engine.begin() as conn:
            statement = upsert(conn, jobs).on_conflict_do_nothing(index_elements=[jobs.c.job_key])
            conn.execute(statement, new)
    for key, name, schedule in sorted(entries):
        if key in known and known[key] != (name, schedule):
            with engine.begin() as conn:
                conn.execute(
                    update(jobs)
                    .where(
                        jobs.c.job_key == key,
                        or_(jobs.c.job_name != name, jobs.c.schedule.is_distinct_from(schedule)),
                    )
                    .values(job_name=name, schedule=schedule)
                )


def set_drift(conn: Connection, key: int, since: datetime | None, alerted: bool) -> None:
    conn.execute(
        update(jobs).where(jobs.c.job_key == key).values(drift_since=since, drift_alerted=alerted)
    )
