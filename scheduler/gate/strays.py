"""The lock invariant: this session holds a job's lock only while a run of that job is here.

Advisory locks outlive the rollback of the transaction that took them, so
after any failed call that may have taken locks, and at each heartbeat, every
lock the session holds with no run here is given back (`release_strays`).
"""

from __future__ import annotations

from collections.abc import Callable

from scheduler.backends.base import LockStore, SessionLost
from scheduler.errors import one_line
from scheduler.gate.manual import RequestDesk
from scheduler.gate.session import LockSession
from scheduler.gate.table import RunTable
from scheduler.observers import events


class StrayLocks:
    def __init__(
        self,
        backend: LockStore,
        session: LockSession,
        table: RunTable,
        *,
        instance: str,
        emit: Callable[[events.Event], None],
        desk: RequestDesk | None,
    ) -> None:
        self.backend = backend
        self.session = session
        self.table = table
        self.instance = instance
        self.emit = emit
        self.desk = desk  # names the jobs of the keys released, where it knows them

    def after(self, action: Callable[[], bool], what: str) -> None:
        """A step whose calls may take locks: if one failed, what it left is given back."""
        if action():
            self.give_back(after=what)

    def give_back(self, after: str | None) -> None:
        """Release every lock this session holds with no run of its job here.

        After a failed call (`after` names it), that is what the call left behind.
        At the heartbeat (`after` None) it is the invariant's check, and whatever it
        finds is a fault, reported and counted. No claim is in flight meanwhile: the
        dispatcher alone talks to the backend. A session that cannot do this is given
        up, which releases every lock.
        """
        expected = self.table.expected_locks(self.session.opened)
        try:
            released = self.session.round_trip(lambda: self.backend.release_strays(expected))
        except SessionLost:
            raise
        except Exception as exc:
            raise SessionLost(f"cannot give back stray locks ({one_line(exc)})") from None
        assert isinstance(released, list)
        if released:
            desk = self.desk
            named = tuple(
                (key, job.name if (job := desk and desk.job(key)) else None) for key in released
            )
            self.emit(events.LocksReleased(self.instance, named, after))
