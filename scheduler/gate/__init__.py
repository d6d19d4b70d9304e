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
  `scheduler_decide`), scheduled ones before manual and caught-up ones;
- look for due retries (`retries.py`; `scheduler_claim_retries`);
- at each heartbeat, check the lock invariant in the heartbeat's own round trip:
  every lock this session holds with no run here is given back (`release_strays`),
  as after any failed call that may have taken locks (`LockSession.give_back`).

The helpers answer; the dispatcher acts: a claim returns the runs it won and
the dispatcher starts them (the run table of `runs.py` hands them to worker
threads, `scheduler.gate.workers`, where each runs to its ending). The backends
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
from datetime import UTC, datetime

from scheduler.backends.base import Intent, LockStore, Outcome, Recheck, SessionLost
from scheduler.errors import one_line
from scheduler.gate.ahead import LEASE
from scheduler.gate.backlog import helper_order
from scheduler.gate.claims import Claimed, Claims, claim_request
from scheduler.gate.finishes import Finishes
from scheduler.gate.retries import RetryLook
from scheduler.gate.runs import ManualResult, Pool, Run, Running, RunTable
from scheduler.gate.session import Backoff, LockSession
from scheduler.gate.ticks import ManualTicks, RequestDesk, TickQueue, outcome
from scheduler.gate.workers import Workers
from scheduler.observers import events
from scheduler.registry.catalog import CatalogJob
from scheduler.statuses import NOT_STARTED_LOCK_LOST, NOT_STARTED_UNSURE, Status

log = logging.getLogger("scheduler.gate")

REQUESTS_LOOK_EVERY = 1.0  # seconds between looks for run-now requests, without notifications
CAUGHT_UP, ASKED = frozenset({Intent.CATCH_UP}), frozenset({Intent.MANUAL})


Clock = Callable[[], datetime]
Monotonic = Callable[[], float]


def utc_now() -> datetime:
    return datetime.now(UTC)


class Waker:
    """The dispatcher's pipe: any thread wakes it with one write (its selector watches it)."""

    def __init__(self) -> None:
        self.fileno, self._write = os.pipe()
        os.set_blocking(self.fileno, False)
        os.set_blocking(self._write, False)

    def __call__(self) -> None:
        with contextlib.suppress(BlockingIOError):  # the pipe is full: already awake
            os.write(self._write, b"\0")

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.fileno, 4096):
                pass


class Watch:
    """What the dispatcher waits on: its wake-up pipe, and the lock session's socket (the
    server speaks between our calls only to end the session, or to notify)."""

    def __init__(self, wake: Waker) -> None:
        self.wake = wake
        self.selector = selectors.DefaultSelector()
        self.selector.register(wake.fileno, selectors.EVENT_READ)
        self.watched: tuple[int, int] | None = None  # (session, socket) being watched

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *_: object) -> None:
        self.selector.close()

    def wait(self, session: int, fd: int | None, timeout: float) -> None:
        """Until the pipe or the socket of this session (`fd`, None: none) speaks, or
        `timeout` seconds."""
        current = (session, fd) if fd is not None else None
        if current != self.watched:
            if self.watched is not None:
                self.selector.unregister(self.watched[1])  # tolerates a closed socket
            if current is not None:
                self.selector.register(current[1], selectors.EVENT_READ)
            self.watched = current
        for key, _ in self.selector.select(timeout):
            if key.fd == self.wake.fileno:
                self.wake.drain()


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
        self.holder_timeout = holder_timeout
        self.emit = events.Emitter(listeners)
        self.listeners = self.emit.listeners  # observers may join before the start
        self.wake = Waker()
        self.clock, self.monotonic = clock, monotonic
        self.session = LockSession(
            backend,
            holder_timeout,
            monotonic,
            on_told=lambda generation, reason, first: None,  # the run table's, below
            on_up=functools.partial(self.emit, events.LockSessionUp(instance, backend.name)),
        )
        self.queue = TickQueue(monotonic, order=helper_order(instance))
        self.claims = Claims(backend, self.session, self.queue, instance=instance, emit=self.emit)
        self.retries = RetryLook(
            backend, self.session, instance=instance, monotonic=monotonic, clock=clock
        )
        self.finishes = Finishes(
            backend,
            self.session,
            instance=instance,
            monotonic=monotonic,
            clock=clock,
            emit=self.emit,
            wake=self.wake,
            retry_scheduled=self.retries.due_in,
            full=2 * max_workers,
        )
        self.table = RunTable(
            instance=instance,
            max_workers=max_workers,
            workers=workers or Workers(max_workers),  # a simulation hands runs out itself
            ended=self.finishes.ended,
            emit=self.emit,
            clock=clock,
            monotonic=monotonic,
            wake=self.wake,
        )
        self.session.on_told = self.table.told  # the runs told are the table's
        self.ahead = backend.claims_ahead  # claims may win runs beyond the free workers
        self.manual = ManualTicks(clock)
        self._stepping = threading.Lock()  # held by the dispatcher for each step
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_loop = monotonic()

    # -- the outside world -----------------------------------------------------------

    def submit(self, job: CatalogJob, scheduled_at: datetime) -> None:
        """Queue a tick fired by APScheduler (any thread)."""
        self.submit_all((job,), scheduled_at)

    def submit_all(self, jobs: Sequence[CatalogJob], scheduled_at: datetime) -> None:
        """Queue the same tick of several jobs (jobs on one schedule fire together)."""
        if self.queue.add(jobs, scheduled_at, self.backend.shape()):
            self.wake()

    @contextlib.contextmanager
    def burst(self) -> Iterator[None]:
        """Ticks submitted inside are claimed together, once the burst is complete."""
        with self.queue.burst():
            yield
        self.wake()

    def reloaded(self, current: Callable[[int], CatalogJob | None]) -> None:
        """A reload took effect: queued ticks of jobs no longer scheduled here are dropped,
        the others follow the job's new settings. Returns between two steps of the
        dispatcher, so from then on no path starts a disabled job on its own."""
        with self._stepping:
            self.queue.refresh(current)
            self.table.give_back(lambda key: (job := current(key)) is not None and job.scheduled)

    def trigger(self, job: CatalogJob, timeout: float | None = None) -> ManualResult:
        """Run one tick of `job` now, through the same gate (`scheduler trigger`)."""
        result: Future[ManualResult] = Future()
        self.manual.add(job, result)
        self.wake()
        return outcome(result, self.monotonic, timeout)

    def catch_up(self, job: CatalogJob, tick: datetime) -> ManualResult:
        """Claim one missed tick (`catch_up: all`), lock first; wait for its run to end.

        `held`: an older tick of the job still runs (here or elsewhere); the
        caller tries again. `lost`: another replica took it. `missed`: past
        the job's catch_up_window.
        """
        result: Future[ManualResult] = Future()
        self.manual.add(job, result, tick, Intent.CATCH_UP)
        self.wake()
        return outcome(result, self.monotonic, until=self._stopped)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="gate", daemon=True)
        watchdog = threading.Thread(
            target=self.session.watch, args=(self._stopped, self.wake), name="gate-watchdog"
        )
        watchdog.daemon = True
        self._thread.start()
        watchdog.start()

    def running_jobs(self) -> list[str]:
        return self.table.names()

    def run_ids(self) -> set[int]:
        """The runs of this replica still going, or ended with their finish not recorded."""
        return {run.ctx.run_id for run in self.table.runs()}

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
        with self._stepping:  # a claim on its way may still start runs
            runs = self.table.runs()
        self.table.stopping.set()
        deadline = self.monotonic() + grace
        if runs:
            self._drain(deadline)
        self._flush_finishes(deadline)
        if any(run.ended is None for run in self.table.runs()):
            self.session.tell("still running when shutdown_grace ran out")
        abandoned = self.table.abandon(grace)
        self._flush_finishes(self.monotonic() + max(5.0, self.session.heartbeat_every))
        self._stopped.set()
        self.wake()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if not abandoned:
            self.backend.close()
            self.table.workers.shutdown()
        return [run.job.name for run in abandoned]

    def _drain(self, deadline: float) -> None:
        """Until every run here has ended or `deadline`: runs won ahead may still need the
        dispatcher (asked again) before a worker starts them."""
        while self.table.going() and self.monotonic() < deadline:
            self.wake()
            self.table.workers.wait(timeout=max(0.0, min(0.05, deadline - self.monotonic())))

    def _flush_finishes(self, deadline: float) -> None:
        while self.monotonic() < deadline:
            if not self.table.any_ended() and not self.finishes.pending():
                return
            self.wake()
            self._stopped.wait(0.02)

    # -- the dispatcher thread -------------------------------------------------------

    def _loop(self) -> None:
        with Watch(self.wake) as watch:
            while not self._stopped.is_set():
                self._last_loop = self.monotonic()
                fd = self.backend.fileno() if self.session.connected else None
                try:
                    watch.wait(self.session.opened, fd, self._wait_time())
                    self.step()
                except Exception:
                    log.exception("gate loop error (continuing)")
                    self._stopped.wait(0.5)

    def _wait_time(self) -> float:
        wait = self.session.wait_time()
        if not self.session.connected:
            return wait
        now = self.monotonic()
        finish_at = self.finishes.due_at(self.table.gathered_at, self._hold_finishes())
        if finish_at is not None:
            wait = min(wait, max(0.0, finish_at - now))
        if self.manual.pending() or self.table.waiting_recheck():
            return 0.0
        due = self.queue.next_due(self.table.free_slots(), self.table.running)
        if due is not None:
            wait = min(wait, max(0.0, due - now))
        retry = self.retries.wait()
        if retry is not None and self.table.free_slots() > 0:
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
        self._guard(self._take_requests)
        self._guard(self._recheck)
        # Finished runs are recorded once the claims have started new ones, so that their
        # round trip overlaps those runs; first, if a tick of one of their jobs waits (it
        # would be claimed `skipped` behind a run that has ended).
        if self.finishes.waiting_for(self.queue.has, self.manual.has):
            self._guard(self._record_finishes)
        # Oldest first: ticks caught up after downtime, then the scheduled ones, then
        # run-now requests, so that a run-now taken in the same step never takes a due
        # tick's place (its lock would make the tick `skipped`).
        self._guard(lambda: self._failed(self._claim_manual(CAUGHT_UP), "catch-up"))
        self._guard(lambda: self._failed(self._claim_queued(), "claim"))
        self._guard(lambda: self._failed(self._claim_manual(ASKED), "run-now claim"))
        self._guard(lambda: self._failed(self._claim_retries(), "look for due retries"))
        self._guard(self._record_finishes)
        if session.heartbeat_due():
            self._guard(self._heartbeat)

    def _heartbeat(self) -> None:
        """Runs abandoned at shutdown keep their locks: no invariant is checked then."""
        stopping = self.table.stopping.is_set()
        expected = None if stopping else self.table.expected_locks(self.session.opened)
        self._released(self.session.heartbeat(expected), after=None)
        self.retries.due_in(self.backend.retry_due_in())

    def _failed(self, failed: bool, what: str) -> None:
        """A call that may take locks failed: what it left is given back."""
        if failed:
            self._give_back(after=what)

    def _give_back(self, after: str) -> None:
        """The lock invariant after a failed call (`after` names it): what the call left."""
        expected = self.table.expected_locks(self.session.opened)
        self._released(self.session.give_back(expected), after)

    def _released(self, released: list[int], after: str | None) -> None:
        """Locks given back; at the heartbeat (`after` None), any is a fault."""
        if released:
            desk = self.desk
            named = tuple(
                (key, job.name if (job := desk and desk.job(key)) else None) for key in released
            )
            self.emit(events.LocksReleased(self.instance, named, after))

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

    def _record_finishes(self) -> None:
        due = self.finishes.due_at(self.table.gathered_at, self._hold_finishes())
        if due is None or (due > self.monotonic() and not self.table.stopping.is_set()):
            return
        for run in self.finishes.record():
            self.table.recorded(run)
            if run.job.retries:
                # A look for retries leaves out the jobs running here, and so forgets when
                # their retries fall due: one that fell due while this run went on (its
                # next tick, say) is taken now, not at the next heartbeat.
                self.retries.due_in(0)

    def _hold_finishes(self) -> bool:
        """Whether finished runs may wait for the next batch: runs go on here, and will
        wake the dispatcher when they end."""
        return self.table.going() and not self.table.stopping.is_set()

    def _take_requests(self) -> None:
        desk = self.desk
        if desk is None or self.table.stopping.is_set() or not self.backend.requests_pending():
            return
        self.manual.take_requests(self.backend, self.session, desk, self.instance)

    def _claim_queued(self) -> bool:
        """Claim the queued ticks; each batch's runs start as soon as its answer comes
        (those won ahead of a free worker, as one frees), each under a lease: one a
        worker takes later is asked again first (gate/ahead.py)."""
        failed, session = False, self.session
        for claimed in self.claims.queued(self.table.budget(self.ahead), self.table.running):
            lease = claimed.sent + LEASE
            self.table.start(claimed.won, session.generation, session.opened, lease_until=lease)
            failed = failed or claimed.failed
        return failed

    def _recheck(self) -> None:
        """Runs won ahead whose lease ran out before a worker took them: asked again, and
        started, recorded paused, or given back (gate/ahead.py). If the call fails, none
        of them starts: the call may have given their locks back."""
        expired, opened = self.table.expired(), self.session.opened
        for run, _ in expired:
            if run.session != opened or run.generation.lock_lost.is_set():
                self.table.ended(run, Status.CRASHED, NOT_STARTED_LOCK_LOST)  # its lock is gone
        expired = [(run, e) for run, e in expired if run.ended is None]
        if not expired:
            return
        asked = [
            Recheck(run.job.key, run.ctx.scheduled_at, run.ctx.run_id, run.give_back, run.kind)
            for run, _ in expired
        ]
        sent = self.monotonic()
        try:
            answer = self.session.round_trip(lambda: self.backend.recheck(asked))
        except Exception as exc:
            reason = "the session was lost" if isinstance(exc, SessionLost) else one_line(exc)
            log.warning("asking again for %d run(s) won ahead failed (%s)", len(asked), reason)
            for run, _ in expired:
                self.table.ended(run, Status.CRASHED, NOT_STARTED_UNSURE.format(reason=reason))
            if isinstance(exc, SessionLost):
                raise
            return
        assert isinstance(answer, list)
        go = []
        for (run, started), said in zip(expired, answer, strict=True):
            if said is Outcome.RUN:
                go.append((run, started))
                continue
            self.table.dropped(run)
            if run.manual is not None:  # whoever waits for it learns it did not run
                run.manual.set_result(ManualResult(said))
            if said is Outcome.PAUSED and run.kind == "run":  # a retry waits, unrecorded
                job = run.job
                self.emit(events.TickPaused(job.name, job.key, run.ctx.scheduled_at, self.instance))
        self.table.relet(go, sent + LEASE)

    def _claim_manual(self, intents: frozenset[Intent]) -> bool:
        """Claim the queued manual ticks of these intents (run-now, caught-up); returns
        whether a claim failed.

        After a failed claim the rest wait for the next step: the failed one may have
        left the job's lock taken, and a second claim of that job would take it again
        on top (advisory locks stack), beyond what the give-back after it leaves.
        """
        manual = self.manual.take(intents)
        for i, m in enumerate(manual):
            if self.table.stopping.is_set():  # shutting down: nothing new starts here
                m.result.set_result(ManualResult(Outcome.LOST, error="this replica is stopping"))
            elif m.intent is Intent.CATCH_UP and not _enabled_now(self.desk, m.job):
                m.result.set_result(ManualResult(Outcome.LOST, error="disabled by a reload"))
            elif self.table.running(m.job.key) is not Running.NOT:
                m.result.set_result(ManualResult(Outcome.HELD, holder=self.instance))
            else:
                sent = self.monotonic()
                try:
                    claimed = self.claims.manual(m.job, m.tick, m.result, m.intent)
                except SessionLost:
                    self.manual.put_back(manual[i:])  # they wait for the next session
                    raise
                session, caught_up = self.session, m.intent is Intent.CATCH_UP
                self.table.start(
                    claimed.won,
                    session.generation,
                    session.opened,
                    m.result,
                    caught_up,
                    lease_until=sent + LEASE,
                )
                if claimed.failed:
                    self.manual.put_back(manual[i + 1 :])
                    return True
        return False

    def _claim_retries(self) -> bool:
        """Start due retries of jobs this replica has and is not running (retries.py);
        returns whether the look failed or took a lock no run here holds."""
        desk = self.desk
        if desk is None or self.table.stopping.is_set():
            return False
        sent = self.monotonic()
        won, failed = self.retries.look(desk, self.table.running_keys, self.table.free_slots())
        session = self.session
        self.table.start(won, session.generation, session.opened, lease_until=sent + LEASE)
        return failed


def _enabled_now(desk: RequestDesk | None, job: CatalogJob) -> bool:
    """Whether the catalog in force now (after any reload) has the job enabled."""
    current = desk.job(job.key) if desk is not None else job
    return current is not None and current.enabled


__all__ = ["Backoff", "Claimed", "Gate", "ManualResult", "Run", "claim_request", "utc_now"]
