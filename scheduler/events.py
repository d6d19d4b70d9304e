"""What the gate reports. Logs, metrics, alerts and pings observe these; none steer the gate."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from scheduler.statuses import Status


@dataclass(frozen=True)
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


@dataclass(frozen=True)
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
    notices: tuple[int, ...]  # outbox notices the finish raised (delivered by scheduler.notices)
    ping_url: str | None


@dataclass(frozen=True)
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
    notices: tuple[int, ...] = ()  # the alert, in the outbox (delivered by scheduler.notices)


@dataclass(frozen=True)
class TickMissed:
    job: str
    key: int
    scheduled_at: datetime
    instance: str


@dataclass(frozen=True)
class SessionUp:
    instance: str
    backend: str


@dataclass(frozen=True)
class SessionLost:
    instance: str
    reason: str
    runs: tuple[str, ...]  # jobs whose ctx.lock_lost was set


Event = RunStarted | RunFinished | TickSkipped | TickMissed | SessionUp | SessionLost
Listener = Callable[[Event], None]
