"""Run-now requests (scheduler.fleet.run_now): taken by a replica, linked to the run they
became, settled once."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, or_, select, update

from scheduler.ledger.tables import run_requests, ticks
from scheduler.statuses import Status

RUN_NOW_TAKE_AT_ONCE = 10  # requests one replica takes per look


def run_now_channel(namespace: int) -> str:
    """The fleet's LISTEN/NOTIFY channel: fleets in other schemas have other namespaces."""
    return f"scheduler_run_now_{namespace & 0xFFFFFFFF}"


@dataclass(frozen=True)
class RunRequest:
    """A run-now request a replica took."""

    id: int
    key: int
    name: str
    requested_by: str


def take_run_requests(
    conn: Connection, instance: str, keys: list[int], now: Any
) -> list[RunRequest]:
    """Take requests for jobs this replica runs; another replica's take skips them."""
    r = run_requests
    if not keys:
        return []
    wanted = (
        select(r.c.id)
        .where(r.c.taken_by.is_(None), r.c.job_key.in_(sorted(keys)))
        .order_by(r.c.id)
        .limit(RUN_NOW_TAKE_AT_ONCE)
    )
    if conn.dialect.name == "postgresql":
        wanted = wanted.with_for_update(skip_locked=True)
    rows = conn.execute(
        update(r)
        .where(r.c.id.in_(wanted.scalar_subquery()), r.c.taken_by.is_(None))
        .values(taken_by=instance, taken_at=now)
        .returning(r.c.id, r.c.job_key, r.c.job_name, r.c.requested_by)
    ).all()
    # In the order they were asked: the replica claims them in this order.
    return sorted(
        (RunRequest(row.id, row.job_key, row.job_name, row.requested_by) for row in rows),
        key=lambda request: request.id,
    )


# How far apart a request's take and the start of its run may be, at most, for the run to be
# found from the ledger: the clocks of a replica and of the database, and a claim delayed by
# a reconnect. A run further off is not claimed for the request (its asker says it does not
# know), never wrongly.
LINK_WINDOW = timedelta(minutes=10)


@dataclass(frozen=True)
class RequestRun:
    """The run a taken run-now request became, as the ledger shows it."""

    run_id: int
    status: str
    instance: str
    started_at: datetime
    finished_at: datetime | None
    error: str | None
    sure: bool  # False: another request of the job, taken by the same replica, may be its


def run_of_request(conn: Connection, request: dict[str, Any]) -> RequestRun | None:
    """The run a taken request became, read from the ledger alone (never from who is live).

    A replica runs what it takes as a manual tick, lock first, in the order it took
    them, so the run is the first manual run of the job on the taker that started
    after the take. None if there is none (yet), or if another request is known to
    have become it; not `sure` if another request of the job taken by that replica
    before the run started, and not settled, may have become it instead.
    """
    r, t = run_requests, ticks
    key, taker, taken_at = request["job_key"], request["taken_by"], request["taken_at"]
    if taker is None or taken_at is None:
        return None
    found = conn.execute(
        select(t.c.run_id, t.c.status, t.c.instance, t.c.started_at, t.c.finished_at, t.c.error)
        .where(
            t.c.job_key == key,
            t.c.scheduled_at >= taken_at - LINK_WINDOW,
            t.c.manual,
            t.c.instance == taker,
            t.c.run_id.is_not(None),
            t.c.started_at >= taken_at,
        )
        .order_by(t.c.started_at)
        .limit(1)
    ).first()
    if found is None:
        return None
    others = select(r.c.id).where(
        r.c.job_key == key, r.c.taken_by == taker, r.c.id != request["id"]
    )
    if conn.execute(others.where(r.c.run_id == found.run_id).limit(1)).first():
        return None
    could_be_theirs = others.where(
        r.c.finished_at.is_(None),
        r.c.taken_at >= found.started_at - LINK_WINDOW,
        r.c.taken_at <= found.started_at,
        or_(r.c.taken_at != taken_at, r.c.id < request["id"]),  # taken together: in id order
    )
    sure = conn.execute(could_be_theirs.limit(1)).first() is None
    return RequestRun(
        found.run_id,
        found.status,
        found.instance,
        found.started_at,
        found.finished_at,
        found.error,
        sure,
    )


def settle_request(
    conn: Connection,
    request: int,
    *,
    outcome: str,
    status: str | None,
    run_id: int | None,
    error: str | None,
    now: Any,
) -> bool:
    """Write a request's outcome, once: whoever settles it first (its replica, or whoever
    read it from the ledger) wins; False if it was settled already."""
    r = run_requests
    statement = (
        update(r)
        .where(r.c.id == request, r.c.finished_at.is_(None))
        .values(outcome=outcome, status=status, run_id=run_id, error=error, finished_at=now)
    )
    return bool(conn.execute(statement).rowcount)


SETTLE_AT_ONCE = 100  # taken, unsettled requests housekeeping looks at per sweep, newest first


def requests_unsettled(conn: Connection) -> bool:
    """Whether any request was taken and not yet settled (a read, no row locked)."""
    r = run_requests
    query = select(r.c.id).where(r.c.taken_by.is_not(None), r.c.finished_at.is_(None)).limit(1)
    return conn.execute(query).first() is not None


def settle_ended_requests(conn: Connection, now: Any) -> int:
    """Settle taken requests whose run has ended, from its row (housekeeping): the replica
    that ran it may have died, or failed to write the outcome, before it did."""
    r = run_requests
    waiting = conn.execute(
        select(r)
        .where(r.c.taken_by.is_not(None), r.c.finished_at.is_(None))
        .order_by(r.c.id.desc())
        .limit(SETTLE_AT_ONCE)
    ).all()
    settled = 0
    for row in waiting:
        run = run_of_request(conn, dict(row._mapping))
        if run is not None and run.sure and run.status != Status.RUNNING:
            settled += settle_request(
                conn,
                row.id,
                outcome="run",
                status=run.status,
                run_id=run.run_id,
                error=run.error,
                now=now,
            )
    return settled
