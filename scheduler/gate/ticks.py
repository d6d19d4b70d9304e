"""The tick queue: ticks APScheduler fired, waiting for the dispatcher to claim them.

APScheduler hands over a burst of due ticks whole (every job on one grid falls
due at once); the queue holds them until the burst is complete, so one claim
covers it. Per job it keeps every tick fired and not yet claimed, and offers
the oldest: a tick that waited (for a worker, or behind another replica's share)
still runs in its grace when the job's next tick comes, and the next one after it
(`Pending.behind`). A tick fired while the job runs here is claimed `skip`. None
is dropped while it may still run (up to `MAX_BACKLOG` of a job): a tick past its
grace is answered `missed`. A batch whose claim failed for a reason other than a
lost session is tried again after a growing delay, apart from the healthy ones, so
one tick the database cannot take now never holds up the rest.

Beside them wait the ticks claimed lock first, one at a time (`ManualTicks`): run-now
requests and caught-up ticks, queued from any thread (`scheduler trigger --here`, a
run-now request the dispatcher took from the ledger, a catch-up pass); whoever queued
one waits on its `Future` for the outcome.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import datetime
from typing import NamedTuple, Protocol

from scheduler.backends.base import Intent, LockStore, Outcome
from scheduler.backends.shares import Shape
from scheduler.gate.backlog import Backlog
from scheduler.gate.others import Others, Unowned
from scheduler.gate.runs import ManualResult, Running
from scheduler.gate.session import LockSession
from scheduler.ledger.run_now import RunRequest
from scheduler.registry.catalog import CatalogJob

# Ticks of one job kept waiting here; older ones are left to the other replicas, or to
# the sweep, which records them missed once past their grace.
MAX_BACKLOG = 100
# Seconds between looks at ticks waiting behind their job's run here: they go as soon as
# the run's finish is recorded, and this bounds the wait should no wake come then.
BEHIND_POLL = 0.05
RETRY_FIRST, RETRY_CAP = 1.0, 30.0  # seconds before a failed claim is tried again, doubling


@dataclass
class Pending:
    job: CatalogJob
    ticks: list[datetime]  # sorted, newest last
    since: float  # when the oldest of them arrived (monotonic)
    not_before: float = 0.0
    failures: int = 0  # claims of these ticks that failed in a row
    others: bool = False  # yielded by a claim: another live replica's share (backlog.py)
    # Ticks up to this one were due before the job's run here was claimed: they wait for
    # it to end and run after it, oldest first (a tick fired during the run is skipped).
    behind: datetime | None = None

    def add(self, tick: datetime) -> None:
        if tick not in self.ticks:
            self.ticks.append(tick)
            self.ticks.sort()
            del self.ticks[:-MAX_BACKLOG]

    def absorb(self, queued: Pending) -> None:
        """Take in the ticks of the job's entry that was queued meanwhile."""
        for tick in queued.ticks:
            self.add(tick)
        self.since = min(self.since, queued.since)
        if queued.behind is not None and (self.behind is None or queued.behind > self.behind):
            self.behind = queued.behind

    def split_behind(self) -> Pending | None:
        """Claiming the oldest tick to run: the newer ones, which wait behind its run."""
        if len(self.ticks) == 1:
            return None
        rest = Pending(self.job, self.ticks[1:], self.since, behind=self.ticks[-1])
        del self.ticks[1:]
        self.behind = None
        return rest

    def split_skipped(self) -> Pending | None:
        """The job runs here: the ticks fired since its run was claimed (to claim `skip`);
        those due before it stay, to run after it."""
        behind = self.behind
        if behind is None:
            return None
        waiting = [tick for tick in self.ticks if tick <= behind]
        if not waiting:  # none left behind the run: every one is claimed `skip`
            self.behind = None
            return None
        fired = [tick for tick in self.ticks if tick > behind]
        self.ticks = waiting
        return Pending(self.job, fired, self.since) if fired else None


class ToClaim(NamedTuple):
    """One queued tick offered to a claim, and for what: `run` (the job is free here) or
    `skip` (this replica still runs it)."""

    job: CatalogJob
    tick: datetime
    intent: Intent


@dataclass
class Batch:
    """Ticks to claim together; `entries` go back to the queue if the claim fails."""

    requests: list[ToClaim] = field(default_factory=list)
    entries: list[Pending] = field(default_factory=list)


class TickQueue:
    def __init__(
        self,
        monotonic: Callable[[], float],
        left_to_others: float = 1.0,
        order: Callable[[int], int] = lambda key: key,
    ) -> None:
        self.monotonic = monotonic
        # A tick of a job whose run here lost its lock goes to the other replicas first;
        # if none has claimed it by then, this replica records it skipped.
        self.left_to_others = left_to_others
        self._mutex = threading.Lock()
        self._pending: dict[int, Pending] = {}
        self._backlog = Backlog(order)  # left by a claim: offered a window at a time
        self._others = Others()  # other replicas' shares, held whole until probed (others.py)
        self._bursts = 0
        self._accepting = True
        # How late this replica's last fresh ticks of its own were offered (seconds after
        # they fired here), and when: how far behind it runs (others.patience). `_fired`:
        # when the first own ticks not offered since fired.
        self._lag, self._lag_at = 0.0, 0.0
        self._fired: float | None = None

    def add(self, jobs: Sequence[CatalogJob], tick: datetime, shape: Shape | None = None) -> bool:
        """Queue the same tick of several jobs; True if the dispatcher should wake now.

        With the fleet's `shape` known, only this replica's own share is queued; the
        rest is held as one record, to be probed once anyone may take it (others.py).
        """
        now = self.monotonic()
        with self._mutex:
            if not self._accepting:
                return False
            jobs, theirs = self._others.split(jobs, shape)
            if theirs:
                self._others.hold(theirs, tick, now)
            if jobs and self._fired is None:
                self._fired = now
            for job in jobs:
                entry = self._pending.get(job.key)
                if entry is None and (left := self._backlog.remove(job.key)) is not None:
                    # A newer tick: claimed afresh, with the next burst (the older one was
                    # not claimed in time here, as below).
                    assert isinstance(left, Pending)
                    entry = self._pending[job.key] = left
                    entry.not_before, entry.others = 0.0, False
                if entry is None:
                    self._pending[job.key] = Pending(job, [tick], now)
                else:
                    entry.add(tick)
            return not self._bursts

    @contextlib.contextmanager
    def burst(self) -> Iterator[None]:
        """Ticks added inside are claimed together, once the burst is complete."""
        with self._mutex:
            self._bursts += 1
        try:
            yield
        finally:
            with self._mutex:
                self._bursts -= 1

    def close(self) -> None:
        """Stopping: accept nothing more, forget what waits (the other replicas take it)."""
        with self._mutex:
            self._accepting = False
            self._pending.clear()
            self._backlog.clear()
            self._others.clear()

    def refresh(self, current: Callable[[int], CatalogJob | None]) -> None:
        """After a reload: drop the ticks of jobs no longer scheduled, update the rest."""
        with self._mutex:
            self._others.refresh(current)
            for key, entry in list(self._pending.items()):
                job = current(key)
                if job is None or not job.scheduled:
                    del self._pending[key]
                else:
                    entry.job = job
            for left in list(self._backlog):
                job = current(left.job.key)
                if job is None or not job.scheduled:
                    self._backlog.remove(left.job.key)
                else:
                    left.job = job

    def next_due(self, capacity: int, running: Callable[[int], Running]) -> float | None:
        """When the earliest entry may be claimed: what `take` would claim, and when (None:
        nothing until a tick comes or a worker frees, whose run's end wakes the dispatcher).

        A job free to run needs a free worker; one running here has its ticks claimed
        `skip`, or waiting behind its run, with no worker free or not. Counting an entry
        `take` passes by would wake the dispatcher at once, again and again.
        """
        now = self.monotonic()
        with self._mutex:
            if self._bursts:
                return None
            due = [
                entry.not_before
                for key, entry in self._pending.items()
                if capacity > 0 or running(key) is not Running.NOT
            ]
            left = self._backlog.next_due() if capacity > 0 else None
            held = self._others.next_due(self._behind(now))
            return min([d for d in (*due, left, held) if d is not None], default=None)

    def take(self, capacity: int, running: Callable[[int], Running]) -> list[Batch]:
        """The batches to claim now: the healthy entries together, each failed one alone.

        A job free to run gets its oldest tick as `run` if any worker is free; its
        newer ones wait behind that run, each claimed after it (the server answers
        one past its grace `missed`). A job running here gets the ticks fired since
        its run was claimed as `skip`; one whose run here lost its lock leaves its
        ticks to the other replicas for a while, then claims them all as `skip`.
        Of the ticks a claim left to later (the backlog), only a window goes.
        """
        now = self.monotonic()
        healthy, failed = Batch(), []
        own = False
        with self._mutex:
            if self._bursts or not self._accepting:
                return []
            for left in self._backlog.take(capacity, now):
                assert isinstance(left, Pending)
                self._pending[left.job.key] = left
            for key, entry in list(self._pending.items()):
                if entry.not_before > now and (entry.behind is None or entry.failures):
                    continue
                state = running(key)
                if entry.not_before > now and state is not Running.NOT:
                    continue  # still behind its job's run here (once it ends: at once)
                if state is Running.LOST and now < entry.since + self.left_to_others:
                    entry.not_before = entry.since + self.left_to_others
                    continue
                if state is Running.NOT:
                    if capacity <= 0:
                        continue  # waits for a free worker; another replica may take it
                    own = own or not entry.others
                    # Every one goes, however few workers are free: most of a burst is
                    # other replicas' share, and the claim wins at most `capacity` runs.
                    rest = entry.split_behind()
                    requests = [ToClaim(entry.job, entry.ticks[0], Intent.RUN)]
                else:
                    rest = None
                    fired = entry.split_skipped() if state is Running.HERE else None
                    if fired is not None:  # the waiting ones stay; the fired ones go
                        entry.not_before = now + BEHIND_POLL
                        entry, rest = fired, entry
                    elif state is Running.HERE and entry.behind is not None:
                        entry.not_before = now + BEHIND_POLL  # all wait behind the run
                        continue
                    requests = [ToClaim(entry.job, tick, Intent.SKIP) for tick in entry.ticks]
                if rest is None:
                    del self._pending[key]
                else:
                    self._pending[key] = rest
                batch = healthy if not entry.failures else Batch()
                batch.requests += requests
                batch.entries.append(entry)
                if entry.failures:
                    failed.append(batch)
            if own and self._fired is not None:  # the newest own ticks' delay, not a
                # deferred tick's wait (which a busy replica's backlog always has)
                self._lag, self._lag_at, self._fired = now - self._fired, now, None
        return ([healthy] if healthy.requests else []) + failed

    def _behind(self, now: float) -> float:
        """Seconds this replica runs behind on its own share: the lag of its last fresh
        tick, forgotten as time passes (a lag not measured again is a lag gone)."""
        return max(0.0, self._lag - (now - self._lag_at))

    def put_back(
        self, entries: Sequence[Pending], failed: bool = False, delay: float = 0.0
    ) -> None:
        """Requeue entries; a failure delays them more each time (merging newer ticks)."""
        now = self.monotonic()
        with self._mutex:
            if not self._accepting:
                return
            for entry in entries:
                if failed:
                    # A batch that failed is tried again at once, each entry alone, to find
                    # the one the database cannot take now; a lone failure waits longer.
                    entry.failures += 1
                    wait = min(RETRY_CAP, RETRY_FIRST * 2 ** (entry.failures - 1))
                    entry.not_before = now + (wait if len(entries) == 1 else 0.0)
                else:
                    entry.failures = 0
                    entry.not_before = now + delay
                queued = self._pending.get(entry.job.key)
                if queued is not None:
                    entry.absorb(queued)
                self._pending[entry.job.key] = entry

    def leave(
        self, left: Sequence[tuple[Pending, datetime]], others: bool = False, delay: float = 0.0
    ) -> None:
        """Ticks a claim left to later (deferred: no free worker here; yielded, `others`:
        another live replica's share), each with its entry, into the backlog; one that
        newer ticks of its job joined meanwhile (or waited behind it) is queued with them,
        first in line, when its own delay is over.

        One clock reading for all: ticks due a few microseconds apart would be
        claimed in as many round trips.
        """
        now = self.monotonic()
        with self._mutex:
            if not self._accepting:
                return
            for entry, tick in left:
                entry.ticks, entry.failures = [tick], 0
                entry.not_before = now + delay
                entry.others = entry.others or others
                queued = self._pending.get(entry.job.key)
                if queued is None:
                    self._backlog.put(entry)
                    continue
                entry.absorb(queued)
                entry.not_before = max(entry.not_before, queued.not_before)
                entry.others = False
                self._pending[entry.job.key] = entry

    def unowned(self) -> list[Unowned]:
        """Other replicas' ticks held long enough to be probed, taken out (others.py)."""
        now = self.monotonic()
        with self._mutex:
            return self._others.due(now, self._behind(now)) if self._accepting else []

    def hold_again(self, found: Sequence[tuple[CatalogJob, datetime, float]]) -> None:
        """Untaken ticks not helped with now: held, to be probed again (others.py)."""
        now = self.monotonic()
        with self._mutex:
            if self._accepting:
                self._others.hold_again(found, now)

    def helper_order(self, key: int) -> int:
        """This replica's order among other replicas' ticks (backlog.helper_order)."""
        return self._backlog.order(key)

    def help(self, found: Sequence[tuple[CatalogJob, datetime, float]]) -> None:
        """Other replicas' ticks that none has recorded (job, tick, fired at): queued as
        ticks yielded by a claim are, to help with now. A tick of the job that waits
        already stays: both are kept, oldest first."""
        now = self.monotonic()
        with self._mutex:
            if not self._accepting:
                return
            for job, tick, since in found:
                entry = Pending(job, [tick], since, others=True)
                queued = self._pending.get(job.key) or self._backlog.remove(job.key)
                if queued is not None:
                    assert isinstance(queued, Pending)
                    queued.absorb(entry)
                    self._pending[job.key] = queued
                    continue
                entry.not_before = now
                self._backlog.put(entry)

    def has(self, key: int) -> bool:
        """Whether a tick of job `key` waits to be claimed."""
        with self._mutex:
            return key in self._pending or self._backlog.has(key)

    def __len__(self) -> int:
        """Entries waiting: of jobs queued one by one, and records of other replicas' ticks."""
        with self._mutex:
            return len(self._pending) + len(self._backlog) + len(self._others)


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
