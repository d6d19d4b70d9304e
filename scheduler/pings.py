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
import urllib.error
import urllib.request

from scheduler import events
from scheduler.alerts import redact_url

log = logging.getLogger("scheduler.pings")


class Pings:
    def __init__(self, timeout: float = 5.0, max_queued: int = 1000) -> None:
        self.timeout = timeout
        self._queue: queue.Queue[tuple[str, bytes] | None] = queue.Queue(max_queued)
        self._thread = threading.Thread(target=self._loop, name="pings", daemon=True)
        self._thread.start()

    def __call__(self, event: events.Event) -> None:
        if isinstance(event, events.RunStarted) and event.ping_url:
            self._send(event.ping_url.rstrip("/") + "/start", b"")
        elif isinstance(event, events.RunFinished) and event.ping_url and event.recorded:
            base = event.ping_url.rstrip("/")
            if event.status == "succeeded":
                self._send(base, b"")
            else:
                self._send(base + "/fail", (event.error or event.status).encode()[:10_000])

    def _send(self, url: str, body: bytes) -> None:
        try:
            self._queue.put_nowait((url, body))
        except queue.Full:
            log.error("ping to %s dropped: too many queued", redact_url(url))

    def close(self, timeout: float = 2.0) -> None:
        """Let queued pings go out (a stopping replica's last /start or success)."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            url, body = item
            request = urllib.request.Request(
                url, data=body, method="POST", headers={"User-Agent": "scheduler"}
            )
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    response.read()
            except urllib.error.HTTPError as exc:
                log.warning("ping to %s failed: HTTP %d", redact_url(url), exc.code)
            except (urllib.error.URLError, OSError, ValueError) as exc:
                reason = getattr(exc, "reason", exc)
                log.warning("ping to %s failed: %s", redact_url(url), type(reason).__name__)
