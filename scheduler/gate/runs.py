"""A run on this replica: what it was given (its context), and how it ended."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import datetime

from scheduler.backends.base import ClaimResult, Outcome
from scheduler.gate.session import Generation
from scheduler.observers import events
from scheduler.registry.catalog import CatalogJob
from scheduler.registry.context import RunContext
from scheduler.statuses import Status, Told

# The ticks a claim won, each with its job: runs to start.
Won = list[tuple[CatalogJob, ClaimResult]]


@dataclass(frozen=True)
class ManualResult:
    """What `scheduler trigger` learns of its run."""

    outcome: Outcome
    status: Status | None = None
    error: str | None = None
    run_id: int | None = None
    holder: str | None = None


@dataclass(frozen=True)
class Ending:
    """How a run ended, as its finish records it."""

    status: Status
    error: str | None
    duration_s: float
    told: str | None  # what it was told while it ran (statuses.Told, comma-separated)
    # Failed with another attempt to come (job `retries`): due this many seconds later.
    retry_in_s: float | None = None

    @classmethod
    def of(cls, run: Run, status: Status, error: str | None, now: float) -> Ending:
        signals = ((Told.STOPPING, run.ctx.stopping), (Told.LOCK_LOST, run.ctx.lock_lost))
        told = ",".join(name for name, event in signals if event.is_set()) or None
        return cls(status, error, now - run.started, told, _retry_in(run, status))


def _retry_in(run: Run, status: Status) -> float | None:
    """None for a tick's last attempt: no retry left, no failure, or a run a person asked
    for (`scheduler trigger`: they see its outcome)."""
    if status is not Status.FAILED or run.asked:
        return None
    delay = run.job.retry_in(run.ctx.attempt)
    return None if delay is None else delay.total_seconds()


@dataclass
class Run:
    """A run executing on this replica."""

    job: CatalogJob
    ctx: RunContext
    generation: Generation  # of the session that took the lock; the lock is gone with it
    session: int  # which lock session took its lock (LockSession.opened): only it holds it
    started: float  # monotonic
    manual: Future[ManualResult] | None = None  # who waits for its outcome (trigger, catch-up)
    ended: Ending | None = None  # set when the job has returned (or was given up)
    caught_up: bool = False  # a tick missed while the fleet was down (`catch_up: all`)
    abandoned: bool = False  # still running when shutdown_grace ran out: its lock stays

    @property
    def asked(self) -> bool:
        """Asked for by a person (`scheduler trigger`): no retries, they see the outcome."""
        return self.manual is not None and not self.caught_up


def prepare(
    job: CatalogJob,
    result: ClaimResult,
    *,
    instance: str,
    generation: Generation,
    session: int,
    stopping: threading.Event,
    started: float,
    clock: Callable[[], datetime],
    manual: Future[ManualResult] | None,
    caught_up: bool = False,
) -> tuple[Run, events.RunStarted]:
    """A run the claim just won, and the event that announces its start."""
    assert result.run_id is not None
    ctx = RunContext(
        job_name=job.name,
        key=job.key,
        scheduled_at=result.scheduled_at,
        instance=instance,
        run_id=result.run_id,
        attempt=result.attempt,
        lock_lost=generation.lock_lost,
        stopping=stopping,
        log=logging.LoggerAdapter(
            job.log,
            {
                "job": job.name,
                "key": job.key,
                "run_id": result.run_id,
                "scheduled_at": result.scheduled_at.isoformat(),
            },
        ),
    )
    announced = events.RunStarted(
        job=job.name,
        key=job.key,
        scheduled_at=result.scheduled_at,
        run_id=result.run_id,
        instance=instance,
        lateness_s=((result.started_at or clock()) - result.scheduled_at).total_seconds(),
        manual=manual is not None and not caught_up,
        crashed=result.crashed,
        skips_ended=result.consecutive_skips or 0,
        ping_url=job.ping_url,
        attempt=result.attempt,
        caught_up=caught_up,
    )
    run = Run(
        job=job,
        ctx=ctx,
        generation=generation,
        session=session,
        started=started,
        manual=manual,
        caught_up=caught_up,
    )
    return run, announced
