"""Faults at the calls a gate makes into its backend, and the two backends' ways to make them.

`Faulty` stands between a gate and its backend: the fault armed for a replica
meets its next call. An error before the statement, and one after the commit
with the reply lost, are raised here; a statement or lock timeout and a
deadlock are raised inside the call, at one of the statements it writes with
(PostgreSQL: a trigger raising the server's own error code; embedded: one
step of the transaction), so whatever the call did before stays done, locks
included, as with the real fault.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import psycopg
from sqlalchemy.exc import OperationalError

from scheduler.backends.base import FinishRequest, SessionLost
from scheduler.backends.embedded_steps import Steps

CALLS = (
    "claim", "finish", "claim_retries", "recheck", "release_strays", "heartbeat", "take_requests"
)  # fmt: skip

# The server's code for each fault raised inside a statement.
PG_CODES = {"statement_timeout": "57014", "lock_timeout": "55P03", "deadlock": "40P01"}
PG_TABLES = ("scheduler_ticks", "scheduler_attempts", "scheduler_jobs", "scheduler_notices")
PG_POINTS = tuple(f"{table}:{op}" for table in PG_TABLES for op in ("INSERT", "UPDATE"))
FAIL_TRIGGER = """
CREATE OR REPLACE FUNCTION sim_fail_here() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('sim.fail_on', true) = TG_TABLE_NAME || ':' || TG_OP THEN
        RAISE EXCEPTION 'simulated fault on %', TG_TABLE_NAME || ':' || TG_OP
              USING ERRCODE = current_setting('sim.fail_code');
    END IF;
    RETURN NEW;
END $$;
"""
# Embedded: the steps of a claim, a finish, a look for retries and a recheck; `_lock`
# fails just after it took a lock (a statement cut short behind it).
EMBEDDED_POINTS = (
    "choose",
    "lock_manual",
    "insert_ticks",
    "take_locks",
    "record_skips",
    "crash_stale",
    "skip_streaks",
    "record_finishes",
    "finish_streaks",
    "claim_retries",
    "recheck",
    "_lock",
)
# A fault that waits for one kind of call meets it at one of the statements that call
# writes with (the others would let it pass, and wait on for another call).
CALL_POINTS = {
    "claim_retries": {
        "postgresql": ("scheduler_ticks:UPDATE", "scheduler_attempts:INSERT"),
        "embedded": ("claim_retries", "_lock"),
    },
}
EMBEDDED_MESSAGES = {
    "statement_timeout": "interrupted",
    "lock_timeout": "database table is locked",
    "deadlock": "simulated deadlock",
}


def install_pg_trigger(admin: psycopg.Connection) -> None:
    admin.execute(FAIL_TRIGGER)
    for table in PG_TABLES:
        admin.execute(
            f"CREATE OR REPLACE TRIGGER sim_fail BEFORE INSERT OR UPDATE ON {table}"
            " FOR EACH ROW EXECUTE FUNCTION sim_fail_here()"
        )


def injected(what: str) -> OperationalError:
    return OperationalError("simulated", None, RuntimeError(f"simulated {what}"))


class Faulty:
    """The backend a gate is given: its calls go through, or meet the armed fault."""

    def __init__(
        self,
        real: Any,
        *,
        kill: Callable[[], bool],
        fired: Callable[[str], None],
        observe: Callable[[str, tuple[Any, ...], Any], None],
        say: Callable[[str], None] = lambda _text: None,
        touch: Callable[[], None] = lambda: None,
        ahead: Callable[[], timedelta] = lambda: timedelta(0),
    ) -> None:
        self._say = say
        self._ahead = ahead  # how far the database's clock is ahead of the world's
        self._touch = touch  # the ledger or the locks may have changed
        self._real = real
        self._kill = kill  # end this replica's session as the server would (False: cannot)
        self._fired = fired  # count a fault that met a call (or a recheck sent)
        self._observe = observe  # what a call committed: (name, args, result)
        # (fault, point, the call it waits for: None for whichever comes first)
        self.armed: tuple[str, int, str | None] | None = None
        # A comparable play (twins.py): no killed session, faults inside a statement raised
        # at the call's edge, so both backends meet the same faults at the same calls.
        self.comparable = False
        # Claim ahead of the free workers whatever the backend (the embedded one has
        # `recheck` too, though it does not claim ahead on its own), but in a comparable play.
        self.ahead_anyway = False
        self.pid: int | None = None  # PostgreSQL: the lock session's backend

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    @property
    def needs_watchdog(self) -> bool:
        """PostgreSQL's lock session is given up after holder_timeout without a round trip
        (the server ends it); the embedded backend's kernel locks live with the process.
        A comparable play has no such watch on either (see twins.py)."""
        return False if self.comparable else bool(self._real.needs_watchdog)

    @property
    def claims_ahead(self) -> bool:
        """PostgreSQL's claims win runs ahead of the free workers, under a lease; the
        embedded backend's do not (but with `ahead_anyway`). A comparable play claims
        ahead on neither, so that both hand their runs over alike (see twins.py)."""
        if self.comparable:
            return False
        return self.ahead_anyway or bool(self._real.claims_ahead)

    def shape(self) -> Any:
        """PostgreSQL's claims learn the fleet's shape, and a replica then holds other
        replicas' shares of a tick until a probe (gate/others.py); the embedded backend
        shares nothing out. A comparable play shares out on neither (see twins.py).
        Held from one job on, so that the few jobs of a world are held as the bursts of
        a large fleet are."""
        found = None if self.comparable else self._real.shape()
        return None if found is None else dataclasses.replace(found, share_from=1)

    def untaken(self, *args: Any) -> Any:
        return self._call("untaken", args)

    def connect(self) -> None:
        self._touch()
        self._real.connect()
        conn = getattr(self._real, "_conn", None)
        driver = conn.connection.driver_connection if conn is not None else None
        self.pid = driver.info.backend_pid if isinstance(driver, psycopg.Connection) else None

    def claim(self, *args: Any) -> Any:
        return self._call("claim", args)

    def finish(self, requests: Sequence[FinishRequest], *args: Any) -> Any:
        """A run keeps up if it ends before its next tick: the database judges that on its
        own clock, weeks after the world's ticks, so the next tick is told in its time."""
        ahead = self._ahead()
        told = [
            r if r.next_due is None else r._replace(next_due=r.next_due + ahead) for r in requests
        ]
        return self._call("finish", (told, *args))

    def claim_retries(self, *args: Any) -> Any:
        return self._call("claim_retries", args)

    def recheck(self, *args: Any) -> Any:
        """Counted as sent (the summary's rechecks), whether a fault meets it or not."""
        self._fired("recheck_sent")
        return self._call("recheck", args)

    def release_strays(self, *args: Any) -> Any:
        return self._call("release_strays", args)

    def heartbeat(self, *args: Any) -> Any:
        return self._call("heartbeat", args)

    def take_requests(self, *args: Any) -> Any:
        return self._call("take_requests", args)

    def _call(self, name: str, args: tuple[Any, ...]) -> Any:
        self._touch()
        method = getattr(self._real, name)
        armed = self.armed
        # PostgreSQL looks for run-now requests when notified (and once on connecting),
        # the embedded backend by a peek that is no call: a comparable play keeps its
        # faults for the calls both make.
        aside = self.comparable and name == "take_requests"
        if armed is None or armed[2] not in (None, name) or aside:
            return self._observed(name, args, method(*args))
        self.armed = None
        fault, point, _ = armed
        if self.comparable and fault == "killed_session":
            return self._observed(name, args, method(*args))
        self._say(f"{self._real.instance} {name} meets {fault} ({point})")
        if self.comparable and fault in PG_CODES:
            self._fired(fault)
            raise injected(f"{fault} before the statement")
        if fault in ("killed_session", "lost"):
            if fault == "killed_session":
                self._fired(fault)
            if fault == "lost" or not self._kill():  # embedded: the keeper finds it lost
                self._real.close()
                raise SessionLost("simulated: the session was lost")
            return self._observed(name, args, method(*args))
        if fault == "error_before":
            self._fired(fault)
            raise injected("error before the statement")
        # A fault meets the first call (of its kind, if it waits for one) that changes
        # something: a reply lost after a commit that wrote nothing, a statement that
        # never ran, are no fault at all, and the fault waits on.
        if fault == "reply_lost":
            result = self._observed(name, args, method(*args))
            if _empty(result):
                self.armed = armed
                return result
            self._fired(fault)
            raise injected("reply lost after the commit")
        try:
            with self._inside(fault, self._points(name if armed[2] else None), point):
                result = method(*args)
        except SessionLost:
            raise
        except Exception:
            self._fired(fault)
            raise
        self.armed = armed
        return self._observed(name, args, result)

    def _observed(self, name: str, args: tuple[Any, ...], result: Any) -> Any:
        self._observe(name, args, result)
        return result

    def _points(self, call: str | None) -> Sequence[str]:
        """Where a fault inside a statement may meet `call` (None: any call)."""
        embedded = self._real.name == "embedded"
        if call in CALL_POINTS:
            return CALL_POINTS[call]["embedded" if embedded else "postgresql"]
        return EMBEDDED_POINTS if embedded else PG_POINTS

    @contextlib.contextmanager
    def _inside(self, fault: str, points: Sequence[str], point: int) -> Iterator[None]:
        conn = getattr(self._real, "_conn", None)
        if self._real.name == "embedded":
            with _failing_step(points[point % len(points)], fault):
                yield
            return
        if conn is None:
            yield
            return
        where = points[point % len(points)]
        conn.exec_driver_sql(
            f"SELECT set_config('sim.fail_on', '{where}', false),"
            f" set_config('sim.fail_code', '{PG_CODES[fault]}', false)"
        )
        try:
            yield
        finally:
            with contextlib.suppress(Exception):
                if self._real._conn is conn:
                    conn.exec_driver_sql("SELECT set_config('sim.fail_on', '', false)")


def _empty(result: Any) -> bool:
    started = getattr(result, "started", result)  # Retries: what the look started
    return isinstance(started, list) and not started


@contextlib.contextmanager
def _failing_step(point: str, fault: str) -> Iterator[None]:
    original = getattr(Steps, point)
    error = OperationalError("simulated", None, sqlite3.OperationalError(EMBEDDED_MESSAGES[fault]))

    def failing(self: Steps, *args: Any, **kwargs: Any) -> Any:
        if point == "_lock":  # cut short just after the lock was taken
            original(self, *args, **kwargs)
        raise error

    setattr(Steps, point, failing)
    try:
        yield
    finally:
        setattr(Steps, point, original)
