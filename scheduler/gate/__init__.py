"""The gate: every tick of every job passes here, and runs on exactly one replica.

The protocol (fire, claim, run, finish; retries and catch-up; locks follow
runs; the lock session) is told once, in docs/guarantees.md, "How a tick
runs". This module is its dispatcher: one thread, which alone talks to the
backend, does each step in order (`Gate.step`):

- make sure of the lock session (`session.py`: heartbeat, watchdog, and
  `ctx.lock_lost` for the runs of a session in doubt);
- record finished runs, in batches (`finishes.py`; `scheduler_finish`);
- take run-now requests;
- claim the queued ticks (`ticks.py` keeps them, `claims.py` sends them;
  `scheduler_claim`), scheduled ones before manual and caught-up ones;
- look for due retries (`retries.py`; `scheduler_claim_retries`);
- at each heartbeat, check the lock invariant: every lock this session holds
  with no run here is given back (`Gate._give_back`; `release_strays`), as
  after any failed call that may have taken locks.

Runs execute on worker threads (`runs.py`, `scheduler.gate.workers`). The backends
implement the steps under the names used here (PostgreSQL:
`backends/postgres.sql`; one host: `backends/embedded.py`). Time is passed in
(`clock`, `monotonic`), so this logic can be driven in tests without sleeping.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import select
import selectors
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from datetime import UTC, datetime, timedelta
from typing import Protocol

from scheduler.backends.base import Intent, LockStore, Outcome, SessionLost
from scheduler.config.schedules import format_duration
from scheduler.errors import one_line
from scheduler.gate.claims import Claims, Won, claim_request
from scheduler.gate.finishes import Finishes
from scheduler.gate.retries import RetryLook
from scheduler.gate.runner import execute
from scheduler.gate.runs import ManualResult, Run, prepare
from scheduler.gate.session import Backoff, LockSession
from scheduler.gate.ticks import Running, TickQueue
from scheduler.gate.workers import Workers
from scheduler.ledger import RunRequest
from scheduler.observers import events
from scheduler.registry.catalog import CatalogJob
from scheduler.statuses import CRASHED_AT_SHUTDOWN, TIMED_OUT, Status

log = logging.getLogger("scheduler.gate")

RETRY_LOOK_AGAIN = 1.0  # seconds before a look for due retries that failed is made again
REQUESTS_LOOK_EVERY = 1.0  # seconds between looks for run-now requests, without notifications
CAUGHT_UP, ASKED = frozenset({Intent.CATCH_UP}), frozenset({Intent.MANUAL})


Clock = Callable[[], datetime]
Monotonic = Callable[[], float]


def utc_now() -> datetime:
    return datetime.now(UTC)


class Gate:
    """Decides, for each tick this replica sees, whether it runs here; and runs it.

    One dispatcher thread does every step against the backend (`step`); the
    runs execute on worker threads; the watchdog watches the lock session.
    """

    def __init__(
        self,
        backend: LockStore,
        *,
        instance: str,
        max_workers: int,
        holder_timeout: float,
        listeners: Sequence[events.Listener] = (),
        clock: Clock = utc_now,
        monotonic: Monotonic = time.monotonic,
        desk: RequestDesk | None = None,
        workers: Pool | None = None,
    ) -> None:
        self.backend = backend
        self.desk = desk  # run-now requests from the fleet's commands (None: none taken)
        self.instance = instance
        self.max_workers = max_workers
        self.holder_timeout = holder_timeout
        self.listeners = list(listeners)
        self.clock = clock
        self.monotonic = monotonic
        self.session = LockSession(
            backend,
            holder_timeout,
            monotonic,
            on_told=self._told,
            on_up=lambda: self._emit(events.LockSessionUp(self.instance, backend.name)),
        )
        self.queue = TickQueue(monotonic)
        self.claims = Claims(
            backend,
            self.session,
            self.queue,
            instance=instance,
            emit=self._emit,
            start=self._start_runs,
        )
        self.finishes = Finishes(
            backend,
            self.session,
            instance=instance,
            monotonic=monotonic,
            emit=self._emit,
            wake=self._wake,
            retry_scheduled=lambda seconds: self.retries.due_in(seconds),
        )
        self.retries = RetryLook(
            backend, self.session, instance=instance, monotonic=monotonic, clock=clock
        )
        self._mutex = threading.Lock()  # the runs and the manual requests
        self._runs: dict[int, Run] = {}  # job key -> run executing here
        self._manual: list[tuple[CatalogJob, datetime, Future[ManualResult], Intent]] = []
        self._stopping_runs = threading.Event()  # one per daemon: every run shares it
        self._stepping = threading.Lock()  # held by the dispatcher for each step
        self._stopped = threading.Event()
        self._workers = workers or Workers(max_workers)  # a simulation hands runs out itself
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread: threading.Thread | None = None
        self._last_loop = monotonic()

    # -- the outside world -----------------------------------------------------------

    def submit(self, job: CatalogJob, scheduled_at: datetime) -> None:
        """Queue a tick fired by APScheduler (any thread)."""
        self.submit_all((job,), scheduled_at)

    def submit_all(self, jobs: Sequence[CatalogJob], scheduled_at: datetime) -> None:
        """Queue the same tick of several jobs (jobs on one schedule fire together)."""
        if self.queue.add(jobs, scheduled_at):
            self._wake()

    @contextlib.contextmanager
    def burst(self) -> Iterator[None]:
        """Ticks submitted inside are claimed together, once the burst is complete."""
        with self.queue.burst():
            yield
        self._wake()

    def reloaded(self, current: Callable[[int], CatalogJob | None]) -> None:
        """A reload took effect: queued ticks of jobs no longer scheduled here are dropped,
        the others follow the job's new settings. Returns between two steps of the
        dispatcher, so from then on no path starts a disabled job on its own."""
        with self._stepping:
            self.queue.refresh(current)

    def trigger(self, job: CatalogJob, timeout: float | None = None) -> ManualResult:
        """Run one tick of `job` now, through the same gate (`scheduler trigger`)."""
        result: Future[ManualResult] = Future()
        self._queue_manual(job, result)
        self._wake()
        deadline = None if timeout is None else self.monotonic() + timeout
        while not result.done():  # awake every second for a signal's handler (Daemon.run)
            left = 1.0 if deadline is None else min(1.0, deadline - self.monotonic())
            if left <= 0:
                return ManualResult(Outcome.LOST, error="timed out")
            with contextlib.suppress(TimeoutError):
                result.result(timeout=left)
        return result.result()

    def catch_up(self, job: CatalogJob, tick: datetime) -> ManualResult:
        """Claim one missed tick (`catch_up: all`), lock first; wait for its run to end.

        `held`: an older tick of the job still runs (here or elsewhere); the
        caller tries again. `lost`: another replica took it. `missed`: past
        the job's catch_up_window.
        """
        result: Future[ManualResult] = Future()
        self._queue_manual(job, result, tick, Intent.CATCH_UP)
        self._wake()
        while not self._stopped.is_set():
            with contextlib.suppress(TimeoutError):
                return result.result(timeout=1.0)
        return ManualResult(Outcome.LOST, error="stopping")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="gate", daemon=True)
        watchdog = threading.Thread(
            target=self.session.watch, args=(self._stopped, self._wake), name="gate-watchdog"
        )
        watchdog.daemon = True
        self._thread.start()
        watchdog.start()

    def running_jobs(self) -> list[str]:
        with self._mutex:
            return [run.job.name for run in self._runs.values()]

    @property
    def connected(self) -> bool:
        return self.session.connected

    def alive(self) -> bool:
        """The dispatcher loop turns: it wakes at least every heartbeat or reconnect delay."""
        thread = self._thread
        stalled = self.monotonic() - self._last_loop > 2 * self.holder_timeout + 10
        return thread is not None and thread.is_alive() and not stalled

    def stop(self, grace: float) -> list[str]:
        """Start nothing new, tell runs to stop, wait up to `grace`, release every lock.

        Returns the jobs still running when the grace ran out. Those runs are
        told their lock is lost first, then recorded `crashed` without releasing
        their locks: the caller must end the process at once, and the locks go
        with its session (no other replica may start a job while its run here
        still goes on believing it holds the lock).
        """
        self.queue.close()
        with self._stepping, self._mutex:  # a claim on its way may still start runs
            runs = list(self._runs.values())
        self._stopping_runs.set()
        deadline = self.monotonic() + grace
        if runs:
            self._workers.wait(timeout=max(0.0, deadline - self.monotonic()))
        self._flush_finishes(deadline)
        with self._mutex:
            abandoned = [run for run in self._runs.values() if run.ended is None]
        if abandoned:
            self.session.tell("still running when shutdown_grace ran out")
            for run in abandoned:
                run.abandoned = True  # its lock goes with the process, not with its finish
                self.finishes.ended(run, Status.CRASHED, CRASHED_AT_SHUTDOWN.format(grace=grace))
        self._flush_finishes(self.monotonic() + max(5.0, self.session.heartbeat_every))
        self._stopped.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if not abandoned:
            self.backend.close()
            self._workers.shutdown()
        return [run.job.name for run in abandoned]

    def _flush_finishes(self, deadline: float) -> None:
        while self.monotonic() < deadline:
            with self._mutex:
                ended = any(run.ended for run in self._runs.values())
            if not ended and not self.finishes.pending():
                return
            self._wake()
            self._stopped.wait(0.02)

    # -- the dispatcher thread -------------------------------------------------------

    def _loop(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._wake_r, selectors.EVENT_READ)
        watched: tuple[int, int] | None = None  # (session, socket) being watched
        while not self._stopped.is_set():
            self._last_loop = self.monotonic()
            fd = self.backend.fileno() if self.session.connected else None
            current = (self.session.opened, fd) if fd is not None else None
            if current != watched:
                if watched is not None:
                    selector.unregister(watched[1])  # tolerates a closed socket
                if current is not None:
                    selector.register(current[1], selectors.EVENT_READ)
                watched = current
            try:
                for key, _ in selector.select(self._wait_time()):
                    if key.fd == self._wake_r:
                        self._drain_wake()
                self.step()
            except Exception:
                log.exception("gate loop error (continuing)")
                self._stopped.wait(0.5)
        selector.close()

    def _wait_time(self) -> float:
        wait = self.session.wait_time()
        if not self.session.connected:
            return wait
        now = self.monotonic()
        if self.finishes.pending():
            wait = min(wait, max(0.0, self.finishes.paused_until - now))
        with self._mutex:
            if self._manual:
                return 0.0
        due = self.queue.next_due(self._free_slots())
        if due is not None:
            wait = min(wait, max(0.0, due - now))
        retry = self.retries.wait()
        if retry is not None and self._free_slots() > 0:
            wait = min(wait, retry)
        if self.desk is not None and not self.backend.notifies_requests:
            wait = min(wait, REQUESTS_LOOK_EVERY)  # no server notifies this backend of them
        return wait

    def step(self) -> None:
        """One pass: connect if needed, record finished runs, claim queued ticks, heartbeat."""
        with self._stepping:
            self._step()

    def _step(self) -> None:
        session = self.session
        if not session.ensure():
            return
        if self._server_said_something():
            self._guard(session.check_socket)
        if session.in_doubt():
            session.lose("no round trip succeeded within holder_timeout")
            return
        self._guard(self._record_finishes)
        self._guard(self._take_requests)
        # Oldest first: ticks caught up after downtime, then the scheduled ones, then
        # run-now requests, so that a run-now taken in the same step never takes a due
        # tick's place (its lock would make the tick `skipped`).
        self._guard(lambda: self._locking(lambda: self._claim_manual(CAUGHT_UP), "catch-up"))
        self._guard(
            lambda: self._locking(
                lambda: self.claims.queued(self._free_slots(), self._running), "claim"
            )
        )
        self._guard(lambda: self._locking(lambda: self._claim_manual(ASKED), "run-now claim"))
        self._guard(lambda: self._locking(self._claim_retries, "look for due retries"))
        if session.heartbeat_due():
            self._guard(lambda: session.round_trip(self.backend.heartbeat))
            self.retries.due_in(self.backend.retry_due_in())
            if not self._stopping_runs.is_set():  # runs abandoned at shutdown keep theirs
                self._guard(lambda: self._give_back(after=None))

    def _locking(self, action: Callable[[], bool], what: str) -> None:
        """A step whose calls may take locks: if one failed, what it left is given back."""
        if action():
            self._give_back(after=what)

    def _expected_locks(self) -> set[int]:
        """The jobs whose lock this session should hold: those it runs (the lock invariant)."""
        opened = self.session.opened
        with self._mutex:
            return {key for key, run in self._runs.items() if run.session == opened}

    def _give_back(self, after: str | None) -> None:
        """Release every lock this session holds with no run of its job here.

        After a failed call (`after` names it), that is what the call left behind:
        advisory locks outlive the rollback of the transaction that took them. At
        the heartbeat (`after` None) it is the lock invariant's check, and whatever
        it finds is a fault, reported and counted. No claim is in flight meanwhile:
        the dispatcher alone talks to the backend. A session that cannot do this
        is given up, which releases every lock.
        """
        expected = self._expected_locks()
        try:
            released = self.session.round_trip(lambda: self.backend.release_strays(expected))
        except SessionLost:
            raise
        except Exception as exc:
            raise SessionLost(f"cannot give back stray locks ({one_line(exc)})") from None
        assert isinstance(released, list)
        if released:
            desk = self.desk
            named = tuple(
                (key, job.name if (job := desk and desk.job(key)) else None) for key in released
            )
            self._emit(events.LocksReleased(self.instance, named, after))

    def _server_said_something(self) -> bool:
        """Between our calls the server only speaks to end the session (or to notify)."""
        fd = self.backend.fileno()
        return fd is not None and bool(select.select([fd], [], [], 0)[0])

    def _guard(self, action: Callable[[], object]) -> None:
        """A failed session loses every lock; any other backend error is handled by `action`."""
        if not self.session.connected:
            return
        try:
            action()
        except SessionLost as exc:
            self.session.lose(str(exc))

    def _told(self, generation: int, reason: str, first: bool) -> None:
        """The runs of `generation` were told their lock is lost (LockSession.tell)."""
        with self._mutex:
            told = [r.job.name for r in self._runs.values() if r.generation.number == generation]
        if first or told:
            self._emit(events.LockSessionLost(self.instance, reason, tuple(told)))

    def _record_finishes(self) -> None:
        for run in self.finishes.record():
            with self._mutex:
                if self._runs.get(run.job.key) is run:
                    del self._runs[run.job.key]
            if run.job.retries:
                # A look for retries leaves out the jobs running here, and so forgets when
                # their retries fall due: one that fell due while this run went on (its
                # next tick, say) is taken now, not at the next heartbeat.
                self.retries.due_in(0)

    def _take_requests(self) -> None:
        """Run-now requests for jobs of this replica: each becomes a manual tick here."""
        desk = self.desk
        if desk is None or self._stopping_runs.is_set() or not self.backend.requests_pending():
            return
        taken = self.session.round_trip(
            lambda: self.backend.take_requests(self.instance, desk.keys())
        )
        assert isinstance(taken, list)
        for request in taken:
            job = desk.job(request.key)
            result: Future[ManualResult] = Future()
            result.add_done_callback(functools.partial(_settle, desk, request))
            if job is None:  # reloaded away between the take and now
                result.set_result(ManualResult(Outcome.LOST, error="no such job here any more"))
                continue
            log.info(
                "run-now: %s, asked by %s (request %d)", job.name, request.requested_by, request.id
            )
            self._queue_manual(job, result)

    def _queue_manual(
        self,
        job: CatalogJob,
        result: Future[ManualResult],
        tick: datetime | None = None,
        intent: Intent = Intent.MANUAL,
    ) -> None:
        """A tick claimed lock first by the claim step: a manual one has a tick of its own,
        "now", to the millisecond; a caught-up one, its missed tick."""
        if tick is None:
            now = self.clock()
            tick = now.replace(microsecond=now.microsecond // 1000 * 1000)
        with self._mutex:
            self._manual.append((job, tick, result, intent))

    def _claim_manual(self, intents: frozenset[Intent]) -> bool:
        """Claim the queued manual ticks of these intents (run-now, caught-up); returns
        whether a claim failed.

        After a failed claim the rest wait for the next step: the failed one may have
        left the job's lock taken, and a second claim of that job would take it again
        on top (advisory locks stack), beyond what the give-back after it leaves.
        """
        with self._mutex:
            manual = [entry for entry in self._manual if entry[3] in intents]
            self._manual = [entry for entry in self._manual if entry[3] not in intents]
        failed = False
        for i, (job, tick, result, intent) in enumerate(manual):
            if failed:
                with self._mutex:
                    self._manual[:0] = manual[i:]
                break
            if self._stopping_runs.is_set():  # shutting down: nothing new starts here
                result.set_result(ManualResult(Outcome.LOST, error="this replica is stopping"))
                continue
            if intent is Intent.CATCH_UP and not self._still_enabled(job):
                result.set_result(ManualResult(Outcome.LOST, error="disabled by a reload"))
                continue
            if job.key in self._runs:
                result.set_result(ManualResult(Outcome.HELD, holder=self.instance))
                continue
            try:
                failed = self.claims.manual(job, tick, result, intent)
            except SessionLost:
                with self._mutex:  # this one and every one after it wait for the next session
                    self._manual[:0] = manual[i:]
                raise
        return failed

    def _still_enabled(self, job: CatalogJob) -> bool:
        """Whether the catalog in force now (after any reload) has the job enabled."""
        current = self.desk.job(job.key) if self.desk is not None else job
        return current is not None and current.enabled

    def _claim_retries(self) -> bool:
        """Start due retries of jobs this replica has and is not running (retries.py).

        Returns whether the look failed or took a lock no run here holds.
        """
        desk = self.desk
        if desk is None or self._stopping_runs.is_set():
            return False
        known = desk.enabled_keys()
        with self._mutex:
            keys = [key for key in known if key not in self._runs]
        try:
            won, gone = self.retries.take(desk, keys, self._free_slots())
        except SessionLost:
            raise
        except Exception as exc:
            log.warning("looking for due retries failed (%s); looking again shortly", one_line(exc))
            self.retries.due_in(RETRY_LOOK_AGAIN)
            return True
        self._start_runs(won, None)
        return bool(gone)

    # -- runs ------------------------------------------------------------------------

    def _free_slots(self) -> int:
        with self._mutex:
            return self.max_workers - len(self._runs)

    def _running(self, key: int) -> Running:
        run = self._runs.get(key)
        if run is None:
            return Running.NOT
        return Running.LOST if run.generation.lock_lost.is_set() else Running.HERE

    def _start_runs(
        self, won: Won, manual: Future[ManualResult] | None, caught_up: bool = False
    ) -> None:
        """Hand the runs to workers; each worker reports its own start.

        Everything a run needs is prepared first and the hand-over is one
        tight loop: a worker woken early competes with the dispatcher for the
        interpreter, and would otherwise slow the start of the rest of a burst.
        """
        if not won:
            return
        generation, opened, now = self.session.generation, self.session.opened, self.monotonic()
        ready = [
            prepare(
                job,
                result,
                instance=self.instance,
                generation=generation,
                session=opened,
                stopping=self._stopping_runs,
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
        run_one = self._execute
        self._workers.submit_all([(run_one, (run, started)) for run, started in ready])

    def _execute(self, run: Run, started: events.RunStarted) -> None:
        self._emit(started)  # listeners are thread-safe
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
        self._emit(
            events.RunTimedOut(
                ctx.job_name, ctx.key, ctx.scheduled_at, ctx.run_id, self.instance, seconds
            )
        )

    # -- plumbing --------------------------------------------------------------------

    def _emit(self, event: events.Event) -> None:
        for listener in self.listeners:
            try:
                listener(event)
            except Exception:
                log.exception("listener %r failed on %s", listener, type(event).__name__)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # the pipe is full: already awake
            os.write(self._wake_w, b"\0")

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 4096):
                pass


class Pool(Protocol):
    """Where runs execute (scheduler.gate.workers.Workers; a test may run them when it chooses)."""

    def submit_all(self, tasks: list[tuple[Callable[..., None], tuple[object, ...]]]) -> None: ...

    def wait(self, timeout: float | None = None) -> bool: ...

    def shutdown(self) -> None: ...


class RequestDesk(Protocol):
    """Run-now requests (scheduler.fleet.run_now.Desk): the jobs this replica may take, and
    where an outcome goes (written on the ledger session, from the thread that ends it)."""

    def keys(self) -> list[int]: ...

    def enabled_keys(self) -> list[int]: ...

    def job(self, key: int) -> CatalogJob | None: ...

    def settle(
        self,
        request: RunRequest,
        outcome: str,
        status: str | None,
        run_id: int | None,
        error: str | None,
    ) -> None: ...


def _settle(desk: RequestDesk, request: RunRequest, done: Future[ManualResult]) -> None:
    result = done.result()
    held = f"held by {result.holder}" if result.holder else None
    status = None if result.status is None else str(result.status)
    desk.settle(request, str(result.outcome), status, result.run_id, result.error or held)


__all__ = ["Backoff", "Gate", "ManualResult", "Run", "claim_request", "utc_now"]
