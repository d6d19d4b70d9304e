"""Dead man's switch: healthchecks.io-style pings for jobs with a `ping_url`.

The replica that runs a tick sends `<url>/start` when the run starts, `<url>`
when it succeeds and `<url>/fail` when it fails, from a background thread with
a short timeout. The external service notices the silence when the whole
fleet is down: the one alert that needs no replica. Failures are logged (with
the URL's scheme and host only: its path is the secret) and never retried
for long: a late ping is a wrong ping.
"""

from __future__ import annotations

import logging
import queue
import threading

from scheduler import events
from scheduler.posting import post, redact_url
from scheduler.statuses import Status

log = logging.getLogger("scheduler.pings")


class Pings(events.Observer):
    """Sends pings from one background thread, started with the first ping."""

    def __init__(self, timeout: float = 5.0, max_queued: int = 1000) -> None:
        self.timeout = timeout
        self._queue: queue.Queue[tuple[str, bytes] | None] = queue.Queue(max_queued)
        self._thread: threading.Thread | None = None
        self._starting = threading.Lock()

    def run_started(self, event: events.RunStarted) -> None:
        if event.ping_url:
            self._send(event.ping_url.rstrip("/") + "/start", b"")

    def run_finished(self, event: events.RunFinished) -> None:
        if not event.ping_url or not event.recorded or event.retry_in_s is not None:
            return  # a failed attempt with another to come says nothing yet
        base = event.ping_url.rstrip("/")
        if event.status == Status.SUCCEEDED:
            self._send(base, b"")
        else:
            self._send(base + "/fail", (event.error or event.status).encode()[:10_000])

    def _send(self, url: str, body: bytes) -> None:
        if self._thread is None:
            with self._starting:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name="pings", daemon=True)
                    self._thread.start()
        try:
            self._queue.put_nowait((url, body))
        except queue.Full:
            log.error("ping to %s dropped: too many queued", redact_url(url))

    def close(self, timeout: float = 2.0) -> None:
        """Let queued pings go out (a stopping replica's last /start or success)."""
        with self._starting:
            thread = self._thread
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            url, body = item
            reason = post(url, body, self.timeout)
            if reason is not None:
                log.warning("ping to %s failed: %s", redact_url(url), reason)
