"""Dead man's switch: healthchecks.io-style pings for jobs with a `ping_url`.

The replica that runs a tick sends `<url>/start` when the run starts, `<url>`
when it succeeds and `<url>/fail` when it fails, from background threads,
in order for each host, each within one attempt's deadline; a slow host
holds up no other host's pings. The external service notices the silence when the whole
fleet is down: the one alert that needs no replica. Failures are logged (with
the URL's scheme and host only: its path is the secret) and never retried
for long: a late ping is a wrong ping.
"""

from __future__ import annotations

import logging

from scheduler.config.budgets import (
    ATTEMPT_DEADLINE,
    PING_WORKERS,
    PINGS_PER_RECEIVER,
    PINGS_QUEUED,
)
from scheduler.observers import events
from scheduler.observers.posting import Courier, redact_url
from scheduler.statuses import Status

log = logging.getLogger("scheduler.pings")


class Pings(events.Observer):
    """Sends pings from a courier's threads: a slow ping service holds up no other."""

    def __init__(self, deadline_s: float = ATTEMPT_DEADLINE) -> None:
        self.courier = Courier(
            "pings",
            workers=PING_WORKERS,
            per_receiver=PINGS_PER_RECEIVER,
            max_queued=PINGS_QUEUED,
            deadline_s=deadline_s,
        )

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
        def then(reason: str | None) -> None:
            if reason is not None:
                log.warning("ping to %s failed: %s", redact_url(url), reason)

        if not self.courier.send(url, body, then=then):
            log.error("ping to %s dropped: too many queued", redact_url(url))

    def close(self, timeout: float = 2.0) -> None:
        """Let queued pings go out (a stopping replica's last /start or success)."""
        self.courier.close(timeout)
