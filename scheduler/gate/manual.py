"""Ticks claimed lock first, one at a time: run-now requests and caught-up ticks.

Queued from any thread (`scheduler trigger --here`, a run-now request the
dispatcher took from the ledger, a catch-up pass); the dispatcher claims them
(`Gate._claim_manual`). Whoever queued one waits on its `Future` for the outcome.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from scheduler.backends.base import Intent, LockStore, Outcome
from scheduler.gate.runs import ManualResult
from scheduler.gate.session import LockSession
from scheduler.ledger import RunRequest
from scheduler.registry.catalog import CatalogJob

log = logging.getLogger("scheduler.gate")


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


@dataclass(frozen=True)
class Manual:
    """One tick to claim lock first, and who waits for its outcome."""

    job: CatalogJob
    tick: datetime
    result: Future[ManualResult]
    intent: Intent


class ManualTicks:
    def __init__(self, clock: Callable[[], datetime]) -> None:
        self.clock = clock
        self._mutex = threading.Lock()
        self._queued: list[Manual] = []

    def add(
        self,
        job: CatalogJob,
        result: Future[ManualResult],
        tick: datetime | None = None,
        intent: Intent = Intent.MANUAL,
    ) -> None:
        """A manual tick has a tick of its own, "now", to the millisecond; a caught-up
        one, its missed tick."""
        if tick is None:
            now = self.clock()
            tick = now.replace(microsecond=now.microsecond // 1000 * 1000)
        with self._mutex:
            self._queued.append(Manual(job, tick, result, intent))

    def pending(self) -> bool:
        with self._mutex:
            return bool(self._queued)

    def has(self, key: int) -> bool:
        """Whether a tick of job `key` waits to be claimed."""
        with self._mutex:
            return any(m.job.key == key for m in self._queued)

    def take(self, intents: frozenset[Intent]) -> list[Manual]:
        with self._mutex:
            taken = [m for m in self._queued if m.intent in intents]
            self._queued = [m for m in self._queued if m.intent not in intents]
        return taken

    def put_back(self, entries: list[Manual]) -> None:
        """Not claimed in this step: first in line at the next."""
        with self._mutex:
            self._queued[:0] = entries

    def take_requests(
        self, backend: LockStore, session: LockSession, desk: RequestDesk, instance: str
    ) -> None:
        """Run-now requests for jobs of this replica: each becomes a manual tick here."""
        taken = session.round_trip(lambda: backend.take_requests(instance, desk.keys()))
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
            self.add(job, result)


def outcome(
    result: Future[ManualResult],
    monotonic: Callable[[], float],
    timeout: float | None = None,
    until: threading.Event | None = None,
) -> ManualResult:
    """Wait for a manual tick's outcome: `lost` once `timeout` has passed or `until` is
    set (the gate stops). Awake every second, for a signal's handler (Daemon.run)."""
    deadline = None if timeout is None else monotonic() + timeout
    while not result.done():
        if until is not None and until.is_set():
            return ManualResult(Outcome.LOST, error="stopping")
        left = 1.0 if deadline is None else min(1.0, deadline - monotonic())
        if left <= 0:
            return ManualResult(Outcome.LOST, error="timed out")
        with contextlib.suppress(TimeoutError):
            result.result(timeout=left)
    return result.result()


def _settle(desk: RequestDesk, request: RunRequest, done: Future[ManualResult]) -> None:
    result = done.result()
    held = f"held by {result.holder}" if result.holder else None
    status = None if result.status is None else str(result.status)
    desk.settle(request, str(result.outcome), status, result.run_id, result.error or held)
