"""The contract between the gate and a backend (PostgreSQL, or the embedded SQLite file).

The gate decides what to ask; a backend answers each batch of requests
atomically and in one round trip. Both backends implement the same protocol
(see `scheduler.gate` for the whole story):

- claim: insert the tick's ledger row; a conflict means another replica owns
  the tick (`lost`). The owner then tries the job's lock: got it -> `run`
  (and any other `running` row of the job is stale: `crashed`); not got ->
  `skipped`, counted in the job's fleet-wide skip streak. Ticks older than
  their grace are recorded `missed` instead of being run. A replica wins at
  most `capacity` runs per batch (its free workers); ticks beyond that are
  `deferred`, left unclaimed for the next batch or another replica. A backend
  may spread a burst over the live replicas (`yielded`: another replica's
  share, which anyone may take a moment later). Rows are claimed in
  (scheduled_at, key) order on every replica.
- finish: a conditional update of the run's row (only while it is still
  `running` with this run_id: a stale run never overwrites what replaced
  it), the failure streak, then the lock is released.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, NamedTuple, Protocol

from sqlalchemy import Connection, Engine


class Intent(StrEnum):
    RUN = "run"  # claim the tick and run it if the job's lock is free
    SKIP = "skip"  # claim the tick as skipped: this replica is still running the job
    MANUAL = "manual"  # `scheduler trigger`: lock first, then a row for "now"


class Outcome(StrEnum):
    RUN = "run"  # this replica owns the tick and holds the job's lock
    SKIPPED = "skipped"  # this replica recorded the tick as skipped
    LOST = "lost"  # another replica owns the tick
    DEFERRED = "deferred"  # no free worker for it in this batch: try when one frees
    YIELDED = "yielded"  # another live replica's share of the burst: try again shortly
    MISSED = "missed"  # this replica recorded the tick as missed
    HELD = "held"  # manual trigger only: the lock is held elsewhere


@dataclass(frozen=True)
class ClaimRequest:
    key: int
    name: str
    scheduled_at: datetime
    intent: Intent
    grace_s: float
    skip_threshold: int


class ClaimResult(NamedTuple):  # a tuple: a claim makes hundreds of these at once
    key: int
    scheduled_at: datetime
    outcome: Outcome
    run_id: int | None = None
    started_at: datetime | None = None
    holder: str | None = None
    holder_since: datetime | None = None
    # skipped: the job's fleet-wide streak, this skip included; run: the streak it ends
    consecutive_skips: int | None = None
    alert: bool = False  # this skip made the streak reach its threshold
    recovered: bool = False  # this run ends a streak that had alerted
    crashed: int = 0  # stale `running` rows this claim marked crashed


@dataclass(frozen=True)
class FinishRequest:
    key: int
    scheduled_at: datetime
    run_id: int
    status: str  # succeeded, failed or crashed
    error: str | None
    unlock: bool  # False when the session that took the lock is gone
    fail_threshold: int


class FinishResult(NamedTuple):
    key: int
    scheduled_at: datetime
    recorded: bool  # False: the row was no longer ours (marked crashed elsewhere)
    finished_at: datetime | None = None
    # failed: the streak, this failure included; succeeded: the streak it ends
    consecutive_failures: int | None = None
    alert: bool = False  # this failure made the failure streak reach its threshold
    recovered: bool = False  # this success ends a failure streak that had alerted


class SessionLost(Exception):
    """The session that held this replica's locks is gone; every lock with it."""


class Unavailable(Exception):
    """The backend cannot be reached right now; try again later."""


class Backend(Protocol):
    """What the gate needs from a store of locks and ledger rows."""

    name: str

    def connect(self) -> None:
        """Open the lock session; raises Unavailable."""

    def close(self) -> None:
        """Release every lock by ending the session."""

    def claim(
        self, requests: Sequence[ClaimRequest], instance: str, capacity: int
    ) -> list[ClaimResult]:
        """Answer a batch of claims atomically, winning at most `capacity` runs.

        Raises SessionLost.
        """

    def release(self, keys: Sequence[int]) -> None:
        """Release locks a failed claim may have taken; raises SessionLost."""

    def finish(self, requests: Sequence[FinishRequest]) -> list[FinishResult]:
        """Record finished runs and release their locks; raises SessionLost."""

    def heartbeat(self) -> datetime:
        """Prove the session is alive; returns the backend's clock. Raises SessionLost."""

    def fileno(self) -> int | None:
        """A socket that becomes readable when the server ends the session, if any."""

    def check_alive(self) -> None:
        """Called when fileno() is readable; raises SessionLost if the session ended."""

    def abort(self) -> None:
        """From any thread: make a call hanging on a dead server fail now."""

    # Housekeeping and the command line use a second connection, never the lock session.
    @property
    def ledger_engine(self) -> Engine:
        """SQLAlchemy engine for ledger reads and chores."""

    def verify(self) -> None:
        """Refuse to run where locks cannot work (raises PoolerError, or Unavailable)."""

    def migrate(self) -> int:
        """Create or migrate the schema; returns the version found."""

    def now_expression(self) -> Any:
        """The backend's clock as an SQL expression (or a value) for ledger statements."""

    def now(self, conn: Connection) -> datetime:
        """The backend's clock, read through `conn`."""

    def free_locks(self, conn: Connection, keys: Sequence[int]) -> set[int]:
        """Which of these job locks nobody holds right now."""

    def live_instances(self, conn: Connection) -> list[dict[str, Any]]:
        """Replicas that are up now: name, since, address."""

    def lock_holders(self, conn: Connection) -> dict[int, str]:
        """Job key -> instance holding its lock now."""
