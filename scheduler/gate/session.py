"""The lock session: the one connection whose life is the life of this replica's locks.

It knows three things the gate needs: whether the session is up (and when to
try again if not), when the last round trip that succeeded was sent (the
proof that the server still had our session then), and which *generation* of
runs its locks belong to. Runs of one generation share one `lock_lost` event;
the moment the locks can no longer be proven, that event is set and a new
generation begins with a fresh event, in one step, so a run started afterwards
can never be handed an event that is already set.

The server ends a quiet session after `holder_timeout` (the backend sets
`idle_session_timeout`). Here the locks are given up a margin earlier (`trip`),
so a run is told before another replica can take its lock; a watchdog thread
does it even while the dispatcher is stuck in a call to a server that no
longer answers. Backends whose locks are the kernel's (the embedded one) need
no watchdog: their locks live exactly as long as the process.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from scheduler.backends.base import LockStore, SessionLost, Unavailable
from scheduler.errors import one_line

log = logging.getLogger("scheduler.gate")

Monotonic = Callable[[], float]


class _Run(Protocol):
    session: int
    abandoned: bool


class Backoff:
    """Reconnect delays: at once, then doubling up to a cap."""

    def __init__(self, first: float = 0.1, cap: float = 5.0) -> None:
        self.first, self.cap, self.attempts = first, cap, 0

    def next_delay(self) -> float:
        delay = 0.0 if self.attempts == 0 else min(self.cap, self.first * 2 ** (self.attempts - 1))
        self.attempts += 1
        return delay

    def reset(self) -> None:
        self.attempts = 0


@dataclass(frozen=True)
class Generation:
    """The runs started on one stretch of a lock session share its number and its event."""

    number: int
    lock_lost: threading.Event


class LockSession:
    """Connects, proves itself alive, and tells runs when their locks are in doubt."""

    def __init__(
        self,
        backend: LockStore,
        holder_timeout: float,
        monotonic: Monotonic,
        on_told: Callable[[int, str, bool], None],
        on_up: Callable[[], None] = lambda: None,
    ) -> None:
        self.backend = backend
        self.holder_timeout = holder_timeout
        self.heartbeat_every = holder_timeout / 3
        self.watch_every = min(1.0, holder_timeout / 10)
        # Give the locks up before the server can: the watchdog looks only every
        # `watch_every`, and another replica may take a lock the moment it is free.
        self.trip_after = holder_timeout - max(2 * self.watch_every, holder_timeout / 10)
        self.monotonic = monotonic
        # (generation told, reason, first time since the session opened): its runs were told
        self.on_told = on_told
        self.on_up = on_up  # a session was just opened
        self._told_since_open = False
        self.connected = False
        self.opened = 0  # sessions opened so far (the dispatcher watches each one's socket)
        self.last_proof = monotonic()  # send time of the last round trip that succeeded
        self._guard = threading.Lock()
        self._generation = Generation(0, threading.Event())
        self._backoff = Backoff()
        self._retry_at = 0.0

    # -- generations ---------------------------------------------------------------------

    @property
    def generation(self) -> Generation:
        """The generation a run started now belongs to (read it once per batch)."""
        return self._generation

    def tell(self, reason: str) -> Generation:
        """Every run of the current generation is told its lock is lost; a new one begins.

        Returns the generation that was told (its runs' finishes must not unlock:
        whatever the session holds now is not theirs to give back).
        """
        with self._guard:
            told = self._generation
            self._generation = Generation(told.number + 1, threading.Event())
            first, self._told_since_open = not self._told_since_open, True
        told.lock_lost.set()
        self.on_told(told.number, reason, first)
        return told

    def holds_lock_of(self, run: _Run) -> bool:
        """Whether the session up now took `run`'s lock, so that its finish gives it back.

        A run of an earlier session lost its lock with that session; a lock taken
        again since belongs to a newer run. A run abandoned at shutdown keeps its
        lock until the process ends. A run told its lock was in doubt while this
        session survived still has it here, and gives it back.
        """
        return self.connected and run.session == self.opened and not run.abandoned

    # -- the connection ------------------------------------------------------------------

    def wait_time(self) -> float:
        """How long the dispatcher may sleep before this session needs it."""
        now = self.monotonic()
        if not self.connected:
            return max(0.0, self._retry_at - now)
        return max(0.0, self.last_proof + self.heartbeat_every - now)

    def ensure(self) -> bool:
        """Connected, or connecting now if a retry is due; False while the database is away."""
        if self.connected:
            return True
        if self.monotonic() < self._retry_at:
            return False
        try:
            self.backend.connect()
        except Unavailable as exc:
            self._retry_at = self.monotonic() + self._backoff.next_delay() + 0.1
            log.warning("database unreachable (%s); retrying", exc)
            return False
        self.connected = True
        self._told_since_open = False
        self.opened += 1
        self.last_proof = self.monotonic()
        self._backoff.reset()
        self.on_up()
        return True

    def round_trip(self, call: Callable[[], object]) -> object:
        """A call on the session; success proves it was alive when the call was sent."""
        sent = self.monotonic()
        result = call()
        self.last_proof = max(self.last_proof, sent)
        return result

    def heartbeat_due(self) -> bool:
        return self.connected and self.monotonic() - self.last_proof >= self.heartbeat_every

    def in_doubt(self) -> bool:
        """No round trip has been proven for long enough that the server may end the session."""
        if not self.backend.needs_watchdog or not self.connected:
            return False
        return self.monotonic() - self.last_proof > self.trip_after

    def lose(self, reason: str) -> None:
        """The session is gone (or in doubt): tell its runs, drop it, retry with backoff."""
        self.connected = False
        self.tell(reason)
        self.backend.close()
        self._retry_at = self.monotonic() + self._backoff.next_delay()

    def heartbeat(self, expected: set[int] | None) -> list[int]:
        """Prove the session alive and, unless `expected` is None, keep the lock invariant
        (see `give_back`) in the same round trip; returns the locks given back."""
        released = self.round_trip(lambda: self.backend.heartbeat(expected))
        assert isinstance(released, list)
        return released

    def give_back(self, expected: set[int]) -> list[int]:
        """Release every lock the session holds but `expected` (the jobs it runs): the lock
        invariant. Advisory locks outlive the rollback of the transaction that took them,
        so this follows any failed call that may have taken locks (each heartbeat keeps the
        invariant too, in its own round trip: `Backend.heartbeat`).
        No claim is in flight meanwhile: the dispatcher alone talks to the backend. A
        session that cannot do this is given up, which releases every lock.
        """
        try:
            released = self.round_trip(lambda: self.backend.release_strays(expected))
        except SessionLost:
            raise
        except Exception as exc:
            raise SessionLost(f"cannot give back stray locks ({one_line(exc)})") from None
        assert isinstance(released, list)
        return released

    def check_socket(self) -> None:
        """The server spoke between our calls: it is ending the session (raises SessionLost)."""
        self.backend.check_alive()

    # -- the watchdog --------------------------------------------------------------------

    def watch(self, stopped: threading.Event, wake: Callable[[], None]) -> None:
        """Tell runs even while the dispatcher hangs in a call to a dead server.

        Runs on its own thread; nothing it meets may end it.
        """
        if not self.backend.needs_watchdog:
            return
        while not stopped.wait(self.watch_every):
            try:
                self.watch_once(wake)
            except Exception:
                log.exception("lock-session watchdog error (continuing)")

    def watch_once(self, wake: Callable[[], None]) -> None:
        if not self.in_doubt():
            return
        if not self._generation.lock_lost.is_set():
            log.error(
                "locks can no longer be proven (no round trip for %.1f s): "
                "telling its runs their locks are lost",
                self.monotonic() - self.last_proof,
            )
            self.tell("no round trip succeeded within holder_timeout")
        # If the dispatcher hangs in a call to a server that no longer answers (a
        # black-holed network), cut the call short; it then reconnects.
        self.backend.abort()
        wake()


__all__ = ["Backoff", "Generation", "LockSession", "SessionLost"]
