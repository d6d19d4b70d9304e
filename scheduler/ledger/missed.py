"""Missed ticks: which ticks have a row, recording those that have none (paused ones as
paused), and the watermark up to which they are recorded."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Connection, select, tuple_, update

from scheduler.ledger.election import Chore
from scheduler.ledger.tables import maintenance, pauses, ticks, upsert
from scheduler.statuses import Status


def existing_ticks(
    conn: Connection, wanted: list[tuple[int, datetime]]
) -> set[tuple[int, datetime]]:
    """Which of these (job_key, scheduled_at) pairs already have a row: primary-key probes."""
    found: set[tuple[int, datetime]] = set()
    for start in range(0, len(wanted), 1000):
        chunk = wanted[start : start + 1000]
        query = select(ticks.c.job_key, ticks.c.scheduled_at).where(
            tuple_(ticks.c.job_key, ticks.c.scheduled_at).in_(chunk)
        )
        found.update((row.job_key, row.scheduled_at) for row in conn.execute(query))
    return found


def missed_watermark(conn: Connection, lock: bool = True) -> datetime:
    """How far the sweep has recorded missed ticks; locked, the row stays so until the
    commit, which also moves it (`set_missed_watermark`): a sweep cut short moves nothing."""
    query = select(maintenance.c.last_run_at).where(maintenance.c.task == Chore.MISSED)
    found: datetime = conn.execute(query.with_for_update() if lock else query).scalar_one()
    return found


def set_missed_watermark(conn: Connection, until: datetime) -> None:
    conn.execute(
        update(maintenance).where(maintenance.c.task == Chore.MISSED).values(last_run_at=until)
    )


def record_missed(
    conn: Connection,
    missing: list[tuple[int, str, datetime]],
    instance: str,
    paused: dict[int, datetime] | None = None,
) -> int:
    """Rows for ticks nobody claimed, in the common order; a tick that has a row keeps it.

    A tick of a job paused (`paused`: key -> since when) at that tick is recorded
    `paused`, not `missed`: nobody was meant to run it. Returns the missed ones recorded.
    """
    if not missing:
        return 0
    paused = paused or {}
    statement = (
        upsert(conn, ticks)
        .on_conflict_do_nothing(index_elements=[ticks.c.job_key, ticks.c.scheduled_at])
        .returning(ticks.c.status)
    )
    rows = [
        {
            "job_key": key,
            "scheduled_at": tick,
            "job_name": name,
            "status": Status.PAUSED if key in paused and tick >= paused[key] else Status.MISSED,
            "instance": instance,
        }
        for key, name, tick in missing
    ]
    return sum(1 for row in conn.execute(statement, rows) if row.status == Status.MISSED)


def paused_since(conn: Connection) -> dict[int, datetime]:
    """The jobs paused now, and since when (see `scheduler.fleet.pauses`)."""
    return {
        r.job_key: r.paused_at for r in conn.execute(select(pauses.c.job_key, pauses.c.paused_at))
    }
