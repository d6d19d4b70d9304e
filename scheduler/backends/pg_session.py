"""A replica's sessions with PostgreSQL: how they are opened, and how their errors are judged.

- `connect_args`, `session_timeouts`, `search_path`: what every session sets
  for itself, so that no server configuration is needed.
- `session_is_kept`: whether a pooler sits between us and the server in a
  mode that would move advisory locks from one server session to another.
- `ends_session` and `is_permanent`: which errors lose the session (and its
  locks), and which no retry mends.
- `SessionPerUse`: the ledger's sessions, opened for a chore and closed after it.
- `refuse_standby`: a node in recovery or read-only (a standby, a demoted or
  fenced old primary) is no place to claim: the session is dropped and the
  replica reconnects, to whichever node is the primary now.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import psycopg
from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import ExceptionContext
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.pool import ConnectionPoolEntry, NullPool

from scheduler.config.urls import libpq_url, parse_database_url

POOLER_MESSAGE = (
    "the database connection does not keep one server session across transactions: "
    "a pooler such as PgBouncer in transaction or statement mode sits between this "
    "replica and PostgreSQL. Advisory locks need a session: set PgBouncer's "
    "pool_mode = session for this database, or connect to PostgreSQL directly."
)

READ_ONLY = "25006"  # read_only_sql_transaction: a write reached a standby or a read-only node

# SQLSTATEs that end the session itself: a connection failure (class 08), the server
# shutting down or ending the session (57P01-57P05), or a read-only node (a standby,
# after a failover). Any other error (a statement or lock timeout, a deadlock) leaves
# the session and its locks as they were.
_SESSION_ENDING = {"57P01", "57P02", "57P03", "57P04", "57P05", READ_ONLY}


class SessionPerUse(NullPool):
    """A session opened for each use and closed after it, at most `SESSIONS` at once.

    For the ledger's chores: between them a replica holds no session but its lock
    session, and each use finds the primary of now. The bound keeps a burst of page
    requests (up to the route workers at once) from opening as many sessions: a use
    beyond it waits for one to end, up to `WAIT` seconds, as in a pool of that size.
    """

    SESSIONS = 2
    WAIT = 30.0
    # Its log lines go where SQLAlchemy's pools' go, not under the project's logger (where
    # NullPool's "Pool recreating" would show at INFO at every dispose).
    _sqla_logger_namespace = "sqlalchemy.pool.impl.SessionPerUse"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(self.SESSIONS)

    def _do_get(self) -> ConnectionPoolEntry:
        if not self._slots.acquire(timeout=self.WAIT):
            raise PoolTimeout(
                f"all {self.SESSIONS} ledger sessions of this replica stayed busy for "
                f"{self.WAIT:.0f} s",
                code="3o7r",
            )
        try:
            return super()._do_get()
        except BaseException:
            self._slots.release()
            raise

    def _do_return_conn(self, record: ConnectionPoolEntry) -> None:
        try:
            super()._do_return_conn(record)
        finally:
            self._slots.release()


def connect_args(instance: str, holder_timeout: float, url: str) -> dict[str, Any]:
    """libpq options: the instance name for pg_stat_activity, dead-peer detection, the primary.

    The application_name is always the replica's name, whatever the URL says: the
    fleet tells its live replicas apart by it. `target_session_attrs=read-write`
    (unless the URL sets it): of the hosts of a multi-host URL, libpq takes the
    first that accepts writes, at every (re)connection, so a replica follows the
    primary through a failover. With several hosts each gets a tenth of
    holder_timeout to answer, not a third: a dead one that drops packets (not
    refusing) delays each attempt that much. Options given here win over the URL's.
    """
    parts = parse_database_url(url)
    given = parts.option_names
    share = 10 if parts.host_count > 1 else 3
    wanted: dict[str, Any] = {
        "target_session_attrs": "read-write",
        "connect_timeout": max(2, math.ceil(holder_timeout / share)),
        "keepalives": 1,
        "keepalives_idle": max(1, math.ceil(holder_timeout / 3)),
        "keepalives_interval": max(1, math.ceil(holder_timeout / 9)),
        "keepalives_count": 3,
        "tcp_user_timeout": int(holder_timeout * 1000),
    }
    return {"application_name": instance, **{k: v for k, v in wanted.items() if k not in given}}


def psycopg_engine(url: str, args: dict[str, Any], **options: Any) -> Engine:
    """A SQLAlchemy engine that hands the URL to libpq as it is.

    SQLAlchemy's own URL parser cannot read multi-host URLs and splits user
    and host at another `@` than libpq does; libpq reads it here, once.
    """
    engine = create_engine("postgresql+psycopg://", connect_args=args, **options)

    @event.listens_for(engine, "do_connect")
    def _connect(_dialect: Any, _record: Any, cargs: list[Any], _cparams: Any) -> None:
        cargs[:] = [libpq_url(url)]

    @event.listens_for(engine, "handle_error")
    def _read_only(context: ExceptionContext) -> None:
        # A pooled session on a node that no longer takes writes is of no more use:
        # drop it, so the next checkout connects to the primary.
        if getattr(context.original_exception, "sqlstate", None) == READ_ONLY:
            context.is_disconnect = True

    return engine


# libpq's words when every host it tried refused writes (target_session_attrs).
_NO_WRITABLE_HOST = ("session is read-only", "server is in hot standby mode")


def explain(message: str) -> str:
    """A driver's one-line error, with what libpq's refusal of a standby means here."""
    if any(marker in message for marker in _NO_WRITABLE_HOST):
        return f"{message} (no host of the URL is a writable primary)"
    return message


class NotPrimary(psycopg.OperationalError):
    """The session reached a node that is not the primary: it is dropped like a lost one."""


def refuse_standby(conn: psycopg.Connection[Any]) -> None:
    """Raise NotPrimary unless this session's node is a writable primary.

    In recovery: a standby (advisory locks work there, and would lock nothing
    the fleet sees). Read-only: a node its operator fenced, or a pooler's
    read-only route. Either is named by its address.
    """
    row = conn.execute(
        "SELECT pg_is_in_recovery(), current_setting('transaction_read_only') = 'on'"
    ).fetchone()
    assert row is not None
    in_recovery, read_only = row
    if in_recovery or read_only:
        what = "a standby (in recovery)" if in_recovery else "read-only (transaction_read_only on)"
        raise NotPrimary(f"{node_of(conn)} is {what}: locks and writes need the primary")


def node_of(conn: psycopg.Connection[Any]) -> str:
    """host:port of the node a session reached (one of a multi-host URL's hosts)."""
    host = conn.info.host
    return f"[{host}]:{conn.info.port}" if ":" in host else f"{host}:{conn.info.port}"


def search_path(schema: str) -> str:
    """Every table, function and sequence of a fleet lives in its schema (config: `schema`)."""
    return f'"{schema}"'


def session_timeouts(holder_timeout: float) -> tuple[str, str, str, str]:
    """The lock session's own limits, so that no server configuration is needed.

    - idle_session_timeout = holder_timeout: a replica that goes quiet (frozen, cut
      off) has its session ended by the server, and its locks with it; the gate
      sends a heartbeat after a third of that.
    - statement_timeout = a third, lock_timeout = a sixth: a claim that waits on a
      row lock (a slow or frozen peer's transaction) gives up well before the
      watchdog would doubt the session; the claim is retried, the session kept.
    - tcp_user_timeout = holder_timeout: a reply the client does not read (a
      process frozen mid-reply) cannot keep the session past it either.
    """
    ms = holder_timeout * 1000
    return (f"{int(ms)}ms", f"{int(ms / 3)}ms", f"{int(ms / 6)}ms", str(int(ms)))


def short_connection(url: str, instance: str) -> psycopg.Connection[Any]:
    """A plain autocommit connection for checks, given up on after 5 s."""
    args = connect_args(instance, 30.0, url)
    args["connect_timeout"] = 5
    return psycopg.connect(libpq_url(url), autocommit=True, **args)


def session_is_kept(url: str, instance: str) -> bool:
    """Does each connection keep its own server session from one transaction to the next?

    Advisory locks belong to a server session; a pooler in transaction or
    statement mode hands each transaction to whichever server session is
    free, so a lock would be taken on one session and "released" on another.
    Two connections take turns asking for their backend's pid: in session
    mode each keeps its own (never the other's); a transaction-mode pooler
    hands the same few backends to both.
    """
    with short_connection(url, instance) as first, short_connection(url, instance) as second:
        pids: tuple[set[int], set[int]] = (set(), set())
        for _ in range(3):
            for conn, seen in zip((first, second), pids, strict=True):
                row = conn.execute("SELECT pg_backend_pid()").fetchone()
                assert row is not None
                seen.add(int(row[0]))
    return len(pids[0]) == 1 and len(pids[1]) == 1 and not pids[0] & pids[1]


_TRANSIENT_REFUSALS = (
    "starting up",
    "shutting down",
    "not yet accepting",
    "recovery mode",
    "too many",
    "connection slots",
    "sorry",
)


def is_permanent(exc: BaseException) -> bool:
    """An error no retry mends: the server refused us for who we are or what we asked.

    Authentication, a role or database that does not exist, a missing
    privilege. A server that is starting, stopping or full, a refused or
    timed-out connection, a name that does not resolve: those pass.
    """
    original = getattr(exc, "orig", None) or exc
    if getattr(original, "sqlstate", None) in ("42501", "3D000", "28000", "28P01"):
        return True
    text = str(original)
    if "FATAL:" not in text:
        return False
    refusal = text.split("FATAL:", 1)[1]
    return not any(marker in refusal for marker in _TRANSIENT_REFUSALS)


def ends_session(exc: BaseException, conn: Connection | None) -> bool:
    """Is the session gone with this error, or only the statement that raised it?"""
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    driver = conn.connection.driver_connection if conn is not None and not conn.closed else None
    if not isinstance(driver, psycopg.Connection) or driver.closed:
        return True
    if driver.pgconn.status != psycopg.pq.ConnStatus.OK:
        return True
    original = getattr(exc, "orig", exc)
    if not isinstance(original, psycopg.Error):
        return isinstance(exc, OperationalError)
    state = original.sqlstate
    if state is None:  # raised by the client: the connection failed under it
        return isinstance(original, psycopg.OperationalError | psycopg.InterfaceError)
    return state.startswith("08") or state in _SESSION_ENDING
