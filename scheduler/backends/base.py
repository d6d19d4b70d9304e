"""The contract between the gate and a backend (PostgreSQL, or the embedded SQLite file).

The gate decides what to ask; a backend answers each batch of requests
atomically and in one round trip, following the protocol told in
`scheduler.gate`. Both backends implement its steps under the same names
(`postgres.sql` as SQL functions, `embedded.py` as methods).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from sqlalchemy import Connection, Engine

from scheduler.statuses import Status

if TYPE_CHECKING:
    from scheduler.backends.shares import Shape
    from scheduler.ledger.run_now import RunRequest


class Intent(StrEnum):
    RUN = "run"  # claim the tick and run it if the job's lock is free
    SKIP = "skip"  # claim the tick as skipped: this replica is still running the job
    MANUAL = "manual"  # `scheduler trigger`: lock first, then a row for "now"
    CATCH_UP = "catch_up"  # a tick missed while the fleet was down (`catch_up: all`): lock first


class Outcome(StrEnum):
    RUN = "run"  # this replica owns the tick and holds the job's lock
    SKIPPED = "skipped"  # this replica recorded the tick as skipped
    LOST = "lost"  # another replica owns the tick
    DEFERRED = "deferred"  # no free worker for it in this batch: try when one frees
    # another live replica's share of the burst, or a tick another claim is recording
    # now (PostgreSQL: a claim never waits for another): try again shortly
    YIELDED = "yielded"
    MISSED = "missed"  # this replica recorded the tick as missed
    HELD = "held"  # manual trigger only: the lock is held elsewhere
    ERROR = "error"  # the claim itself failed (a statement cut short): nothing was decided
    PAUSED = "paused"  # the job is paused for the fleet: this replica recorded the tick paused


@dataclass(frozen=True)
class ClaimRequest:
    key: int
    name: str
    scheduled_at: datetime
    intent: Intent
    grace_s: float
    skip_threshold: int
    fail_threshold: int = 3  # a stale run this claim marks crashed counts as a failure


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
    crashed: int = 0  # stale `running` rows this claim marked crashed
    notices: tuple[
        int, ...
    ] = ()  # outbox notices this claim raised (see `scheduler.observers.notices`)
    attempt: int = 1  # a retry (job `retries`): 2 for the first retry, and so on


class TickRef(NamedTuple):
    """One tick of one job: what an answer without a row of this replica's carries."""

    key: int
    scheduled_at: datetime


class ClaimAnswer(NamedTuple):
    """A claim's answer to every tick it was sent, in one shape on both backends.

    The backend decides each tick; the gate acts on the answer and derives nothing.
    `answered`: a ClaimResult for each tick this replica recorded (run, skipped,
    missed, paused) or could not lock (held). The rest, by outcome, as ticks alone:
    `lost` (another replica owns it), `yielded` (another live replica's share of a
    burst, or a tick another claim is recording at that moment: PostgreSQL only, as the
    embedded backend's claims take turns anyway) and
    `deferred` (no free worker for it in this batch).
    """

    answered: list[ClaimResult]
    lost: list[TickRef]
    yielded: list[TickRef]
    deferred: list[TickRef]

    def every(self) -> list[ClaimResult]:
        """Each tick sent, as a ClaimResult (the ticks without a row: their outcome alone)."""
        rest = {
            Outcome.LOST: self.lost,
            Outcome.YIELDED: self.yielded,
            Outcome.DEFERRED: self.deferred,
        }
        return self.answered + [
            ClaimResult(t.key, t.scheduled_at, outcome)
            for outcome, ticks in rest.items()
            for t in ticks
        ]


@dataclass(frozen=True)
class Crashes:
    """Runs of one job found crashed: how many, and the newest one's tick. They count as
    failures (`count_crashes`): the job's row may be new (its name), and its streak alerts
    at the threshold in force (its fail_alert_after)."""

    name: str
    fail_threshold: int
    count: int
    newest: datetime


class Retries(NamedTuple):
    """What a look for due retries took, and when the next one of these jobs is due."""

    started: list[ClaimResult]
    next_in: float | None  # seconds from now (at most 0: due but its lock is held)


class FinishRequest(NamedTuple):  # a tuple: a burst's finishes make hundreds of these
    key: int
    scheduled_at: datetime
    run_id: int
    status: Status  # succeeded, failed, interrupted or crashed
    error: str | None
    unlock: bool  # False when the session that took the lock is gone
    fail_threshold: int
    told: str | None = None  # what the run was told while it ran (see statuses.Told)
    duration_s: float | None = None  # the run's own duration, measured here
    next_due: datetime | None = None  # the job's next tick: a run ended by then kept up
    retry_in_s: float | None = None  # failed, with another attempt due this much later


class Recheck(NamedTuple):
    """A run that no worker took within its lease (scheduler/gate/ahead.py): asked again
    before it starts."""

    key: int
    scheduled_at: datetime
    run_id: int
    give_back: bool  # not to run here (a reload took its job away): its row and lock go
    # What a pause does to it: `run` (a scheduled or caught-up tick: recorded paused),
    # `retry` (an attempt after a failure: waits again for the resume), `asked` (a run a
    # person asked for: nothing).
    kind: str = "run"


class FinishResult(NamedTuple):
    key: int
    scheduled_at: datetime
    recorded: bool  # False: the row was no longer ours (marked crashed elsewhere)
    finished_at: datetime | None = None
    # failed: the streak, this failure included; succeeded: the streak it ends
    consecutive_failures: int | None = None
    alert: bool = False  # this failure made the failure streak reach its threshold
    recovered: bool = False  # this success ends a failure streak that had alerted
    skips_recovered: bool = False  # this run kept up, ending an overrun that had alerted
    notices: tuple[int, ...] = ()


class SessionLost(Exception):
    """The session that held this replica's locks is gone; every lock with it.

    Only a broken connection is a lost session: a statement the server cut short
    (statement or lock timeout, a deadlock, a serialization failure) raises the
    driver's error and leaves the session, and its locks, as they were.
    """


class Unavailable(Exception):
    """The backend cannot be reached right now; try again later."""


class LockStore(Protocol):
    """What the gate needs: the lock session (locks, claims, finishes; one per replica)."""

    name: str
    # Locks that belong to a network session need a watchdog: a session that cannot be
    # proven alive for holder_timeout has lost them. Kernel file locks do not.
    needs_watchdog: bool
    # Whether run-now requests wake the replica (PostgreSQL's NOTIFY); if not, it looks.
    notifies_requests: bool
    # Whether the gate claims runs ahead of its free workers (each claim is a round trip
    # worth saving), under a lease and `recheck` (scheduler/gate/ahead.py).
    claims_ahead: bool

    def shape(self) -> Shape | None:
        """The fleet as a recent claim saw it (backends/shares.py): None where a backend
        shares nothing out, and until a claim has seen it."""

    def untaken(self, ticks: Sequence[tuple[int, datetime]]) -> list[int]:
        """Of these (job key, tick), the places of those no replica has recorded."""

    def connect(self) -> None:
        """Open the lock session; raises Unavailable."""

    def close(self) -> None:
        """Release every lock by ending the session."""

    def claim(self, requests: Sequence[ClaimRequest], instance: str, capacity: int) -> ClaimAnswer:
        """Decide and answer every tick of a batch atomically, winning at most `capacity`
        runs. Raises SessionLost.
        """

    def recheck(self, runs: Sequence[Recheck]) -> list[Outcome]:
        """Runs whose lease ran out, one outcome each, in order: `run` (its start is
        stamped now; it may start), `paused` (the job was paused since its claim: a tick
        recorded paused, a retry waiting again) or `lost` (given back, or no longer this
        run's row). A run that will not start has its lock released. Raises SessionLost."""

    def held_keys(self) -> set[int]:
        """The job locks this session holds now. Raises SessionLost."""

    def release_strays(self, expected: Collection[int]) -> list[int]:
        """Release every job lock this session holds other than `expected` (the jobs this
        replica runs), however many times it was taken; returns the keys released.

        The lock invariant's one enforcer: called after any call that may have taken
        locks fails; each heartbeat keeps it too. Raises SessionLost.
        """

    def finish(self, requests: Sequence[FinishRequest]) -> list[FinishResult]:
        """Record finished runs and release their locks; raises SessionLost."""

    def heartbeat(self, expected: Collection[int] | None = None) -> list[int]:
        """Prove the session is alive; with `expected`, keep the lock invariant in the same
        round trip (as `release_strays`), returning the keys released. Raises SessionLost."""

    def fileno(self) -> int | None:
        """A socket that becomes readable when the server ends the session, if any."""

    def check_alive(self) -> None:
        """Called when fileno() is readable; raises SessionLost if the session ended."""

    def abort(self) -> None:
        """From any thread: make a call hanging on a dead server fail now."""

    def claim_retries(
        self,
        instance: str,
        keys: Sequence[int],
        capacity: int,
        crashed: str,
        fail_thresholds: Sequence[int] | None = None,
    ) -> Retries:
        """Start due retries of these jobs, lock first, at most `capacity`. SessionLost.

        `fail_thresholds` (one per key): stale runs marked crashed count as failures.
        """

    def retry_due_in(self) -> float | None:
        """Seconds to the fleet's next retry, as the last heartbeat saw it (None: none)."""

    def requests_pending(self) -> bool:
        """Whether a run-now request may be waiting (cheap: no round trip on PostgreSQL)."""

    def take_requests(self, instance: str, keys: Sequence[int]) -> list[RunRequest]:
        """Take waiting run-now requests for these jobs (scheduler.fleet.run_now). SessionLost."""


class LedgerStore(Protocol):
    """What housekeeping, notices and the commands need: a second connection, never the
    lock session."""

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

    def count_crashes(self, conn: Connection, crashes: Mapping[int, Crashes]) -> dict[int, int]:
        """Crashed runs count as failures (the claim's rule, for the sweep): each job's
        failure streak grows, and alerts once at its threshold; job key -> the alert's
        notice. Takes the jobs' rows in key order: call it after any tick rows."""


class Backend(LockStore, LedgerStore, Protocol):
    """A store of locks and ledger rows: PostgreSQL, or the embedded SQLite file."""
