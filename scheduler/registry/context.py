"""RunContext: what a job function receives about the tick it is running; Interrupted."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from datetime import datetime


@dataclass(frozen=True)
class RunContext:
    """The identity of one run, and the signals it must watch.

    ``run_id`` grows with every run of the fleet: pass it to the systems the
    job writes to, so they can refuse a write from a run that is older than
    one they have already seen (a stale run whose replica froze and lost its
    lock). ``lock_lost`` is set the moment this replica can no longer prove it
    holds the job's lock; ``stopping`` when the daemon shuts down;
    ``timed_out`` when the run has taken longer than the job's `timeout`
    (a coroutine job is cancelled then; a thread cannot be: return soon).
    ``attempt`` counts the runs of this tick: a retry has the same
    ``scheduled_at`` and a new ``run_id``.
    """

    job_name: str
    key: int
    scheduled_at: datetime
    instance: str
    run_id: int
    lock_lost: threading.Event = field(default_factory=threading.Event)
    stopping: threading.Event = field(default_factory=threading.Event)
    timed_out: threading.Event = field(default_factory=threading.Event)
    attempt: int = 1  # 1 for the first; 2 and up for a retry of the same tick (job `retries`)
    log: logging.LoggerAdapter[logging.Logger] = field(
        default_factory=lambda: logging.LoggerAdapter(logging.getLogger("scheduler.job"))
    )


class Interrupted(Exception):
    """Raise it from a job to stop early when told to (`ctx.stopping`, `ctx.lock_lost`).

    The run is recorded `interrupted`, not `failed`: it is no failure of the
    job, and it does not count towards `fail_alert_after`. The message, if
    any, is kept as the run's reason.
    """
