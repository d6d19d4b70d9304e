"""Claims: the queued ticks offered to the backend, one round trip per batch (step 2).

What comes back is returned to the dispatcher at once, the ticks won first
(it starts their runs before any bookkeeping: their lateness is what counts);
then ticks deferred for lack of workers or left to another replica's share go
back to the queue, and skipped, missed and paused ticks are reported. A claim
that fails for another reason than a lost session is logged and its ticks go
back to the queue; it may have left locks it took (advisory locks outlive a
rollback), so each answer says whether a claim failed, and the gate gives back
what no run of it holds (`StrayLocks`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from datetime import datetime
from typing import NamedTuple

from scheduler.backends.base import (
    ClaimAnswer,
    ClaimRequest,
    ClaimResult,
    Intent,
    LockStore,
    Outcome,
    SessionLost,
)
from scheduler.errors import one_line
from scheduler.gate.others import help_part
from scheduler.gate.runs import ManualResult, Running, Won
from scheduler.gate.session import LockSession
from scheduler.gate.ticks import Batch, TickQueue
from scheduler.observers import events
from scheduler.registry.catalog import CatalogJob

log = logging.getLogger("scheduler.gate")

YIELDED_RETRY = 0.1  # seconds before trying a tick left to another replica's share


class Claimed(NamedTuple):
    """A claim's answer to the dispatcher: the runs to start, whether a claim failed (it
    may have left locks behind), and when it was sent (monotonic: a lease counts from it)."""

    won: Won
    failed: bool
    sent: float = 0.0


def claim_request(job: CatalogJob, tick: datetime, intent: Intent) -> ClaimRequest:
    """A caught-up tick's grace is the job's catch_up_window: it is late by design."""
    grace = job.catch_up_window if intent is Intent.CATCH_UP else job.misfire_grace
    return ClaimRequest(
        key=job.key,
        name=job.name,
        scheduled_at=tick,
        intent=intent,
        grace_s=grace.total_seconds(),
        skip_threshold=job.skip_threshold,
        fail_threshold=job.fail_threshold,
    )


class Claims:
    def __init__(
        self,
        backend: LockStore,
        session: LockSession,
        queue: TickQueue,
        *,
        instance: str,
        emit: Callable[[events.Event], None],
    ) -> None:
        self.backend = backend
        self.session = session
        self.queue = queue
        self.instance = instance
        self.emit = emit

    def queued(self, free: int, running: Callable[[int], Running]) -> Iterator[Claimed]:
        """Claim the queued ticks: the healthy ones in one round trip, failed ones apart.

        Yields each batch's answer as soon as it comes, before its bookkeeping. The
        free workers are one budget for all the batches: each wins at most what the
        ones before it left.
        """
        self._look_at_others()
        for batch in self.queue.take(free, running):  # `free`: workers, and runs ahead
            for claimed in self._batch(batch, free):
                free -= len(claimed.won)
                yield claimed

    def _look_at_others(self) -> None:
        """Other replicas' ticks held here (gate/others.py): one probe for every record
        due, and the ticks no replica has recorded are queued to help with. If the probe
        fails, every one of them is: the claims then find out, as they did before."""
        records = self.queue.unowned()
        if not records:
            return
        ticks = [(job, record.tick, record.since) for record in records for job in record.jobs]
        try:
            found = self.session.round_trip(
                lambda: self.backend.untaken([(job.key, tick) for job, tick, _ in ticks])
            )
        except SessionLost:
            self.queue.help(ticks)
            raise
        except Exception as exc:
            log.warning("looking at other replicas' ticks failed (%s)", one_line(exc))
            self.queue.help(ticks)
            return
        assert isinstance(found, list)
        untaken = sorted((ticks[place] for place in found), key=self._helper_key)
        part = help_part(len(untaken), self.backend.shape())
        self.queue.help(untaken[:part])
        if part < len(untaken):
            self.queue.hold_again(untaken[part:])

    def _helper_key(self, found: tuple[CatalogJob, datetime, float]) -> tuple[int, datetime]:
        return self.queue.helper_order(found[0].key), found[1]

    def manual(
        self,
        job: CatalogJob,
        tick: datetime,
        result: Future[ManualResult],
        intent: Intent = Intent.MANUAL,
    ) -> Claimed:
        """`scheduler trigger` (its own tick, "now"), or a caught-up tick: lock first.

        A won tick's outcome is settled when its run ends (`result` goes with it); a
        failed claim's outcome is `error`: nothing was decided, the caller may ask again.
        """
        try:
            (claimed,) = self._claim([claim_request(job, tick, intent)], capacity=1).every()
        except SessionLost:
            raise
        except Exception as exc:
            log.warning(
                "claiming %s tick %s (%s) failed (%s)",
                job.name,
                tick.isoformat(),
                intent,
                one_line(exc),
            )
            result.set_result(ManualResult(Outcome.ERROR, error=one_line(exc)))
            return Claimed([], failed=True)
        if claimed.outcome is Outcome.RUN:
            return Claimed([(job, claimed)], failed=False)
        result.set_result(ManualResult(claimed.outcome, holder=claimed.holder))
        self._report(job, claimed)
        return Claimed([], failed=False)

    def _batch(self, batch: Batch, capacity: int) -> Iterator[Claimed]:
        requests = [claim_request(r.job, r.tick, r.intent) for r in batch.requests]
        sent = self.session.monotonic()
        try:
            answer = self._claim(requests, capacity)
        except SessionLost:
            self.queue.put_back(batch.entries)
            raise
        except Exception as exc:
            failure = one_line(exc)
            log.warning(
                "claiming %d tick(s) failed (%s); trying again shortly", len(requests), failure
            )
            self.queue.put_back(batch.entries, failed=True)
            yield Claimed([], failed=True, sent=sent)
            return
        jobs = {r.job.key: r.job for r in batch.requests}
        yield Claimed(
            [(jobs[r.key], r) for r in answer.answered if r.outcome is Outcome.RUN], False, sent
        )
        for result in answer.answered:
            if result.outcome is not Outcome.RUN:
                self._report(jobs[result.key], result)
        # Tried again when a worker frees, and once anyone may take another's share.
        entries = {entry.job.key: entry for entry in batch.entries}
        self.queue.leave([(entries[t.key], t.scheduled_at) for t in answer.deferred])
        self.queue.leave(
            [(entries[t.key], t.scheduled_at) for t in answer.yielded],
            others=True,
            delay=YIELDED_RETRY,
        )

    def _claim(self, requests: list[ClaimRequest], capacity: int) -> ClaimAnswer:
        """Every claim goes here: no backend is asked to start more runs than workers are
        free, nor fewer than none (PostgreSQL refuses a negative LIMIT)."""
        capacity = max(0, capacity)
        answer = self.session.round_trip(
            lambda: self.backend.claim(requests, self.instance, capacity)
        )
        assert isinstance(answer, ClaimAnswer)
        return answer

    def _report(self, job: CatalogJob, result: ClaimResult) -> None:
        if result.outcome is Outcome.SKIPPED:
            self.emit(
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
                    notices=result.notices,
                )
            )
        elif result.outcome is Outcome.MISSED:
            self.emit(events.TickMissed(job.name, job.key, result.scheduled_at, self.instance))
        elif result.outcome is Outcome.PAUSED:
            self.emit(events.TickPaused(job.name, job.key, result.scheduled_at, self.instance))
