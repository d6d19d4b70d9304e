"""POSTing notices (alert webhooks, dead man's switch pings) from background threads.

`post` makes one attempt under the budgets of `scheduler.config.budgets` (one
deadline for all of it, a few KiB of the reply read, no redirects: see
`scheduler.observers.http_client`, imported on the first POST) and answers every
failure, whatever the URL or the server did, with a reason instead of raising.

`Courier` sends them from a few threads of its own, so that no caller waits on
a receiver, and keeps receivers apart: each receiver (scheme, host and port)
has at most `per_receiver` attempts in flight, so a slow or hostile one holds
up another's POSTs by no more than one attempt's deadline.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from scheduler.config.budgets import ATTEMPT_DEADLINE
from scheduler.config.urls import redact_http_url

log = logging.getLogger("scheduler.posting")

Outcome = Callable[[str | None], None]  # told None on success, else the reason


def redact_url(url: str) -> str:
    """Scheme and host only: webhook paths and queries carry secrets (Slack, healthchecks)."""
    return redact_http_url(url)


def post(
    url: str, body: bytes, deadline_s: float = ATTEMPT_DEADLINE, content_type: str | None = None
) -> str | None:
    """None on success, else the reason it failed, which never contains the URL."""
    from scheduler.observers import http_client

    return http_client.post(url, body, deadline_s, content_type)


def receiver(url: str) -> str:
    """Who answers a URL: its scheme, host and port."""
    try:
        parts = urlsplit(url)
        return f"{parts.scheme}://{parts.hostname}:{parts.port}"
    except ValueError:
        return "?"


@dataclass(frozen=True)
class _Letter:
    url: str
    body: bytes
    content_type: str | None
    then: Outcome | None


class Courier:
    """POSTs from at most `workers` threads, started as needed; callers never wait."""

    def __init__(
        self,
        name: str,
        *,
        workers: int,
        per_receiver: int,
        max_queued: int,
        deadline_s: float = ATTEMPT_DEADLINE,
    ) -> None:
        self.name = name
        self.workers = workers
        self.per_receiver = per_receiver
        self.max_queued = max_queued
        self.deadline_s = deadline_s
        self._cv = threading.Condition()
        self._queues: dict[str, deque[_Letter]] = {}
        self._in_flight: dict[str, int] = {}
        self._queued = 0
        self._threads = 0
        self._idle = 0
        self._closed = False

    def send(
        self, url: str, body: bytes, content_type: str | None = None, then: Outcome | None = None
    ) -> bool:
        """Queue one POST; False when it is dropped (too many queued, or closed)."""
        with self._cv:
            if self._closed or self._queued >= self.max_queued:
                return False
            self._queues.setdefault(receiver(url), deque()).append(
                _Letter(url, body, content_type, then)
            )
            self._queued += 1
            if self._idle == 0 and self._threads < self.workers:
                self._threads += 1
                threading.Thread(target=self._work, name=self.name, daemon=True).start()
            self._cv.notify()
        return True

    def close(self, timeout: float) -> None:
        """Let what is queued go out for up to `timeout` seconds; then send nothing more."""
        with self._cv:
            self._cv.wait_for(lambda: not self._queued and not self._in_flight, timeout)
            self._closed = True
            self._cv.notify_all()

    def _next(self) -> tuple[str, _Letter] | None:
        """The oldest letter of the first receiver with an attempt to spare (under the lock)."""
        for where, letters in self._queues.items():
            if self._in_flight.get(where, 0) < self.per_receiver:
                letter = letters.popleft()
                if not letters:
                    del self._queues[where]
                self._queued -= 1
                self._in_flight[where] = self._in_flight.get(where, 0) + 1
                return where, letter
        return None

    def _work(self) -> None:
        while True:
            with self._cv:
                self._idle += 1
                while not self._closed and (found := self._next()) is None:
                    self._cv.wait()
                self._idle -= 1
                if self._closed:
                    self._threads -= 1
                    return
            assert found is not None  # the loop above left only when closed or found
            where, letter = found
            try:
                reason = post(letter.url, letter.body, self.deadline_s, letter.content_type)
                if letter.then is not None:
                    letter.then(reason)
            except Exception:
                log.exception("%s: a delivery's outcome could not be handled", self.name)
            finally:
                with self._cv:
                    self._in_flight[where] -= 1
                    if not self._in_flight[where]:
                        del self._in_flight[where]
                    self._cv.notify_all()
