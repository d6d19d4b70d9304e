"""Finishes: runs that ended, recorded in the ledger in batches (step 4 of the protocol).

A worker thread that ends a run only queues it (`ended`); the dispatcher
records every queued finish in one round trip (`record`). A batch that fails
for another reason than a lost session is recorded again row by row, so one
row's trouble (its error text, say) never keeps the others unrecorded; a row
that still fails alone is stored with a placeholder error.
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
        emit: Callable[[events.Event], None],
        wake: Callable[[], None],
        retry_scheduled: Callable[[float], None] = lambda _: None,
    ) -> None:
        self.backend = backend
        self.session = session
        self.instance = instance
        self.monotonic = monotonic
        self.emit = emit
        self.wake = wake
        self.retry_scheduled = retry_scheduled  # a failed attempt's next is due in n seconds
        self.paused_until = 0.0  # after a batch some of whose rows could not be recorded
        self._mutex = threading.Lock()
        self._waiting: list[Run] = []
        # The next tick after a tick, per schedule: a burst's runs share both.
        self._next_due: dict[tuple[object, datetime], datetime | None] = {}
        self._batch_failed, self._row_failed = _Quiet(monotonic), _Quiet(monotonic)

    def ended(self, run: Run, status: Status, error: str | None) -> None:
        """A run returned (any thread): its finish waits for the dispatcher."""
        ending = Ending.of(run, status, error, self.monotonic())
        with self._mutex:
            if run.ended is not None:
                return  # already recorded (given up at shutdown)
            run.ended = ending
            first = not self._waiting
            self._waiting.append(run)
        if first:
            self.wake()  # later ones join the batch the dispatcher is about to take

    def pending(self) -> bool:
        with self._mutex:
            return bool(self._waiting)

    def record(self) -> list[Run]:
        """Record every waiting finish; returns the runs recorded (done with, here)."""
        if self.monotonic() < self.paused_until:
            return []
        with self._mutex:
            batch, self._waiting = self._waiting, []
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
        cached = (job.trigger, tick)  # the trigger itself: an id could be reused
        if cached not in self._next_due:
            if len(self._next_due) > 1024:
                self._next_due.clear()
            self._next_due[cached] = tick_after(job.trigger, tick)
        return self._next_due[cached]

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
