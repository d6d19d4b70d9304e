"""The gate's plumbing: its events handed to observers, and its dispatcher woken."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence

from scheduler.observers import events

log = logging.getLogger("scheduler.gate")


class Emitter:
    """Hands each event to every listener, in order; a listener that fails is logged
    and the others still hear it (observers never steer the gate)."""

    def __init__(self, listeners: Sequence[events.Listener] = ()) -> None:
        self.listeners = list(listeners)

    def __call__(self, event: events.Event) -> None:
        for listener in self.listeners:
            try:
                listener(event)
            except Exception:
                log.exception("listener %r failed on %s", listener, type(event).__name__)


class Waker:
    """A pipe the dispatcher's selector watches: any thread wakes it with one write."""

    def __init__(self) -> None:
        self.fileno, self._write = os.pipe()
        os.set_blocking(self.fileno, False)
        os.set_blocking(self._write, False)

    def __call__(self) -> None:
        with contextlib.suppress(BlockingIOError):  # the pipe is full: already awake
            os.write(self._write, b"\0")

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.fileno, 4096):
                pass
