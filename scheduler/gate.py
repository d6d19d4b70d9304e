"""The gate: every tick of every job passes here, and runs on exactly one replica.

The whole story, in order:

1. APScheduler fires tick T of job J on every replica. T is the scheduled
   time, computed identically everywhere (see `scheduler.schedules`); it is
   the tick's identity, never "now".
2. `submit` queues the tick. The dispatcher thread, which alone talks to the
   backend, takes every queued tick at once (APScheduler hands over a burst
   of due ticks whole) and asks the backend to claim the batch in one round
   trip (`Backend.claim`), winning at most as many runs as it has free
   workers: the rest stay unclaimed, for later or for another replica.
3. The claim is an INSERT of the row (J.key, T) into the ledger. Its primary
   key lets exactly one replica win; the others are told `lost` and are done.
   This is what makes a tick run once when clocks are skewed or a job
   finishes in a millisecond: a lock alone is free again by the time a slow
   replica's trigger fires.
4. The winner tries J's advisory lock (lock_namespace, J.key) in the same
   transaction. Got it: the run starts, and any other `running` row of J is
   stale (its replica died, which freed the lock) and is marked `crashed`.
   Not got: the previous run still holds it, and T is recorded `skipped`,
   once for the fleet, growing J's fleet-wide skip streak.
5. A replica never takes a lock it already holds: advisory locks stack within
   a session, so a tick of a job this replica is still running is claimed
   with intent `skip` and never reaches the lock.
6. When the run ends, `Backend.finish` updates its row only if it is still
   `running` with this run_id, then releases the lock: a stale run never
   overwrites the record of what replaced it.
7. The lock session is watched: the server ends it if this replica goes
   quiet for `holder_timeout` (frozen, cut off), so its locks pass to
   others. Here, the moment we can no longer prove we hold our locks (the
   session failed, or no round trip has succeeded for `holder_timeout`),
   every local run's `ctx.lock_lost` is set, the session is dropped and a new
   one is opened with backoff. No backend error ever ends the daemon.

Time is passed in (`clock`, `monotonic`) so this logic can be driven in tests
without sleeping.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import selectors
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from scheduler import events
from scheduler.backends.base import (
    Backend,
    ClaimRequest,
    ClaimResult,
    FinishRequest,
    FinishResult,
    Intent,
    Outcome,
    SessionLost,
    Unavailable,
)
from scheduler.catalog import CatalogJob
from scheduler.context import RunContext
from scheduler.runner import execute
from scheduler.workers import Workers

log = logging.getLogger("scheduler.gate")

YIELDED_RETRY = 0.1  # seconds before trying a tick left to another replica's share

Clock = Callable[[], datetime]
Monotonic = Callable[[], float]


def utc_now() -> datetime:
    return datetime.now(UTC)


def claim_request(job: CatalogJob, tick: datetime, intent: Intent) -> ClaimRequest:
    return ClaimRequest(
        key=job.key,
        name=job.name,
        scheduled_at=tick,
        intent=intent,
        grace_s=job.misfire_grace.total_seconds(),
        skip_threshold=job.skip_threshold,
    )


@dataclass
class Run:
    """A run executing on this replica."""

    job: CatalogJob
    ctx: RunContext
    generation: int  # the session that took the lock; the lock is gone with it
    started: float  # monotonic
    status: str | None = None  # set when the job has returned (or was given up)
    error: str | None = None

    @property
    def done(self) -> bool:
        return self.status is not None


@dataclass
class Finish:
    run: Run
    status: str
    error: str | None
    duration_s: float


@dataclass(frozen=True)
class ManualResult:
    outcome: Outcome
    status: str | None = None
    error: str | None = None
    run_id: int | None = None
    holder: str | None = None


class Backoff:
    """Reconnect delays: at once, then doubling up to a cap."""

    def __init__(self, first: float = 0.1, cap: float = 5.0) -> None:
        self.first, self.cap, self.attempts = first, cap, 0

    def next_delay(self) -> float:
        delay = 0.0 if self.attempts == 0 else min(self.cap, self.first * 2 ** (self.attempts - 1))
        self.attempts += 1
        return delay

    def reset(self) -> None:
        self.attempts = 0


class Gate:
    """Decides, for each tick this replica sees, whether it runs here; and runs it."""

    def __init__(
        self,
        backend: Backend,
        *,
        instance: str,
        max_workers: int,
        holder_timeout: float,
        listeners: Sequence[events.Listener] = (),
        clock: Clock = utc_now,
        monotonic: Monotonic = time.monotonic,
    ) -> None:
        self.backend = backend
        self.instance = instance
        self.max_workers = max_workers
        self.holder_timeout = holder_timeout
        self.heartbeat_every = holder_timeout / 3
        self.listeners = list(listeners)
        self.clock = clock
        self.monotonic = monotonic

        self._mutex = threading.Lock()
        # The newest tick of each job waiting here, and when it may be tried.
        self._pending: dict[int, tuple[CatalogJob, datetime, float]] = {}
        self._manual: list[tuple[CatalogJob, datetime, threading.Event, list[ManualResult]]] = []
        self._finished: list[Finish] = []
        self._runs: dict[int, Run] = {}  # job key -> run executing here
        self._manual_runs: dict[int, tuple[threading.Event, list[ManualResult]]] = {}
        self._accepting = True
        self._bursts = 0  # APScheduler is submitting a burst of due ticks
        self._stopped = threading.Event()

        # One event per daemon, one per lock session: every run shares them.
        self._stopping_runs = threading.Event()
        self._lock_lost = threading.Event()
        self._stepping = threading.Lock()  # held by the dispatcher for each step
        self._generation = 0  # bumped whenever the lock session is lost
        self._sessions = 0  # bumped whenever a lock session opens
        self._connected = False
        self._last_proof = monotonic()  # send time of the last round trip that succeeded
        self._backoff = Backoff()
        self._retry_at = 0.0  # next reconnect attempt
        self._paused_until = 0.0  # after a backend error other than a lost session

        self._workers = Workers(max_workers)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread: threading.Thread | None = None
        self._watchdog: threading.Thread | None = None
        self._last_loop = monotonic()

    # -- the outside world -----------------------------------------------------------

    def submit(self, job: CatalogJob, scheduled_at: datetime) -> None:
        """Queue a tick fired by APScheduler (any thread)."""
        self.submit_all((job,), scheduled_at)

    def submit_all(self, jobs: Sequence[CatalogJob], scheduled_at: datetime) -> None:
        """Queue the same tick of several jobs (jobs on one schedule fire together).

        Only the newest tick of a job waits here: an older one that is still
        queued was not claimed in time by this replica and is left to the
        others (or recorded `missed` by the sweep).
        """
        with self._mutex:
            if not self._accepting:
                return
            pending = self._pending
            for job in jobs:
                queued = pending.get(job.key)
                if queued is None or queued[1] < scheduled_at:
                    pending[job.key] = (job, scheduled_at, 0.0)
            if self._bursts:
                return  # the end of the burst wakes the dispatcher once
        self._wake()

    @contextlib.contextmanager
    def burst(self) -> Iterator[None]:
        """Ticks submitted inside are claimed together, once the burst is complete."""
        with self._mutex:
            self._bursts += 1
        try:
            yield
        finally:
            with self._mutex:
                self._bursts -= 1
            self._wake()

    def trigger(self, job: CatalogJob, timeout: float | None = None) -> ManualResult:
        """Run one tick of `job` now, through the same gate (`scheduler trigger`)."""
        done = threading.Event()
        result: list[ManualResult] = []
        now = self.clock()
        tick = now.replace(microsecond=now.microsecond // 1000 * 1000)
        with self._mutex:
            self._manual.append((job, tick, done, result))
        self._wake()
        if timeout is None:
            while not done.wait(1.0):  # awake for a signal's handler (see Daemon.run)
                pass
        else:
            done.wait(timeout)
        return result[0] if result else ManualResult(Outcome.LOST, error="timed out")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="gate", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="gate-watchdog", daemon=True)
        self._thread.start()
        self._watchdog.start()

    def running_jobs(self) -> list[str]:
        with self._mutex:
            return [run.job.name for run in self._runs.values()]

    @property
    def connected(self) -> bool:
        return self._connected

    def alive(self) -> bool:
        """The dispatcher loop turns: it wakes at least every heartbeat or reconnect delay."""
        thread = self._thread
        stalled = self.monotonic() - self._last_loop > 2 * self.holder_timeout + 10
        return thread is not None and thread.is_alive() and not stalled

    def stop(self, grace: float) -> list[str]:
        """Start nothing new, tell runs to stop, wait up to `grace`, release every lock.

        Returns the jobs still running when the grace ran out; they are
        recorded `crashed` and their locks released.
        """
        with self._mutex:
            self._accepting = False
            self._pending.clear()
        # A claim already on its way may still start runs: let its step end first.
        with self._stepping, self._mutex:
            runs = list(self._runs.values())
        self._stopping_runs.set()
        deadline = self.monotonic() + grace
        if runs:
            self._workers.wait(timeout=max(0.0, deadline - self.monotonic()))
        self._flush_finishes(deadline)
        with self._mutex:
            abandoned = [run for run in self._runs.values() if not run.done]
        for run in abandoned:
            self._finished_run(run, "crashed", f"still running after shutdown_grace ({grace:g} s)")
        self._flush_finishes(self.monotonic() + max(5.0, self.heartbeat_every))
        self._stopped.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.backend.close()
        self._workers.shutdown()
        return [run.job.name for run in abandoned]

    def _flush_finishes(self, deadline: float) -> None:
        while self.monotonic() < deadline:
            with self._mutex:
                if not self._finished and not any(run.done for run in self._runs.values()):
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
            fd = self.backend.fileno() if self._connected else None
            current = (self._sessions, fd) if fd is not None else None
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
        now = self.monotonic()
        if not self._connected:
            return max(0.0, self._retry_at - now)
        heartbeat = max(0.0, self._last_proof + self.heartbeat_every - now)
        if now < self._paused_until:
            return min(heartbeat, self._paused_until - now)
        with self._mutex:
            if self._finished or self._manual:
                return 0.0
            if self._pending and self._free_slots() > 0 and not self._bursts:
                ready = min(not_before for _, _, not_before in self._pending.values())
                return min(heartbeat, max(0.0, ready - now))
        return heartbeat

    def step(self) -> None:
        """One pass: connect if needed, record finished runs, claim queued ticks, heartbeat."""
        with self._stepping:
            self._step()

    def _step(self) -> None:
        if not self._connected and not self._reconnect():
            return
        if self._server_said_something():
            self._guard(self.backend.check_alive)
        if not self._connected:
            return
        if self.monotonic() - self._last_proof > self.holder_timeout:
            self._lose_session("no round trip succeeded within holder_timeout")
            return
        if self.monotonic() >= self._paused_until:
            self._guard(self._record_finishes)
            self._guard(self._claim_manual)
            self._guard(self._claim_pending)
        if self._connected and self.monotonic() - self._last_proof >= self.heartbeat_every:
            self._guard(self._heartbeat)

    def _server_said_something(self) -> bool:
        """Between our calls the server only speaks to end the session (or to notify)."""
        fd = self.backend.fileno()
        return fd is not None and bool(select.select([fd], [], [], 0)[0])

    def _guard(self, action: Callable[[], None]) -> None:
        """A failed session loses every lock; any other backend error is logged and retried."""
        if not self._connected:
            return
        try:
            action()
        except SessionLost as exc:
            self._lose_session(str(exc))

    def _round_trip(self, call: Callable[[], object]) -> object:
        sent = self.monotonic()
        result = call()
        self._last_proof = max(self._last_proof, sent)
        return result

    # -- claims ----------------------------------------------------------------------

    def _free_slots(self) -> int:
        return self.max_workers - len(self._runs)

    def _claim_pending(self) -> None:
        """Claim every queued tick in one round trip, winning at most the free workers."""
        with self._mutex:
            if self._bursts or not self._accepting:
                return  # the rest of the burst is on its way, or we are stopping
            capacity = self._free_slots()
            now = self.monotonic()
            batch: list[tuple[CatalogJob, datetime, Intent]] = []
            for key, (job, tick, not_before) in list(self._pending.items()):
                if not_before > now:
                    continue
                run = self._runs.get(key)
                if run is not None and run.generation != self._generation:
                    # A run here lost its lock and has not ended yet: it no longer
                    # speaks for the job. Leave the tick to the other replicas.
                    del self._pending[key]
                    continue
                if run is not None:
                    batch.append((job, tick, Intent.SKIP))
                elif capacity > 0:
                    batch.append((job, tick, Intent.RUN))
                else:
                    continue  # waits for a free worker; another replica may take it
                del self._pending[key]
        if not batch:
            return
        requests = [claim_request(job, tick, intent) for job, tick, intent in batch]
        try:
            results = self._claim(requests, capacity)
        except SessionLost:
            self._requeue(batch)
            raise
        except Exception:
            log.exception("claiming %d ticks failed; retrying", len(requests))
            self._requeue(batch)
            return
        jobs = {job.key: job for job, _, _ in batch}
        # Start the runs before any bookkeeping: their lateness is what counts.
        self._start_runs(
            [(jobs[r.key], r) for r in results if r.outcome is Outcome.RUN], manual=False
        )
        for result in results:
            if result.outcome is not Outcome.RUN:
                self._claimed(jobs[result.key], result, manual=False)
        # No free worker for these yet: they are tried again when one frees.
        self._requeue(
            [
                (jobs[r.key], r.scheduled_at, Intent.RUN)
                for r in results
                if r.outcome is Outcome.DEFERRED
            ]
        )
        # Another replica's share of the burst: tried again once anyone may take it.
        self._requeue(
            [
                (jobs[r.key], r.scheduled_at, Intent.RUN)
                for r in results
                if r.outcome is Outcome.YIELDED
            ],
            not_before=self.monotonic() + YIELDED_RETRY,
        )

    def _claim(self, requests: list[ClaimRequest], capacity: int) -> list[ClaimResult]:
        """One round trip; a failed claim may leave locks it took (they outlive rollbacks)."""
        try:
            results = self._round_trip(
                lambda: self.backend.claim(requests, self.instance, capacity)
            )
        except SessionLost:
            raise
        except Exception:
            keys = [r.key for r in requests if r.intent in (Intent.RUN, Intent.MANUAL)]
            if keys:
                try:
                    self._round_trip(lambda: self.backend.release(keys))
                except Exception as exc:
                    raise SessionLost(f"cannot release locks after a failed claim: {exc}") from exc
            self._paused_until = self.monotonic() + 1.0
            raise
        assert isinstance(results, list)
        return results

    def _requeue(
        self, batch: list[tuple[CatalogJob, datetime, Intent]], not_before: float = 0.0
    ) -> None:
        with self._mutex:
            if not self._accepting:
                return  # stopping: these ticks are left to the other replicas
            for job, tick, _ in batch:
                queued = self._pending.get(job.key)
                if queued is None or queued[1] < tick:
                    self._pending[job.key] = (job, tick, not_before)

    def _claim_manual(self) -> None:
        with self._mutex:
            manual, self._manual = self._manual, []
        for job, tick, done, out in manual:
            if job.key in self._runs:
                out.append(ManualResult(Outcome.HELD, holder=self.instance))
                done.set()
                continue
            request = claim_request(job, tick, Intent.MANUAL)
            try:
                (result,) = self._claim([request], capacity=1)
            except SessionLost:
                with self._mutex:
                    self._manual.append((job, tick, done, out))
                raise
            except Exception as exc:
                out.append(ManualResult(Outcome.LOST, error=str(exc)))
                done.set()
                continue
            if result.outcome is Outcome.RUN:
                self._manual_runs[job.key] = (done, out)
            else:
                out.append(ManualResult(result.outcome, holder=result.holder))
                done.set()
            self._claimed(job, result, manual=True)

    def _claimed(self, job: CatalogJob, result: ClaimResult, manual: bool) -> None:
        if result.outcome is Outcome.RUN:
            self._start_runs([(job, result)], manual=manual)
        elif result.outcome is Outcome.SKIPPED:
            self._emit(
                events.TickSkipped(
                    job=job.name,
                    key=job.key,
                    scheduled_at=result.scheduled_at,
                    instance=self.instance,
                    holder=result.holder,
                    holder_since=result.holder_since,
                    consecutive_skips=result.consecutive_skips or 0,
                    threshold=job.skip_threshold,
                    alert=result.alert,
                )
            )
        elif result.outcome is Outcome.MISSED:
            self._emit(events.TickMissed(job.name, job.key, result.scheduled_at, self.instance))

    def _start_runs(self, won: list[tuple[CatalogJob, ClaimResult]], manual: bool) -> None:
        """Hand the runs to workers; each worker reports its own start.

        Everything a run needs is prepared first and the hand-over is one
        tight loop: a worker woken early competes with the dispatcher for the
        interpreter, and would otherwise slow the start of the rest of a burst.
        """
        if not won:
            return
        generation, now = self._generation, self.monotonic()
        ready = [self._prepare_run(job, result, manual, generation, now) for job, result in won]
        with self._mutex:
            for run, _ in ready:
                self._runs[run.job.key] = run
        execute = self._execute
        self._workers.submit_all([(execute, (run, started)) for run, started in ready])

    def _prepare_run(
        self, job: CatalogJob, result: ClaimResult, manual: bool, generation: int, now: float
    ) -> tuple[Run, events.RunStarted]:
        assert result.run_id is not None
        ctx = RunContext(
            job_name=job.name,
            key=job.key,
            scheduled_at=result.scheduled_at,
            instance=self.instance,
            run_id=result.run_id,
            lock_lost=self._lock_lost,
            stopping=self._stopping_runs,
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
        started = events.RunStarted(
            job=job.name,
            key=job.key,
            scheduled_at=result.scheduled_at,
            run_id=result.run_id,
            instance=self.instance,
            lateness_s=((result.started_at or self.clock()) - result.scheduled_at).total_seconds(),
            manual=manual,
            crashed=result.crashed,
            skips_ended=result.consecutive_skips or 0,
            skips_recovered=result.recovered,
            ping_url=job.ping_url,
        )
        return Run(job=job, ctx=ctx, generation=generation, started=now), started

    def _execute(self, run: Run, started: events.RunStarted) -> None:
        self._emit(started)  # listeners are thread-safe
        status, error = execute(run.job.spec, run.ctx)
        self._finished_run(run, status, error)

    def _finished_run(self, run: Run, status: str, error: str | None) -> None:
        with self._mutex:
            if run.status is not None:
                return  # already recorded (abandoned at shutdown)
            run.status, run.error = status, error
            first = not self._finished
            self._finished.append(Finish(run, status, error, self.monotonic() - run.started))
        if first:
            self._wake()  # later ones join the batch the dispatcher is about to take

    # -- finishes --------------------------------------------------------------------

    def _record_finishes(self) -> None:
        with self._mutex:
            batch, self._finished = self._finished, []
        if not batch:
            return
        batch.sort(key=lambda f: f.run.job.key)  # one lock order everywhere
        requests = [
            FinishRequest(
                key=f.run.job.key,
                scheduled_at=f.run.ctx.scheduled_at,
                run_id=f.run.ctx.run_id,
                status=f.status,
                error=f.error,
                unlock=f.run.generation == self._generation,
                fail_threshold=f.run.job.fail_threshold,
            )
            for f in batch
        ]
        try:
            results = self._round_trip(lambda: self.backend.finish(requests))
        except SessionLost:
            with self._mutex:
                self._finished[:0] = batch
            raise
        except Exception:
            log.exception("recording %d finished runs failed; retrying", len(batch))
            with self._mutex:
                self._finished[:0] = batch
            self._paused_until = self.monotonic() + 1.0
            return
        assert isinstance(results, list)
        by_key: dict[tuple[int, datetime], FinishResult] = {
            (r.key, r.scheduled_at): r for r in results
        }
        for f in batch:
            outcome = by_key.get((f.run.job.key, f.run.ctx.scheduled_at))
            with self._mutex:
                if self._runs.get(f.run.job.key) is f.run:
                    del self._runs[f.run.job.key]
            self._report_finish(f, outcome)

    def _report_finish(self, f: Finish, outcome: FinishResult | None) -> None:
        run = f.run
        self._emit(
            events.RunFinished(
                job=run.job.name,
                key=run.job.key,
                scheduled_at=run.ctx.scheduled_at,
                run_id=run.ctx.run_id,
                instance=self.instance,
                status=f.status,
                error=f.error,
                duration_s=f.duration_s,
                recorded=bool(outcome and outcome.recorded),
                lock_lost=run.ctx.lock_lost.is_set(),
                consecutive_failures=outcome.consecutive_failures if outcome else None,
                failures_threshold=run.job.fail_threshold,
                failures_alert=bool(outcome and outcome.alert),
                failures_recovered=bool(outcome and outcome.recovered),
                ping_url=run.job.ping_url,
            )
        )
        manual = self._manual_runs.pop(run.job.key, None)
        if manual is not None:
            done, out = manual
            out.append(ManualResult(Outcome.RUN, f.status, f.error, run.ctx.run_id))
            done.set()

    # -- the session -----------------------------------------------------------------

    def _heartbeat(self) -> None:
        self._round_trip(self.backend.heartbeat)

    def _reconnect(self) -> bool:
        if self.monotonic() < self._retry_at:
            return False
        try:
            self.backend.connect()
        except Unavailable as exc:
            self._retry_at = self.monotonic() + self._backoff.next_delay() + 0.1
            log.warning("database unreachable (%s); retrying", exc)
            return False
        self._connected = True
        self._sessions += 1
        self._last_proof = self.monotonic()
        self._backoff.reset()
        self._emit(events.SessionUp(self.instance, self.backend.name))
        return True

    def _lose_session(self, reason: str) -> None:
        """Every lock of this replica is gone: tell every run, then start over."""
        with self._mutex:
            lost = [run for run in self._runs.values() if run.generation == self._generation]
            self._generation += 1
            self._connected = False
            told, self._lock_lost = self._lock_lost, threading.Event()
        told.set()  # every run of the lost session shares this event
        self.backend.close()
        self._retry_at = self.monotonic() + self._backoff.next_delay()
        self._emit(events.SessionLost(self.instance, reason, tuple(r.job.name for r in lost)))

    def _watch(self) -> None:
        """Set lock_lost even while the dispatcher is stuck in a call to a dead server."""
        period = min(1.0, self.holder_timeout / 10)
        while not self._stopped.wait(period):
            if not self._connected or self.monotonic() - self._last_proof <= self.holder_timeout:
                continue
            with self._mutex:
                doubtful = [r for r in self._runs.values() if r.generation == self._generation]
                told = self._lock_lost
            if doubtful and not told.is_set():
                log.error(
                    "locks of %s can no longer be proven (no round trip for %.1f s)",
                    ", ".join(run.job.name for run in doubtful),
                    self.monotonic() - self._last_proof,
                )
            # The session is replaced as soon as the dispatcher regains control
            # (abort below makes sure it does): no new run ever gets this event.
            told.set()
            # If the dispatcher is stuck in a call to a server that no longer
            # answers (a black-holed network), cut the call short.
            self.backend.abort()
            self._wake()

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
