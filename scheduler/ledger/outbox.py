"""The outbox: notices written with the state they announce, leased to one deliverer at a
time (see the `notices` table)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, or_, select, update

from scheduler.ledger.tables import notices

NOTICE_LEASE = timedelta(seconds=30)  # a notice's deliverer has this long before others may


def adopt_notices(conn: Connection, instance: str, now: Any, limit: int = 100) -> list[int]:
    """Take the lease of notices that are due and that nobody is delivering.

    Their replica died while delivering them, or never got the answer of the
    claim that raised them, or a retry is due. Rows another replica is
    adopting at the same moment are left to it.
    """
    due = (
        select(notices.c.id)
        .where(
            notices.c.done_at.is_(None),
            notices.c.next_attempt_at <= now,
            or_(notices.c.lease_until.is_(None), notices.c.lease_until < now),
        )
        .order_by(notices.c.id)
        .limit(limit)
    )
    if conn.dialect.name == "postgresql":
        due = due.with_for_update(skip_locked=True)
    ids = [row[0] for row in conn.execute(due)]
    if ids:
        conn.execute(
            update(notices)
            .where(notices.c.id.in_(ids))
            .values(lease_by=instance, lease_until=now + NOTICE_LEASE)
        )
    return ids


def leased_notices(conn: Connection, ids: list[int], instance: str) -> list[dict[str, Any]]:
    """The notices of `ids` this replica still holds the lease of, not yet delivered."""
    query = select(notices).where(
        notices.c.id.in_(ids), notices.c.lease_by == instance, notices.c.done_at.is_(None)
    )
    return [dict(row._mapping) for row in conn.execute(query.order_by(notices.c.id))]


def add_notice(
    conn: Connection,
    event: str,
    key: int,
    name: str,
    facts: dict[str, Any],
    *,
    raised_by: str,
    now: datetime,
    scheduled_at: datetime | None = None,
    deliverer: str | None = None,
) -> int:
    """Write a notice to the outbox. With a `deliverer`, leased to it (it delivers at once);
    without one (a command line, not a replica), the next live replica's housekeeping adopts it.
    """
    statement = notices.insert().values(
        event=event,
        job_key=key,
        job_name=name,
        scheduled_at=scheduled_at,
        facts=json.dumps(facts),
        raised_by=raised_by,
        raised_at=now,
        lease_by=deliverer,
        lease_until=now + NOTICE_LEASE if deliverer else None,
        next_attempt_at=now,
    )
    return int(conn.execute(statement.returning(notices.c.id)).scalar_one())


def notice_done(conn: Connection, notice: int, instance: str, now: Any, outcome: str) -> None:
    conn.execute(
        update(notices)
        .where(notices.c.id == notice, notices.c.lease_by == instance)
        .values(done_at=now, outcome=outcome, attempts=notices.c.attempts + 1)
    )


def notice_retry(conn: Connection, notice: int, instance: str, due: datetime) -> None:
    """Keep the lease until the retry is due (and a little after, for the retry itself)."""
    conn.execute(
        update(notices)
        .where(notices.c.id == notice, notices.c.lease_by == instance)
        .values(
            attempts=notices.c.attempts + 1,
            next_attempt_at=due,
            lease_until=due + NOTICE_LEASE,
        )
    )
