"""The runs on this replica: what each was given (its context) and how it ended, and the
table of those executing here, handed to workers and run there to their ending.

What the dispatcher asks of them (free workers, whether a job runs here, the
locks this session should hold) is read from the table under one mutex.
Nothing here talks to the backend.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import Enum
from typing import Protocol

from scheduler.backends.base import ClaimResult, Outcome
from scheduler.config.schedules import format_duration
from scheduler.gate.ahead import RunLengths
from scheduler.gate.runner import execute
from scheduler.gate.session import Generation
from scheduler.observers import events
from scheduler.registry.catalog import CatalogJob
from scheduler.registry.context import RunContext
from scheduler.statuses import CRASHED_AT_SHUTDOWN, NOT_STARTED_LOCK_LOST, TIMED_OUT, Status, Told

# The ticks a claim won, each with its job: runs to start.
Won = list[tuple[CatalogJob, ClaimResult]]
# Seconds a run that has ended waits for the runs that started with it (a claim's batch):
# they end within milliseconds of each other, and are recorded, and their workers offered
# to a claim, together rather than one or two at a time.
GATHER = 0.02
WAITED = 0.001  # seconds a run waited for a worker that its reported lateness counts


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
    started: float  # monotonic: handed to the workers, then begun (`RunTable.begin`)
    manual: Future[ManualResult] | None = None  # who waits for its outcome (trigger, catch-up)
    ended: Ending | None = None  # set when the job has returned (or was given up)
    caught_up: bool = False  # a tick missed while the fleet was down (`catch_up: all`)
    abandoned: bool = False  # still running when shutdown_grace ran out: its lock stays
    batch: int = 0  # the runs a claim won are handed over together, as one batch
    # It may start until then (monotonic), else is asked again first (gate/ahead.py);
    # the gate gives every run one. None: it starts whenever a worker takes it.
    lease_until: float | None = None
    begun: bool = False  # a worker has started it (or it never will: given back, lost)
    give_back: bool = False  # a reload took its job away before it began: not to start
    waited: float = 0.0  # seconds from its hand-over to a worker's start of it

    @property
    def kind(self) -> str:
        """What a pause does to it before it begins (backends/base.py, `Recheck.kind`)."""
        if self.asked:
            return "asked"
        return "retry" if self.ctx.attempt > 1 and not self.caught_up else "run"

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


def _ended_at(run: Run) -> float:
    ending = run.ended
    assert ending is not None
    return run.started + ending.duration_s


class Running(Enum):
    """What this replica is doing with a job right now, as far as its next tick cares."""

    NOT = "not"  # free to run it
    HERE = "here"  # a run of it holds its lock here: ticks are skipped
    LOST = "lost"  # a run of it goes on here after its lock was lost: others may take ticks


class Pool(Protocol):
    """Where runs execute (scheduler.gate.workers.Workers; a test may run them when it chooses)."""

    def submit_all(self, tasks: list[tuple[Callable[..., None], tuple[object, ...]]]) -> None: ...

    def wait(self, timeout: float | None = None) -> bool: ...

    def shutdown(self) -> None: ...


class RunTable:
    def __init__(
        self,
        *,
        instance: str,
        max_workers: int,
        workers: Pool,
        ended: Callable[[Run, Status, str | None], None],
        emit: Callable[[events.Event], None],
        clock: Callable[[], datetime],
        monotonic: Callable[[], float],
        wake: Callable[[], None] = lambda: None,
    ) -> None:
        self.instance = instance
        self.max_workers = max_workers
        self.workers = workers
        self.ended = ended  # Finishes.ended: the dispatcher records it
        self.wake = wake  # the last run of a batch ended: its finishes wait no more
        self.emit = emit
        self.clock = clock
        self.monotonic = monotonic
        self.stopping = threading.Event()  # one per daemon: every run shares it
        self._mutex = threading.Lock()
        self._runs: dict[int, Run] = {}  # job key -> run executing here
        self._batches = itertools.count(1)
        self.lengths = RunLengths()  # how long runs here last: how many to claim ahead
        # Won ahead, lease run out: the dispatcher asks again (`begin`).
        self._expired: list[tuple[Run, events.RunStarted]] = []

    def budget(self, ahead: bool) -> int:
        """Runs a claim may win now: the free workers, and with `ahead` (the backend claims
        ahead), what they would start within `ahead.HORIZON`."""
        free = self.free_slots()
        return free + self.lengths.ahead(free) if ahead else free

    # -- what the dispatcher reads ---------------------------------------------------

    def free_slots(self) -> int:
        """Workers free: a run that has ended frees its worker once its batch is gathered
        (`gathered_at`), though its finish may wait longer."""
        now = self.monotonic()
        with self._mutex:
            going = self._going()
            held = sum(
                run.ended is None or (run.batch in going and now < _ended_at(run) + GATHER)
                for run in self._runs.values()
            )
        return self.max_workers - held

    def running(self, key: int) -> Running:
        """Whether `key` runs here, and whether that run still has its lock."""
        run = self._runs.get(key)
        if run is None:
            return Running.NOT
        return Running.LOST if run.generation.lock_lost.is_set() else Running.HERE

    def running_keys(self) -> set[int]:
        with self._mutex:
            return set(self._runs)

    def names(self) -> list[str]:
        with self._mutex:
            return [run.job.name for run in self._runs.values()]

    def runs(self) -> list[Run]:
        with self._mutex:
            return list(self._runs.values())

    def expected_locks(self, opened: int) -> set[int]:
        """The jobs whose lock session `opened` should hold: those it runs (the lock invariant)."""
        with self._mutex:
            return {key for key, run in self._runs.items() if run.session == opened}

    def told(self, generation: int, reason: str, first: bool) -> None:
        """The runs of `generation` were told their lock is lost (`LockSession.tell`)."""
        with self._mutex:
            told = [r.job.name for r in self._runs.values() if r.generation.number == generation]
        if first or told:
            self.emit(events.LockSessionLost(self.instance, reason, tuple(told)))

    def recorded(self, run: Run) -> None:
        """`run`'s finish is recorded: its job is free here."""
        with self._mutex:
            if self._runs.get(run.job.key) is run:
                del self._runs[run.job.key]

    def any_ended(self) -> bool:
        with self._mutex:
            return any(run.ended for run in self._runs.values())

    def gathered_at(self, run: Run) -> float:
        """When `run`, which has ended, is done waiting for the runs of its batch: at
        once if none goes on, else `GATHER` after it ended."""
        with self._mutex:
            going = run.batch in self._going()
        return _ended_at(run) + GATHER if going else 0.0

    def going(self) -> bool:
        """Whether a run here has yet to end."""
        with self._mutex:
            return any(run.ended is None for run in self._runs.values())

    def _going(self) -> set[int]:
        """The batches with a run still going."""
        return {run.batch for run in self._runs.values() if run.ended is None}

    # -- runs ------------------------------------------------------------------------

    def start(
        self,
        won: Won,
        generation: Generation,
        opened: int,
        manual: Future[ManualResult] | None = None,
        caught_up: bool = False,
        lease_until: float | None = None,
    ) -> None:
        """Hand the runs to workers; each worker reports its own start.

        Everything a run needs is prepared first and the hand-over is one
        tight loop: a worker woken early competes with the dispatcher for the
        interpreter, and would otherwise slow the start of the rest of a burst.
        """
        if not won:
            return
        now = self.monotonic()
        ready = [
            prepare(
                job,
                result,
                instance=self.instance,
                generation=generation,
                session=opened,
                stopping=self.stopping,
                started=now,
                clock=self.clock,
                manual=manual,
                caught_up=caught_up,
            )
            for job, result in won
        ]
        batch = next(self._batches)
        with self._mutex:
            for run, _ in ready:
                run.batch, run.lease_until = batch, lease_until
                self._runs[run.job.key] = run
        run_one = self.execute
        self.workers.submit_all([(run_one, (run, started)) for run, started in ready])

    def begin(self, run: Run, started: events.RunStarted) -> bool:
        """Whether a worker may start `run` now; every start asks here first.

        No run starts once its lock went with a lost session: it is recorded crashed,
        not started (a worker may take it long after its claim: behind busy workers, or
        in a process that was stopped). A scheduled tick's run starts only within its
        lease, and not once a reload took its job away; past its lease, or given back,
        it goes to the dispatcher (`expired`) and wakes it.
        """
        if run.lease_until is None:
            if run.generation.lock_lost.is_set():
                self.ended(run, Status.CRASHED, NOT_STARTED_LOCK_LOST)
                return False
            self._begun(run)
            return True
        with self._mutex:
            if run.begun:
                return False
            run.begun = True
            lost = run.generation.lock_lost.is_set()
            late = run.give_back or self.monotonic() > run.lease_until
            if late and not lost:
                run.begun = False
                self._expired.append((run, started))
        if lost:
            self.ended(run, Status.CRASHED, NOT_STARTED_LOCK_LOST)
            return False
        if late:
            self.wake()
            return False
        self._begun(run)
        return True

    def _begun(self, run: Run) -> None:
        now = self.monotonic()
        run.waited, run.started = max(0.0, now - run.started), now

    def waiting_recheck(self) -> bool:
        """Whether runs handed back wait to be asked again (the dispatcher: at once)."""
        with self._mutex:
            return bool(self._expired)

    def expired(self) -> list[tuple[Run, events.RunStarted]]:
        """The runs handed back to be asked again (`begin`), taken out."""
        with self._mutex:
            taken, self._expired = self._expired, []
        return taken

    def relet(self, runs: list[tuple[Run, events.RunStarted]], lease_until: float) -> None:
        """Runs asked again and free to go: to the workers, with a new lease."""
        with self._mutex:
            for run, _ in runs:
                run.lease_until = lease_until
        self.workers.submit_all([(self.execute, task) for task in runs])

    def dropped(self, run: Run) -> None:
        """A run asked again that will not start here (paused, given back): its job is free."""
        with self._mutex:
            run.begun = True
            if self._runs.get(run.job.key) is run:
                del self._runs[run.job.key]

    def give_back(self, keep: Callable[[int], bool]) -> int:
        """After a reload: runs won ahead and not begun, of jobs not `keep`, are not to
        start here; returns how many. Under the dispatcher's step lock, so that none of
        them starts once the reload has returned."""
        with self._mutex:
            marked = [
                run
                for run in self._runs.values()
                if run.lease_until is not None
                and not run.begun
                and run.manual is None
                and run.ctx.attempt == 1
                and not keep(run.job.key)
            ]
            for run in marked:
                run.give_back = True
        return len(marked)

    def execute(self, run: Run, started: events.RunStarted) -> None:
        """On a worker: the run, from its start told to its ending handed over (`ended`)."""
        if not self.begin(run, started):
            return
        if run.waited > WAITED:  # its lateness, as claimed, and as long again in the queue
            started = dataclasses.replace(started, lateness_s=started.lateness_s + run.waited)
        self.emit(started)  # listeners are thread-safe
        timeout = run.job.timeout
        timer = None
        if timeout is not None:  # only jobs with a timeout pay for a timer thread
            timer = threading.Timer(timeout.total_seconds(), self._time_out, (run, timeout))
            timer.daemon = True
            timer.start()
        status, error = execute(run.job.spec, run.ctx)
        if timer is not None:
            timer.cancel()
        if timeout is not None and run.ctx.timed_out.is_set():
            status, error = Status.FAILED, TIMED_OUT.format(timeout=format_duration(timeout))
        self.lengths.add(self.monotonic() - run.started)
        self.ended(run, status, error)
        with self._mutex:
            last = run.batch not in self._going()
        if last:
            self.wake()

    def _time_out(self, run: Run, timeout: timedelta) -> None:
        """The run passed its job's timeout: told now; it keeps the lock until it returns."""
        run.ctx.timed_out.set()
        ctx = run.ctx
        seconds = timeout.total_seconds()
        self.emit(
            events.RunTimedOut(
                ctx.job_name, ctx.key, ctx.scheduled_at, ctx.run_id, self.instance, seconds
            )
        )

    def abandon(self, grace: float) -> list[Run]:
        """At shutdown, the runs still going when the grace ran out: recorded crashed, and
        their locks left to go with the process (their finishes must not release them)."""
        with self._mutex:
            abandoned = [run for run in self._runs.values() if run.ended is None]
        for run in abandoned:
            run.abandoned = True
            self.ended(run, Status.CRASHED, CRASHED_AT_SHUTDOWN.format(grace=grace))
        return abandoned
