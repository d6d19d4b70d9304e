"""Retention (`retention_days`): the old rows deleted, in batches."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Connection, delete, or_, select

from scheduler.ledger.tables import attempts, notices, registrations, run_requests, seen, ticks
from scheduler.statuses import Status


def prune_batch(conn: Connection, older_than: datetime, batch: int = 5000) -> int:
    """Delete up to about `batch` of the oldest finished rows before `older_than`.

    Called in a loop, one transaction per batch, so a backlog of millions of
    rows never holds one long transaction; the scheduled_at index finds each
    batch's end.
    """
    batch_end = conn.execute(
        select(ticks.c.scheduled_at)
        .where(ticks.c.scheduled_at < older_than)
        .order_by(ticks.c.scheduled_at)
        .offset(batch - 1)
        .limit(1)
    ).scalar()

    def in_batch(column: Any) -> Any:
        return column <= batch_end if batch_end is not None else column < older_than

    pending = or_(ticks.c.status == Status.RUNNING, ticks.c.retry_at.is_not(None))
    removed = conn.execute(delete(ticks).where(in_batch(ticks.c.scheduled_at), ~pending)).rowcount
    # A tick's earlier attempts go with its row (a pending tick keeps both).
    kept = (
        select(ticks.c.job_key)
        .where(ticks.c.job_key == attempts.c.job_key)
        .where(ticks.c.scheduled_at == attempts.c.scheduled_at)
        .exists()
    )
    conn.execute(delete(attempts).where(in_batch(attempts.c.scheduled_at), ~kept))
    conn.execute(
        delete(notices).where(notices.c.done_at.is_not(None), notices.c.done_at < older_than)
    )
    conn.execute(delete(run_requests).where(run_requests.c.requested_at < older_than))
    return removed or 0


def prune_registrations(conn: Connection, older_than: datetime) -> int:
    """Schedules that ended before `older_than`, and replicas not seen since then."""
    conn.execute(delete(seen).where(seen.c.seen_at < older_than))
    return (
        conn.execute(
            delete(registrations).where(
                registrations.c.until.is_not(None), registrations.c.until < older_than
            )
        ).rowcount
        or 0
    )
