"""The runs executing on this replica, one per job: handed to workers, run, ended.

What the dispatcher asks of them (free workers, whether a job runs here, the
locks this session should hold) is read here under one mutex; a won run is
handed to a worker here, and the worker runs it here to its ending, which it
gives to `Finishes`. Nothing here talks to the backend.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from datetime import datetime, timedelta
from typing import Protocol

from scheduler.config.schedules import format_duration
from scheduler.gate.finishes import Finishes
from scheduler.gate.runner import execute
from scheduler.gate.runs import ManualResult, Run, Won, prepare
from scheduler.gate.session import Generation
from scheduler.gate.ticks import Running
from scheduler.observers import events
from scheduler.statuses import CRASHED_AT_SHUTDOWN, TIMED_OUT, Status


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
        finishes: Finishes,
        emit: Callable[[events.Event], None],
        clock: Callable[[], datetime],
        monotonic: Callable[[], float],
    ) -> None:
        self.instance = instance
        self.max_workers = max_workers
        self.workers = workers
        self.finishes = finishes
        self.emit = emit
        self.clock = clock
        self.monotonic = monotonic
        self.stopping = threading.Event()  # one per daemon: every run shares it
        self._mutex = threading.Lock()
        self._runs: dict[int, Run] = {}  # job key -> run executing here

    # -- what the dispatcher reads ---------------------------------------------------

    def free_slots(self) -> int:
        with self._mutex:
            return self.max_workers - len(self._runs)

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

    # -- runs ------------------------------------------------------------------------

    def start(
        self,
        won: Won,
        generation: Generation,
        opened: int,
        manual: Future[ManualResult] | None = None,
        caught_up: bool = False,
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
        with self._mutex:
            for run, _ in ready:
                self._runs[run.job.key] = run
        run_one = self.execute
        self.workers.submit_all([(run_one, (run, started)) for run, started in ready])

    def execute(self, run: Run, started: events.RunStarted) -> None:
        """On a worker: the run, from its start told to its ending given to `Finishes`."""
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
        self.finishes.ended(run, status, error)

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
            self.finishes.ended(run, Status.CRASHED, CRASHED_AT_SHUTDOWN.format(grace=grace))
        return abandoned
