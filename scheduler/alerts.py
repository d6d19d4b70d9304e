"""Alerts: fleet-wide notices raised from the gate's outcomes, never steering it.

Whether a notice is due is decided in the ledger, atomically, so exactly one
replica of the fleet raises each one (the one whose skip made the streak
reach its threshold, or whose run ended it). Here it becomes a log record at
ERROR (or WARNING for a recovery), a metric, and, when `alert_webhook_url` is
set, a JSON POST sent in the background with retries and backoff.

Events (the `event` field of the webhook body):

- ``job.skips_exceeded``: `skip_alert_after` consecutive ticks of a job found
  its previous run still going.
- ``job.recovered``: the job ran again after such a streak.
- ``job.failures_exceeded``: `fail_alert_after` consecutive runs of a job failed.
- ``job.failures_recovered``: the job succeeded again after such a streak.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from scheduler import events
from scheduler.posting import post, redact_url

log = logging.getLogger("scheduler.alerts")

SKIPS_EXCEEDED = "job.skips_exceeded"
RECOVERED = "job.recovered"
FAILURES_EXCEEDED = "job.failures_exceeded"
FAILURES_RECOVERED = "job.failures_recovered"


class Webhook:
    """POSTs JSON bodies from a background thread; never blocks the caller.

    A failed delivery is retried with exponential backoff (`first_delay`
    doubling up to `max_delay`) until `give_up_after` seconds have passed
    since the notice was raised. Deliveries do not wait for each other.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 5.0,
        first_delay: float = 1.0,
        max_delay: float = 60.0,
        give_up_after: float = 900.0,
        max_queued: int = 1000,
        monotonic: Callable[[], float] = time.monotonic,
        on_result: Callable[[str, bool], None] | None = None,
    ) -> None:
        self.url = url
        self.shown = redact_url(url)
        self.timeout = timeout
        self.first_delay = first_delay
        self.max_delay = max_delay
        self.give_up_after = give_up_after
        self.max_queued = max_queued
        self.monotonic = monotonic
        self.on_result = on_result
        self._queue: list[tuple[float, int, int, float, dict[str, Any]]] = []
        self._order = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="webhook", daemon=True)
        self._thread.start()

    def send(self, body: dict[str, Any]) -> None:
        now = self.monotonic()
        with self._cv:
            if len(self._queue) >= self.max_queued:
                log.error(
                    "webhook %s: %d notices queued; dropping %s",
                    self.shown,
                    len(self._queue),
                    body.get("event"),
                )
                return
            heapq.heappush(self._queue, (now, next(self._order), 0, now, body))
            self._cv.notify()

    def close(self, timeout: float = 2.0) -> None:
        """Give queued notices a moment to go out, then stop."""
        deadline = self.monotonic() + timeout
        with self._cv:
            while self._queue and self.monotonic() < deadline:
                due = self._queue[0][0]
                if due > deadline:
                    break
                self._cv.wait(min(0.1, max(0.0, deadline - self.monotonic())))
            self._closed = True
            self._cv.notify()

    def pending(self) -> int:
        with self._cv:
            return len(self._queue)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (
                    not self._queue or self._queue[0][0] > self.monotonic()
                ):
                    wait = self._queue[0][0] - self.monotonic() if self._queue else None
                    self._cv.wait(wait)
                if self._closed:
                    return
                _, order, attempt, raised, body = heapq.heappop(self._queue)
            error = self._post(body)
            event = str(body.get("event"))
            if self.on_result:
                self.on_result(event, error is None)
            if error is None:
                if attempt:
                    log.info(
                        "webhook %s: delivered %s after %d retries", self.shown, event, attempt
                    )
                with self._cv:
                    self._cv.notify_all()
                continue
            delay = min(self.max_delay, self.first_delay * 2**attempt)
            if self.monotonic() + delay - raised > self.give_up_after:
                log.error(
                    "webhook %s: giving up on %s after %d attempts: %s",
                    self.shown,
                    event,
                    attempt + 1,
                    error,
                )
                continue
            log.warning(
                "webhook %s: %s not delivered (%s); retrying in %g s",
                self.shown,
                event,
                error,
                delay,
            )
            with self._cv:
                heapq.heappush(
                    self._queue, (self.monotonic() + delay, order, attempt + 1, raised, body)
                )
                self._cv.notify_all()

    def _post(self, body: dict[str, Any]) -> str | None:
        """None on success, else a reason that never contains the URL."""
        return post(self.url, json.dumps(body).encode(), self.timeout, "application/json")


class Alerts:
    """Turns the gate's streak outcomes into notices."""

    def __init__(
        self,
        instance: str,
        webhook: Webhook | None = None,
        on_alert: Callable[[str, str], None] | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.instance = instance
        self.webhook = webhook
        self.on_alert = on_alert
        self.clock = clock

    def __call__(self, event: events.Event) -> None:
        if isinstance(event, events.TickSkipped) and event.alert:
            running = (
                (self.clock() - event.holder_since).total_seconds() if event.holder_since else None
            )
            held = f" (running for {running:.0f} s)" if running is not None else ""
            self._raise(
                SKIPS_EXCEEDED,
                logging.ERROR,
                f"{event.job}: {event.consecutive_skips} consecutive ticks skipped: the run on "
                f"{event.holder or 'an unknown replica'} is still going{held}",
                job=event.job,
                key=event.key,
                consecutive_skips=event.consecutive_skips,
                threshold=event.threshold,
                holder=event.holder,
                holder_since=_iso(event.holder_since),
                running_s=round(running, 3) if running is not None else None,
                scheduled_at=event.scheduled_at.isoformat(),
            )
        elif isinstance(event, events.RunStarted) and event.skips_recovered:
            self._raise(
                RECOVERED,
                logging.WARNING,
                f"{event.job}: running again on {event.instance} after {event.skips_ended} "
                "consecutive skipped ticks",
                job=event.job,
                key=event.key,
                consecutive_skips=event.skips_ended,
                instance=event.instance,
                run_id=event.run_id,
                scheduled_at=event.scheduled_at.isoformat(),
            )
        elif isinstance(event, events.RunFinished) and event.failures_alert:
            self._raise(
                FAILURES_EXCEEDED,
                logging.ERROR,
                f"{event.job}: {event.consecutive_failures} consecutive runs failed; "
                f"the last on {event.instance}: {event.error}",
                job=event.job,
                key=event.key,
                consecutive_failures=event.consecutive_failures,
                threshold=event.failures_threshold,
                instance=event.instance,
                run_id=event.run_id,
                error=event.error,
                scheduled_at=event.scheduled_at.isoformat(),
            )
        elif isinstance(event, events.RunFinished) and event.failures_recovered:
            self._raise(
                FAILURES_RECOVERED,
                logging.WARNING,
                f"{event.job}: succeeded again on {event.instance} after "
                f"{event.consecutive_failures} consecutive failed runs",
                job=event.job,
                key=event.key,
                consecutive_failures=event.consecutive_failures,
                instance=event.instance,
                run_id=event.run_id,
                scheduled_at=event.scheduled_at.isoformat(),
            )

    def _raise(self, name: str, level: int, text: str, **fields: Any) -> None:
        log.log(level, "ALERT %s: %s", name, text, extra={"alert": name, **fields})
        if self.on_alert:
            self.on_alert(name, str(fields.get("job")))
        if self.webhook is not None:
            self.webhook.send({"event": name, **fields, "raised_by": self.instance, "text": text})


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None
