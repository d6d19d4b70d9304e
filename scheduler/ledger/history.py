"""The ticks' rows as they are read: a job's history, each job's latest, the runs going now."""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Row, desc, select, tuple_, union_all

from scheduler.ledger.tables import attempts, ticks
from scheduler.ledger.times import iso
from scheduler.statuses import Status


@dataclass(frozen=True)
class TickRow:
    job: str
    key: int
    scheduled_at: datetime
    instance: str | None
    status: str
    started_at: datetime | None
    finished_at: datetime | None
    duration_s: float | None
    error: str | None
    run_id: int | None
    holder: str | None
    manual: bool
    told: str | None = None
    attempt: int = 1  # the row's attempt; earlier ones are in `attempts`, oldest first
    retry_at: datetime | None = None  # failed, with another attempt due then
    caught_up: bool = False
    attempts: tuple[dict[str, object], ...] = ()

    def as_json(self) -> dict[str, object]:
        return {
            "job": self.job,
            "key": self.key,
            "scheduled_at": iso(self.scheduled_at),
            "instance": self.instance,
            "status": self.status,
            "started_at": iso(self.started_at),
            "finished_at": iso(self.finished_at),
            "duration_s": self.duration_s,
            "error": self.error,
            "run_id": self.run_id,
            "holder": self.holder,
            "manual": self.manual,
            "told": self.told,
            "attempt": self.attempt,
            "retry_at": iso(self.retry_at),
            "caught_up": self.caught_up,
            "attempts": list(self.attempts),
        }


def _row(row: Row[Any]) -> TickRow:
    m = row._mapping
    started, finished = m["started_at"], m["finished_at"]
    duration = m["duration_s"]  # the run's own, as measured where it ran
    if duration is None and started and finished:
        duration = (finished - started).total_seconds()
    return TickRow(
        job=m["job_name"],
        key=m["job_key"],
        scheduled_at=m["scheduled_at"],
        instance=m["instance"],
        status=m["status"],
        started_at=started,
        finished_at=finished,
        duration_s=round(duration, 6) if duration is not None else None,
        error=m["error"],
        run_id=m["run_id"],
        holder=m["holder"],
        manual=bool(m["manual"]),
        told=m["told"],
        attempt=m["attempt"],
        retry_at=m["retry_at"],
        caught_up=bool(m["caught_up"]),
    )


def _with_attempts(conn: Connection, rows: list[TickRow]) -> list[TickRow]:
    """Each retried tick with its earlier attempts (one query for the page of rows)."""
    retried = [(r.key, r.scheduled_at) for r in rows if r.attempt > 1]
    if not retried:
        return rows
    a = attempts
    query = (
        select(a).where(tuple_(a.c.job_key, a.c.scheduled_at).in_(retried)).order_by(a.c.attempt)
    )
    earlier: dict[tuple[int, datetime], list[dict[str, object]]] = {}
    for row in conn.execute(query):
        m = row._mapping
        earlier.setdefault((m["job_key"], m["scheduled_at"]), []).append(
            {
                "attempt": m["attempt"],
                "status": m["status"],
                "instance": m["instance"],
                "run_id": m["run_id"],
                "started_at": iso(m["started_at"]),
                "finished_at": iso(m["finished_at"]),
                "duration_s": m["duration_s"],
                "error": m["error"],
                "told": m["told"],
            }
        )
    return [
        replace(r, attempts=tuple(earlier.get((r.key, r.scheduled_at), ()))) if r.attempt > 1 else r
        for r in rows
    ]


@dataclass(frozen=True)
class TickFilter:
    """Which ticks `history` shows: all of them by default, newest first."""

    key: int | None = None
    since: datetime | None = None  # scheduled at or after
    until: datetime | None = None  # scheduled at or before
    statuses: tuple[str, ...] = ()
    instance: str | None = None
    limit: int | None = 50


def history(conn: Connection, wanted: TickFilter) -> list[TickRow]:
    """Most recent ticks first; served by the primary key or the scheduled_at index."""
    query = select(ticks)
    if wanted.key is not None:
        query = query.where(ticks.c.job_key == wanted.key)
    if wanted.since is not None:
        query = query.where(ticks.c.scheduled_at >= wanted.since)
    if wanted.until is not None:
        query = query.where(ticks.c.scheduled_at <= wanted.until)
    if wanted.statuses:
        query = query.where(ticks.c.status.in_(wanted.statuses))
    if wanted.instance is not None:
        query = query.where(ticks.c.instance == wanted.instance)
    query = query.order_by(desc(ticks.c.scheduled_at), ticks.c.job_key)
    if wanted.limit is not None:
        query = query.limit(wanted.limit)
    return _with_attempts(conn, [_row(r) for r in conn.execute(query)])


LATEST_AT_ONCE = 100  # jobs whose latest row one statement reads


def latest_of(
    conn: Connection, keys: list[int], statuses: tuple[Status, ...]
) -> dict[int, TickRow]:
    """Each job's newest row with one of `statuses`: one statement per hundred jobs, each
    part a probe of the primary key from the newest end (never a scan of the ledger)."""
    found: dict[int, TickRow] = {}
    for start in range(0, len(keys), LATEST_AT_ONCE):
        parts = [
            select(ticks)
            .where(ticks.c.job_key == key, ticks.c.status.in_(statuses))
            .order_by(desc(ticks.c.scheduled_at))
            .limit(1)
            .subquery()
            for key in keys[start : start + LATEST_AT_ONCE]
        ]
        for row in conn.execute(union_all(*(select(part) for part in parts))):
            found[row.job_key] = _row(row)
    return found


def running(conn: Connection) -> list[TickRow]:
    query = select(ticks).where(ticks.c.status == Status.RUNNING).order_by(ticks.c.job_key)
    return [_row(r) for r in conn.execute(query)]


def running_of(conn: Connection, key: int) -> TickRow | None:
    """The job's run going now, as the ledger says (to say who holds its lock)."""
    query = select(ticks).where(ticks.c.job_key == key, ticks.c.status == Status.RUNNING)
    row = conn.execute(query.order_by(ticks.c.started_at.desc()).limit(1)).first()
    return _row(row) if row else None
