"""What a replica that died leaves behind: its running rows (marked crashed), and retries
that no live replica takes (ended)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, func, select, update

from scheduler.ledger.tables import ticks
from scheduler.statuses import Status


def mark_crashed(
    conn: Connection,
    key: int,
    run_id: int,
    error: str,
    now: datetime,
    lasted: float | None = None,
) -> bool:
    """A running row whose lock is free: its replica died. Conditional, like every update.

    `lasted`: how long the run was known to be going (until its replica was last
    seen alive), kept as its duration: it ran at least that long.
    """
    result = conn.execute(
        update(ticks)
        .where(ticks.c.job_key == key, ticks.c.run_id == run_id, ticks.c.status == Status.RUNNING)
        .values(status=Status.CRASHED, finished_at=now, error=error, duration_s=lasted)
    )
    return result.rowcount == 1


@dataclass(frozen=True)
class PendingRetry:
    key: int
    job: str
    scheduled_at: datetime
    retry_at: datetime


def pending_retries(conn: Connection, due_before: datetime) -> list[PendingRetry]:
    """Failed ticks whose next attempt was due before `due_before` (the retry_at index)."""
    query = (
        select(ticks.c.job_key, ticks.c.job_name, ticks.c.scheduled_at, ticks.c.retry_at)
        .where(ticks.c.retry_at.is_not(None), ticks.c.retry_at < due_before)
        .order_by(ticks.c.scheduled_at, ticks.c.job_key)
    )
    return [PendingRetry(*row) for row in conn.execute(query)]


def end_retry(conn: Connection, retry: PendingRetry, why: str) -> bool:
    """The tick's failed attempt is its last: no next one (conditional: one not yet taken)."""
    result = conn.execute(
        update(ticks)
        .where(
            ticks.c.job_key == retry.key,
            ticks.c.scheduled_at == retry.scheduled_at,
            ticks.c.status == Status.FAILED,
            ticks.c.retry_at == retry.retry_at,
        )
        .values(
            retry_at=None,
            error=func.coalesce(ticks.c.error + "; ", "") + why,
        )
    )
    return result.rowcount == 1
