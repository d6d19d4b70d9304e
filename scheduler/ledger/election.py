"""Fleet chores (the sweep, pruning) done by one replica at a time: whoever is elected."""

from __future__ import annotations

from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any, NamedTuple

from sqlalchemy import Connection, select, update

from scheduler.ledger.tables import maintenance


class Chore(StrEnum):
    """The rows of scheduler_maintenance, one per fleet chore."""

    SWEEP = "sweep"
    PRUNE = "prune"
    MISSED = "missed"  # not elected: how far the sweep has recorded missed ticks


class Election(NamedTuple):
    """A fleet chore this replica won: when it last ran (by anyone), and this run's time."""

    previous: datetime
    at: datetime  # the backend's clock as the election read it: the chore's "now"


def elect(conn: Connection, task: Chore, now: Any, every: float) -> Election | None:
    """One replica at a time does a fleet chore: whoever moves its clock forward first.

    `now` is the backend's clock (PostgreSQL: ``now()``, the same for every
    replica). Returns the election if this replica won, else None.
    Call inside a transaction: a concurrent loser's update finds the row moved.

    A pass never waits on another's election: a chore not yet due selects no row, and
    one that another replica is electing right now (it holds the row until its
    transaction ends) is lost too, its row skipped (PostgreSQL's SKIP LOCKED). Every
    replica's pass (100 of them, every 30 s) otherwise queued behind the winner's
    sweep, holding what it had taken before.
    """
    where = maintenance.c.task == task
    due = maintenance.c.last_run_at <= now - timedelta(seconds=every)
    previous = conn.execute(
        select(maintenance.c.last_run_at).where(where, due).with_for_update(skip_locked=True)
    ).scalar_one_or_none()
    if previous is None:  # not due, or being elected by another
        return None
    row = conn.execute(
        update(maintenance)
        .where(where, due)  # SQLite has no row locks: its single writer finds the row moved
        .values(last_run_at=now)
        .returning(maintenance.c.last_run_at)
    ).first()
    return Election(previous, row.last_run_at) if row else None
