"""Finishes: runs that ended, recorded in the ledger in batches (step 4 of the protocol).

A worker thread that ends a run only queues it (`ended`); the dispatcher
records every queued finish in one round trip (`record`), once the runs that
started with the first of them have had a moment to end too (`runs.GATHER`).
While runs are going here, finishes are held back for the next batch, briefly
(`HOLD`), never close to their job's next tick, and no more than `full` of
them: each claim wins at most as many runs as there are workers, and a finish
for every claim's worth would double the transactions of a busy replica.
A batch that fails for another reason than a lost session is recorded again
row by row, so one row's trouble (its error text, say) never keeps the others
unrecorded; a row that still fails alone is stored with a placeholder error.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime

from scheduler.backends.base import FinishRequest, FinishResult, LockStore, Outcome, SessionLost
from scheduler.config.schedules import tick_after
from scheduler.errors import one_line
from scheduler.gate.runs import Ending, ManualResult, Run
from scheduler.gate.session import LockSession
from scheduler.observers import events
from scheduler.statuses import Status
from scheduler.text import storable

log = logging.getLogger("scheduler.gate")

PLACEHOLDER_ERROR = "(the job's error text could not be stored: {reason})"
HOLD = 0.1  # seconds a finish may be held back for the next batch
# A finish is never held back closer than this to its job's next tick (which another
# replica, whose clock may be ahead, would record skipped behind its unreleased lock).
HOLD_MARGIN = 0.5
SAY_EVERY = 30.0  # seconds: a failure that repeats (a full disk) is logged once per this


class _Quiet:
    """One line per failure, no traceback, at most one per `every` seconds; the next line
    says how many were left unsaid (a full disk fails every attempt, every second)."""

    def __init__(self, monotonic: Callable[[], float], every: float = SAY_EVERY) -> None:
        self.monotonic, self.every = monotonic, every
        self._next_at = -1e18
        self._unsaid = 0

    def warn(self, message: str, *args: object) -> None:
        now = self.monotonic()
        if now < self._next_at:
            self._unsaid += 1
            return
        if self._unsaid:
            message, args = message + " (and %d more like it unsaid)", (*args, self._unsaid)
        log.warning(message, *args)
        self._unsaid, self._next_at = 0, now + self.every


class Finishes:
    def __init__(
        self,
        backend: LockStore,
        session: LockSession,
        *,
        instance: str,
        monotonic: Callable[[], float],
        clock: Callable[[], datetime],
        emit: Callable[[events.Event], None],
        wake: Callable[[], None],
        retry_scheduled: Callable[[float], None] = lambda _: None,
        full: int = 1,
    ) -> None:
        self.backend = backend
        self.session = session
        self.instance = instance
        self.monotonic = monotonic
        self.clock = clock
        self.full = full  # finishes recorded at once, however many runs still go here
        self.emit = emit
        self.wake = wake
        self.retry_scheduled = retry_scheduled  # a failed attempt's next is due in n seconds
        self.paused_until = 0.0  # after a batch some of whose rows could not be recorded
        self._mutex = threading.Lock()
        self._waiting: list[Run] = []
        self._first: Run | None = None  # the first of the waiting runs to end
        self._hold_until = 0.0  # the latest a waiting finish may be held back to
        # The next tick after a tick, per schedule key: a burst's runs share both.
        self._next_due: dict[tuple[object, datetime], datetime | None] = {}
        self._batch_failed, self._row_failed = _Quiet(monotonic), _Quiet(monotonic)

    def ended(self, run: Run, status: Status, error: str | None) -> None:
        """A run returned (any thread): its finish waits for the dispatcher."""
        now = self.monotonic()
        ending = Ending.of(run, status, error, now)
        hold = now + HOLD
        if (next_due := self._due_after(run)) is not None:
            hold = min(hold, now + (next_due - self.clock()).total_seconds() - HOLD_MARGIN)
        with self._mutex:
            if run.ended is not None:
                return  # already recorded (given up at shutdown)
            run.ended = ending
            first = not self._waiting
            if first:
                self._first, self._hold_until = run, hold
            self._hold_until = min(self._hold_until, hold)
            self._waiting.append(run)
        if first:
            self.wake()  # later ones join the batch the dispatcher is about to take

    def pending(self) -> bool:
        with self._mutex:
            return bool(self._waiting)

    def waiting_for(self, *queued: Callable[[int], bool]) -> bool:
        """Whether a run whose finish waits is of a job with a tick `queued` to claim."""
        with self._mutex:
            keys = [run.job.key for run in self._waiting]
        return any(has(key) for key in keys for has in queued)

    def due_at(self, gathered_at: Callable[[Run], float], hold: bool) -> float | None:
        """When the waiting finishes are to be recorded (None: none waits): once the first
        of them is done waiting for the runs of its batch (`RunTable.gathered_at`), and,
        if they may be held back for the next batch (`hold`: runs go on here), then."""
        with self._mutex:
            first, count, until = self._first, len(self._waiting), self._hold_until
        if first is None:
            return None
        at = max(gathered_at(first), self.paused_until)
        return max(at, until) if hold and count < self.full else at

    def record(self) -> list[Run]:
        """Record every waiting finish; returns the runs recorded (done with, here)."""
        if self.monotonic() < self.paused_until:
            return []
        with self._mutex:
            batch, self._waiting, self._first = self._waiting, [], None
        if not batch:
            return []
        batch.sort(key=lambda run: (run.ctx.scheduled_at, run.job.key))  # the common order
        try:
            results = self._send(batch)
        except SessionLost:
            self._put_back(batch)
            raise
        except Exception as exc:
            self._batch_failed.warn(
                "recording %d finished run(s) failed (%s); one by one", len(batch), one_line(exc)
            )
            results, left = self._one_by_one(batch)
            if left:
                self._put_back(left)
                self.paused_until = self.monotonic() + 1.0
        by_tick = {(r.key, r.scheduled_at): r for r in results}
        done = []
        for run in batch:
            outcome = by_tick.get((run.job.key, run.ctx.scheduled_at))
            if outcome is not None:
                self._report(run, outcome)
                done.append(run)
        return done

    def _put_back(self, runs: list[Run]) -> None:
        with self._mutex:
            self._waiting[:0] = runs
            self._first = self._waiting[0] if self._waiting else None
            self._hold_until = 0.0  # tried again as soon as may be

    def _send(self, runs: list[Run], placeholder: str | None = None) -> list[FinishResult]:
        requests = [self._request(run, placeholder) for run in runs]
        results = self.session.round_trip(lambda: self.backend.finish(requests))
        assert isinstance(results, list)
        return results

    def _one_by_one(self, batch: list[Run]) -> tuple[list[FinishResult], list[Run]]:
        results: list[FinishResult] = []
        left: list[Run] = []
        for run in batch:
            try:
                results += self._send([run])
            except SessionLost:
                raise
            except Exception as exc:
                try:
                    results += self._send([run], PLACEHOLDER_ERROR.format(reason=exc))
                except SessionLost:
                    raise
                except Exception as again:
                    self._row_failed.warn(
                        "cannot record the finish of %s (%s); trying again",
                        run.job.name,
                        one_line(again),
                    )
                    left.append(run)
        return results, left

    def _request(self, run: Run, placeholder: str | None) -> FinishRequest:
        ending = run.ended
        assert ending is not None
        job = run.job
        error = placeholder if placeholder is not None else ending.error and storable(ending.error)
        return FinishRequest(
            key=job.key,
            scheduled_at=run.ctx.scheduled_at,
            run_id=run.ctx.run_id,
            status=ending.status,
            error=None if ending.error is None else error,
            unlock=self.session.holds_lock_of(run),
            fail_threshold=job.fail_threshold,
            told=ending.told,
            duration_s=round(ending.duration_s, 6),
            next_due=self._due_after(run),
            retry_in_s=ending.retry_in_s,
        )

    def _due_after(self, run: Run) -> datetime | None:
        job, tick = run.job, run.ctx.scheduled_at
        if not job.scheduled:
            return None
        # Jobs with equal schedule keys fire at exactly the same ticks (CatalogJob), so a
        # burst of a thousand jobs on one grid computes its next tick once, not per job.
        cached = (job.schedule_key, tick)
        found = self._next_due.get(cached, tick)  # (any thread: one get, one set)
        if found is tick:
            if len(self._next_due) > 1024:
                self._next_due.clear()
            found = self._next_due[cached] = tick_after(job.trigger, tick)
        return found

    def _report(self, run: Run, outcome: FinishResult) -> None:
        ending = run.ended
        assert ending is not None
        self.emit(
            events.RunFinished(
                job=run.job.name,
                key=run.job.key,
                scheduled_at=run.ctx.scheduled_at,
                run_id=run.ctx.run_id,
                instance=self.instance,
                status=ending.status,
                error=ending.error,
                duration_s=ending.duration_s,
                recorded=outcome.recorded,
                lock_lost=run.ctx.lock_lost.is_set(),
                told=ending.told,
                consecutive_failures=outcome.consecutive_failures,
                failures_threshold=run.job.fail_threshold,
                failures_alert=outcome.alert,
                failures_recovered=outcome.recovered,
                skips_recovered=outcome.skips_recovered,
                notices=outcome.notices,
                ping_url=run.job.ping_url,
                attempt=run.ctx.attempt,
                retry_in_s=ending.retry_in_s,
            )
        )
        if ending.retry_in_s is not None and outcome.recorded:
            self.retry_scheduled(ending.retry_in_s)
        if run.manual is not None:
            run.manual.set_result(
                ManualResult(Outcome.RUN, ending.status, ending.error, run.ctx.run_id)
            )
