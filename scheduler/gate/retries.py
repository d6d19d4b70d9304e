"""Retries: when to look for due ones, and the look itself (`scheduler_claim_retries`).

A failed attempt's finish says when its next is due; the replica that
recorded it looks then, the others when their heartbeat reports it, so a
retry outlives the replica that scheduled it. A look whose due retries found
their locks held looks again shortly; a job's lock is taken before its row,
as for a manual run (see `scheduler.gate`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Protocol

from scheduler.backends.base import ClaimResult, LockStore, Retries, SessionLost
from scheduler.config.schedules import tick_after
from scheduler.errors import one_line
from scheduler.gate.session import LockSession
from scheduler.registry.catalog import CatalogJob
from scheduler.statuses import CRASHED_LOST_LOCK

log = logging.getLogger("scheduler.gate")

HELD_AGAIN = 2.0  # seconds before a due retry whose lock was held elsewhere is tried again
LOOK_AGAIN = 1.0  # seconds before a look for due retries that failed is made again

Won = list[tuple[CatalogJob, ClaimResult]]


class Jobs(Protocol):
    def job(self, key: int) -> CatalogJob | None: ...

    def enabled_keys(self) -> list[int]: ...


class RetryLook:
    def __init__(
        self,
        backend: LockStore,
        session: LockSession,
        *,
        instance: str,
        monotonic: Callable[[], float],
        clock: Callable[[], datetime],
    ) -> None:
        self.backend = backend
        self.session = session
        self.instance = instance
        self.monotonic = monotonic
        self.clock = clock
        self._mutex = threading.Lock()
        self._at: float | None = None  # monotonic: when to look (None: no retry known)

    def due_in(self, seconds: float | None) -> None:
        """A retry is due in `seconds` (None: none known): look then (any thread)."""
        if seconds is None:
            return
        at = self.monotonic() + max(0.0, seconds)
        with self._mutex:
            if self._at is None or at < self._at:
                self._at = at

    def due(self, free: int) -> bool:
        """Whether to look now (a look asks for every job's key: not at every step)."""
        with self._mutex:
            return self._at is not None and self._at <= self.monotonic() and free > 0

    def wait(self) -> float | None:
        """Seconds until the next look (None: nothing known to look for)."""
        with self._mutex:
            return None if self._at is None else max(0.0, self._at - self.monotonic())

    def look(self, jobs: Jobs, running: Callable[[], set[int]], free: int) -> tuple[Won, bool]:
        """If a look is due: start the due retries of the enabled jobs not running here.

        Returns the runs to start, and whether the look failed or took a lock no run
        here holds (the gate gives back what it left). Raises SessionLost.
        """
        if not self.due(free):
            return [], False
        not_here = running()
        keys = [key for key in jobs.enabled_keys() if key not in not_here]
        try:
            won, gone = self.take(jobs, keys, free)
        except SessionLost:
            raise
        except Exception as exc:
            log.warning("looking for due retries failed (%s); looking again shortly", one_line(exc))
            self.due_in(LOOK_AGAIN)
            return [], True
        return won, bool(gone)

    def take(self, jobs: Jobs, keys: Sequence[int], free: int) -> tuple[Won, list[int]]:
        """Start the due retries of `keys` (jobs here, not running here), at most `free`.

        Returns the runs to start, and the keys of retries started for jobs
        reloaded away meanwhile (their locks are held by no run: the gate gives
        them back; their rows are left to the sweep). Raises SessionLost, and any
        other error of the look (which may have left locks behind, given back the
        same way).
        """
        with self._mutex:
            if self._at is None or self._at > self.monotonic() or free <= 0:
                return [], []
            if not keys:  # every job with a retry runs here: look again once one may end
                self._at = self.monotonic() + HELD_AGAIN
                return [], []
            self._at = None
        thresholds = [job.fail_threshold if (job := jobs.job(key)) else 3 for key in keys]
        found = self.session.round_trip(
            lambda: self.backend.claim_retries(
                self.instance, keys, free, CRASHED_LOST_LOCK, thresholds
            )
        )
        assert isinstance(found, Retries)
        if found.next_in is not None:
            self.due_in(found.next_in if found.next_in > 0 else HELD_AGAIN)
        won: Won = []
        gone: list[int] = []
        for result in found.started:
            job = jobs.job(result.key)
            if job is None:
                gone.append(result.key)
                continue
            self._say(job, result)
            won.append((job, result))
        return won, gone

    def _say(self, job: CatalogJob, result: ClaimResult) -> None:
        late = ""
        if job.trigger is not None:
            after = tick_after(job.trigger, result.scheduled_at)
            if after is not None and after <= self.clock():
                late = " (after the job's next tick, which it does not hold up)"
        log.info(
            "retrying %s tick %s: attempt %d of %d%s",
            job.name,
            result.scheduled_at.isoformat(),
            result.attempt,
            job.retries + 1,
            late,
        )
