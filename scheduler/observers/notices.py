"""The outbox's deliverer: each notice logged, counted and POSTed once, by some live replica.

A notice is written by the claim or finish that raises it, in the same
transaction, leased to the replica that committed it (scheduler.ledger.outbox). That
replica learns the notice's id from the answer and delivers it at once. If it
never reads the answer (its session died after the commit) or dies while
delivering, the lease runs out and whichever replica's housekeeping comes by
next adopts it (scheduler.fleet.housekeeping). A failed POST is tried again with backoff (1 s
doubling to 60 s, for up to 15 minutes after the notice was raised), each
retry also recorded in the outbox, so retries survive the replica too.

A notice is logged and counted by this module's thread as soon as it is read
from the outbox, never after a delivery: the POSTs go out from a `Courier`'s
threads, several at once, each attempt within its deadline
(`scheduler.config.budgets`). A receiver that drips its answer costs one failed
attempt, which counts towards giving up, and holds up no other notice.

Delivery is at least once: a replica that dies between the POST and marking
it delivered leaves it to be sent again; the body's `notice_id` tells a
receiver it has seen it. An observer: nothing here steers the gate.
"""

from __future__ import annotations

import functools
import heapq
import json
import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from sqlalchemy import Engine

from scheduler.config.budgets import ATTEMPT_DEADLINE, NOTICE_ATTEMPTS_AT_ONCE, NOTICES_QUEUED
from scheduler.config.schedules import format_duration
from scheduler.errors import one_line
from scheduler.ledger.outbox import (
    add_notice,
    leased_notices,
    notice_done,
    notice_retry,
)
from scheduler.observers import alerts, events
from scheduler.observers.alerts import Notice
from scheduler.observers.posting import Courier, redact_url

log = logging.getLogger("scheduler.alerts")

FIRST_RETRY, MAX_RETRY = 1.0, 60.0  # seconds between attempts, doubling
GIVE_UP_AFTER = timedelta(minutes=15)  # after the notice was raised


class Notices(events.Observer):
    """Delivers this replica's notices from a thread of its own; never blocks the caller."""

    def __init__(
        self,
        engine: Engine,
        instance: str,
        webhook_url: str | None = None,
        *,
        on_alert: Callable[[str, str], None] | None = None,
        on_delivery: Callable[[str, bool], None] | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        monotonic: Callable[[], float] = time.monotonic,
        deadline_s: float = ATTEMPT_DEADLINE,
    ) -> None:
        self.engine = engine
        self.instance = instance
        self.webhook_url = webhook_url
        self.shown = redact_url(webhook_url) if webhook_url else None
        self.on_alert = on_alert
        self.on_delivery = on_delivery
        self.clock = clock
        self.monotonic = monotonic
        self._due: list[tuple[float, int]] = []  # (monotonic, notice id)
        self._sending: set[int] = set()  # notices with an attempt queued or in flight
        self.courier = Courier(
            "notices-post",
            workers=NOTICE_ATTEMPTS_AT_ONCE,
            per_receiver=NOTICE_ATTEMPTS_AT_ONCE,
            max_queued=NOTICES_QUEUED,
            deadline_s=deadline_s,
        )
        self._cv = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    # -- what arrives ------------------------------------------------------------------

    # As an observer of the gate: the notices its claims and finishes just raised.

    def tick_skipped(self, event: events.TickSkipped) -> None:
        if event.notices:
            self.schedule(event.notices)

    def run_finished(self, event: events.RunFinished) -> None:
        if event.notices:
            self.schedule(event.notices)

    def run_timed_out(self, event: events.RunTimedOut) -> None:
        """Raised here, when the timer fires: a run that never returns is still told of."""
        facts = {
            "instance": event.instance,
            "run_id": event.run_id,
            "timeout": format_duration(timedelta(seconds=event.timeout_s)),
            "timeout_s": event.timeout_s,
        }
        try:
            with self.engine.begin() as conn:
                notice = add_notice(
                    conn, alerts.TIMED_OUT, event.key, event.job, facts,
                    raised_by=self.instance, now=self.clock(),
                    scheduled_at=event.scheduled_at, deliverer=self.instance,
                )  # fmt: skip
        except Exception as exc:
            log.warning("cannot raise job.timed_out for %s: %s", event.job, one_line(exc))
            return
        self.schedule([notice])

    def schedule(self, ids: tuple[int, ...] | list[int], delay: float = 0.0) -> None:
        """Deliver these notices after `delay`. Only once the transaction that leased them to
        this replica has committed: the delivery reads them on a session of its own, and
        drops a notice whose lease it cannot see (another replica's, as far as it knows)."""
        due = self.monotonic() + delay
        with self._cv:
            if self._closed:
                return
            for notice in ids:
                heapq.heappush(self._due, (due, notice))
            self._cv.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="notices", daemon=True)
                self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        """Give notices due now a moment to go out; the rest stay in the outbox for others."""
        deadline = self.monotonic() + timeout
        with self._cv:
            while (
                (self._due and self._due[0][0] <= self.monotonic()) or self._sending
            ) and self.monotonic() < deadline:
                self._cv.wait(0.05)
            self._closed = True
            self._cv.notify()
        self.courier.close(0)

    # -- delivery ----------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (not self._due or self._due[0][0] > self.monotonic()):
                    self._cv.wait(self._due[0][0] - self.monotonic() if self._due else None)
                if self._closed:
                    return
                ids = []
                while self._due and self._due[0][0] <= self.monotonic():
                    notice = heapq.heappop(self._due)[1]
                    if notice not in self._sending:
                        ids.append(notice)
            try:
                self.deliver(ids)
            except Exception as exc:  # the ledger is away: the leases run out, others adopt
                log.warning("cannot deliver %d notice(s) now: %s", len(ids), one_line(exc))
            with self._cv:
                self._cv.notify_all()

    def deliver(self, ids: list[int]) -> None:
        """Log each notice at once, then hand its POST to the courier."""
        with self.engine.connect() as conn:
            rows = leased_notices(conn, ids, self.instance)
        for row in rows:
            notice = Notice.from_row(row)
            if notice.attempts == 0:
                self._announce(notice)
            if self.webhook_url is None:
                self._done(notice, "delivered")
            else:
                self._send(notice, self.webhook_url)

    def _announce(self, notice: Notice) -> None:
        log.log(
            notice.level,
            "%s",
            notice.log_line(),
            extra={"alert": notice.event, "notice_id": notice.id, **notice.body()},
        )
        if self.on_alert:
            self.on_alert(notice.event, notice.job)

    def _send(self, notice: Notice, url: str) -> None:
        with self._cv:
            self._sending.add(notice.id)
        body = json.dumps(notice.body()).encode()
        then = functools.partial(self._attempted, notice)
        if not self.courier.send(url, body, "application/json", then):
            log.warning("webhook %s: %s not sent now: too many queued", self.shown, notice.event)
            self._sent(notice)  # it stays in the outbox: its lease runs out, a replica adopts it

    def _attempted(self, notice: Notice, error: str | None) -> None:
        """On the courier's thread, once the attempt is over: record what came of it."""
        try:
            if self.on_delivery:
                self.on_delivery(notice.event, error is None)
            self._record(notice, error)
        except Exception as exc:  # the ledger is away: the lease runs out, others adopt
            log.warning("cannot record a delivery of %s now: %s", notice.event, one_line(exc))
        finally:
            self._sent(notice)

    def _sent(self, notice: Notice) -> None:
        with self._cv:
            self._sending.discard(notice.id)
            self._cv.notify_all()

    def _record(self, notice: Notice, error: str | None) -> None:
        if error is None:
            if notice.attempts:
                log.info(
                    "webhook %s: delivered %s after %d retries",
                    self.shown,
                    notice.event,
                    notice.attempts,
                )
            self._done(notice, "delivered")
            return
        now = self.clock()
        # The last retry falls at the deadline itself: a notice is retried for the whole
        # GIVE_UP_AFTER, and given up only once it has passed.
        deadline = notice.raised_at + GIVE_UP_AFTER
        delay = min(MAX_RETRY, FIRST_RETRY * 2**notice.attempts, (deadline - now).total_seconds())
        if delay <= 0:
            log.error(
                "webhook %s: giving up on %s after %d attempts: %s",
                self.shown,
                notice.event,
                notice.attempts + 1,
                error,
            )
            self._done(notice, "given_up")
            return
        log.warning(
            "webhook %s: %s not delivered (%s); retrying in %g s",
            self.shown,
            notice.event,
            error,
            delay,
        )
        with self.engine.begin() as conn:
            notice_retry(conn, notice.id, self.instance, now + timedelta(seconds=delay))
        self.schedule([notice.id], delay)

    def _done(self, notice: Notice, outcome: str) -> None:
        with self.engine.begin() as conn:
            notice_done(conn, notice.id, self.instance, self.clock(), outcome)
