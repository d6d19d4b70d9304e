"""What the gate reports. Logs, metrics, notices and pings observe these; none steer the gate.

An observer is an `Observer` that implements the methods of the events it
cares about (`run_started`, `run_finished`, ...): one dispatch, here, for
all of them, so a new event is a new method with a default that ignores it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

from scheduler.statuses import Status

log = logging.getLogger("scheduler.gate")  # a listener's failure, told where the gate logs


@dataclass(slots=True)  # not frozen: a frozen class is several times slower to build
class RunStarted:
    job: str
    key: int
    scheduled_at: datetime
    run_id: int
    instance: str
    lateness_s: float  # start (database clock) minus scheduled time
    manual: bool
    crashed: int  # stale runs of this job the claim marked crashed
    skips_ended: int  # length of the fleet-wide skip streak this run ends
    ping_url: str | None
    attempt: int = 1  # 2 and up: a retry of a failed attempt (job `retries`)
    caught_up: bool = False  # a tick missed while the fleet was down (`catch_up: all`)


@dataclass(slots=True)  # not frozen: a frozen class is several times slower to build
class RunFinished:
    job: str
    key: int
    scheduled_at: datetime
    run_id: int
    instance: str
    status: Status  # succeeded, failed, interrupted or crashed
    error: str | None
    duration_s: float
    recorded: bool  # False: the run had lost its lock and its row was taken over
    lock_lost: bool
    told: str | None  # what the run was told while it ran (statuses.Told, comma-separated)
    consecutive_failures: int | None  # failed: the streak so far; succeeded: the streak ended
    failures_threshold: int
    failures_alert: bool  # this failure made the streak reach its threshold
    failures_recovered: bool  # this success ends a failure streak that had alerted
    skips_recovered: bool  # this run kept up again after an overrun that had alerted
    notices: tuple[
        int, ...
    ]  # outbox notices the finish raised (delivered by scheduler.observers.notices)
    ping_url: str | None
    attempt: int = 1
    retry_in_s: float | None = None  # failed, and the next attempt is due this much later


@dataclass(slots=True)  # not frozen: a frozen class is several times slower to build
class TickSkipped:
    job: str
    key: int
    scheduled_at: datetime
    instance: str
    holder: str | None
    holder_since: datetime | None
    consecutive_skips: int
    threshold: int
    alert: bool  # this skip made the fleet-wide streak reach its threshold
    notices: tuple[
        int, ...
    ] = ()  # the alert, in the outbox (delivered by scheduler.observers.notices)


@dataclass(slots=True)  # not frozen: a frozen class is several times slower to build
class TickMissed:
    job: str
    key: int
    scheduled_at: datetime
    instance: str


@dataclass(slots=True)  # not frozen: a frozen class is several times slower to build
class RunTimedOut:
    job: str
    key: int
    scheduled_at: datetime
    run_id: int
    instance: str
    timeout_s: float


@dataclass(slots=True)  # not frozen: a frozen class is several times slower to build
class TickPaused:
    job: str
    key: int
    scheduled_at: datetime
    instance: str


@dataclass(slots=True)  # not frozen: a frozen class is several times slower to build
class LockSessionUp:
    instance: str
    backend: str


@dataclass(slots=True)  # not frozen: a frozen class is several times slower to build
class LockSessionLost:
    instance: str
    reason: str
    runs: tuple[str, ...]  # jobs whose ctx.lock_lost was set


@dataclass(slots=True)  # not frozen: a frozen class is several times slower to build
class LocksReleased:
    """Job locks this replica held with no run of them in flight, given back.

    `after`: the call that failed and left them (a claim cut short: expected, a
    warning); None: found by the heartbeat's check of the lock invariant (a fault,
    an error, counted).
    """

    instance: str
    jobs: tuple[tuple[int, str | None], ...]  # (key, name if this replica knows the job)
    after: str | None


Event = (
    RunStarted
    | RunFinished
    | TickSkipped
    | TickMissed
    | TickPaused
    | RunTimedOut
    | LockSessionUp
    | LockSessionLost
    | LocksReleased
)
Listener = Callable[[Event], None]


class Emitter:
    """Hands each event to every listener, in order; a listener that fails is logged
    and the others still hear it (observers never steer the gate)."""

    def __init__(self, listeners: Sequence[Listener] = ()) -> None:
        self.listeners = list(listeners)

    def __call__(self, event: Event) -> None:
        for listener in self.listeners:
            try:
                listener(event)
            except Exception:
                log.exception("listener %r failed on %s", listener, type(event).__name__)


class Observer:
    """A listener with one method per event; the ones it does not implement ignore theirs."""

    def __call__(self, event: Event) -> None:
        getattr(self, _METHODS[type(event)])(event)

    def run_started(self, event: RunStarted) -> None:
        return None

    def run_finished(self, event: RunFinished) -> None:
        return None

    def tick_skipped(self, event: TickSkipped) -> None:
        return None

    def tick_missed(self, event: TickMissed) -> None:
        return None

    def tick_paused(self, event: TickPaused) -> None:
        return None

    def run_timed_out(self, event: RunTimedOut) -> None:
        return None

    def lock_session_up(self, event: LockSessionUp) -> None:
        return None

    def lock_session_lost(self, event: LockSessionLost) -> None:
        return None

    def locks_released(self, event: LocksReleased) -> None:
        return None


_METHODS: dict[type, str] = {
    RunStarted: "run_started",
    RunFinished: "run_finished",
    TickSkipped: "tick_skipped",
    TickMissed: "tick_missed",
    TickPaused: "tick_paused",
    RunTimedOut: "run_timed_out",
    LockSessionUp: "lock_session_up",
    LockSessionLost: "lock_session_lost",
    LocksReleased: "locks_released",
}
