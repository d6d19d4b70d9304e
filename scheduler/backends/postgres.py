"""The PostgreSQL backend: one session per replica holds its locks and writes its ledger rows.

Why one session: advisory locks belong to the session that took them, and the
claim must take the lock in the same transaction that inserts the tick's row
(see postgres.sql). One session per replica, whatever the number of jobs or
of running jobs, and one round trip per batch of claims or of finishes.

How a frozen or cut-off replica loses its locks without any server
configuration: the session sets its own ``idle_session_timeout`` to
``holder_timeout``, and the gate sends a heartbeat when the session has been
quiet for a third of that. A replica that stops talking (SIGSTOP, a long
pause, a dead network) has its session ended by the server, and its locks
with it. On the client side, TCP keepalives and ``tcp_user_timeout`` bound how
long a call can hang on a dead server.
"""

from __future__ import annotations

import logging
import math
import os
import socket
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from sqlalchemy import Connection, Engine, create_engine, event, func, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, OperationalError, SQLAlchemyError
from sqlalchemy.pool import NullPool

from scheduler.backends.base import (
    ClaimRequest,
    ClaimResult,
    FinishRequest,
    FinishResult,
    Intent,
    Outcome,
    SessionLost,
    Unavailable,
)
from scheduler.backends.schema import migrate
from scheduler.errors import PoolerError, one_line

log = logging.getLogger("scheduler.postgres")

PRESENCE_KEY = 0  # every live replica holds (lock_namespace, 0) in share mode
TAKEOVER_S = 0.1  # a tick left unclaimed this long after its time is anyone's (see the SQL)
SHARE_FROM = 32  # bursts of fewer ticks are not spread over the live replicas

POOLER_MESSAGE = (
    "the database connection does not keep one server session across transactions: "
    "a pooler such as PgBouncer in transaction or statement mode sits between this "
    "replica and PostgreSQL. Advisory locks need a session: set PgBouncer's "
    "pool_mode = session for this database, or connect to PostgreSQL directly."
)

_CLAIM = text(
    "SELECT * FROM scheduler_claim(:ns, :instance, :capacity, :takeover, :share_from,"
    " CAST(:keys AS integer[]),"
    " CAST(:names AS text[]), CAST(:ticks AS timestamptz[]), CAST(:intents AS text[]),"
    " CAST(:graces AS double precision[]), CAST(:thresholds AS integer[]))"
)
_FINISH = text(
    "SELECT * FROM scheduler_finish(:ns, CAST(:keys AS integer[]),"
    " CAST(:ticks AS timestamptz[]), CAST(:run_ids AS bigint[]), CAST(:statuses AS text[]),"
    " CAST(:errors AS text[]), CAST(:unlocks AS boolean[]), CAST(:thresholds AS integer[]))"
)


def sqlalchemy_url(url: str) -> str:
    """Accept the usual postgresql:// spellings; drive them with psycopg 3."""
    for prefix in ("postgresql+psycopg://", "postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    raise ValueError("not a postgresql:// URL")


def redact(url: str) -> str:
    """The URL with its password hidden, for logs and messages."""
    try:
        return (
            make_url(sqlalchemy_url(url))
            .render_as_string(hide_password=True)
            .replace("postgresql+psycopg://", "postgresql://")
        )
    except Exception:
        return "postgresql://…"


def connect_args(instance: str, holder_timeout: float, url: str) -> dict[str, Any]:
    """libpq options: the instance name for pg_stat_activity, and dead-peer detection."""
    query = make_url(sqlalchemy_url(url)).query
    wanted: dict[str, Any] = {
        "application_name": instance,
        "connect_timeout": max(2, math.ceil(holder_timeout / 3)),
        "keepalives": 1,
        "keepalives_idle": max(1, math.ceil(holder_timeout / 3)),
        "keepalives_interval": max(1, math.ceil(holder_timeout / 9)),
        "keepalives_count": 3,
        "tcp_user_timeout": int(holder_timeout * 1000),
    }
    return {k: v for k, v in wanted.items() if k not in query}


def share_of(key: int, live: int) -> int:
    """Which live replica's share a job key falls in (as in postgres.sql)."""
    return (key * 2654435761) % 4294967296 % live


# Array literals, cast server-side. A claim sends several arrays of hundreds of
# values each: formatting the literal here costs a fraction of adapting every
# element of a Python list, and one function per element type keeps it cheap.


def pg_numbers(values: Iterable[int | float]) -> str:
    return "{" + ",".join(map(repr, values)) + "}"


def pg_texts(values: Iterable[str | None]) -> str:
    return "{" + ",".join(map(_text_element, values)) + "}"


def pg_times(values: Iterable[datetime]) -> str:
    """A burst's ticks are mostly one instant: each distinct one is formatted once."""
    formatted: dict[datetime, str] = {}
    items = []
    for value in values:
        item = formatted.get(value)
        if item is None:
            item = formatted[value] = f'"{value.isoformat()}"'
        items.append(item)
    return "{" + ",".join(items) + "}"


def pg_bools(values: Iterable[bool]) -> str:
    return "{" + ",".join("t" if value else "f" for value in values) + "}"


def _text_element(value: str | None) -> str:
    if value is None:
        return "NULL"
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def short_connection(url: str, instance: str) -> psycopg.Connection[Any]:
    """A plain autocommit connection for checks, given up on after 5 s."""
    args = connect_args(instance, 30.0, url)
    args["connect_timeout"] = 5
    plain = sqlalchemy_url(url).replace("postgresql+psycopg://", "postgresql://", 1)
    return psycopg.connect(plain, autocommit=True, **args)


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


def is_connection_error(exc: BaseException) -> bool:
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    original = getattr(exc, "orig", exc)
    if isinstance(original, psycopg.OperationalError):
        return True
    return isinstance(exc, OperationalError)


class PostgresBackend:
    """A replica's lock session on PostgreSQL."""

    name = "postgresql"

    def __init__(
        self,
        url: str,
        *,
        instance: str,
        namespace: int,
        holder_timeout: float,
    ) -> None:
        self.url = url
        self.instance = instance
        self.namespace = namespace
        self.holder_timeout = holder_timeout
        self.engine: Engine = create_engine(
            sqlalchemy_url(url),
            poolclass=NullPool,
            connect_args=connect_args(instance, holder_timeout, url),
        )
        # The second session: housekeeping and nothing else (never holds a lock).
        self.ledger_engine: Engine = create_engine(
            sqlalchemy_url(url),
            pool_size=1,
            max_overflow=1,
            pool_recycle=600,
            connect_args=connect_args(instance, holder_timeout, url),
        )
        event.listen(self.ledger_engine, "connect", self._ledger_session_settings)
        self._conn: Connection | None = None
        self._fleet = (1, 0)  # live replicas and this one's rank, as of the last claim

    def _ledger_session_settings(self, dbapi_connection: Any, _record: Any) -> None:
        """A replica frozen mid-transaction must not hold ledger rows for long."""
        with dbapi_connection.cursor() as cursor:
            cursor.execute(
                "SELECT set_config('idle_in_transaction_session_timeout', %s, false),"
                " set_config('statement_timeout', '60s', false),"
                " set_config('TimeZone', 'UTC', false)",
                (f"{int(self.holder_timeout * 1000)}ms",),
            )
        dbapi_connection.commit()

    # -- the session ---------------------------------------------------------------

    def connect(self) -> None:
        self.close()
        try:
            conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        except SQLAlchemyError as exc:
            raise Unavailable(one_line(exc)) from None
        try:
            driver = conn.connection.driver_connection
            assert isinstance(driver, psycopg.Connection)
            driver.execute(
                "SELECT set_config('idle_session_timeout', %s, false),"
                " set_config('statement_timeout', %s, false),"
                " set_config('TimeZone', 'UTC', false),"
                " pg_advisory_lock_shared(%s, %s)",
                (
                    f"{int(self.holder_timeout * 1000)}ms",
                    f"{int(self.holder_timeout * 500)}ms",
                    self.namespace,
                    PRESENCE_KEY,
                ),
            )
        except Exception as exc:
            conn.invalidate()
            conn.close()
            raise Unavailable(one_line(exc)) from None
        self._conn = conn

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.invalidate()  # never return a session with locks to any pool
                conn.close()
            except Exception:
                log.debug("closing the lock session failed", exc_info=True)

    def migrate(self) -> int:
        with self.ledger_engine.connect() as conn:
            return migrate(conn, self.namespace)

    def verify(self) -> None:
        """Refuse a pooler that does not keep sessions (raises PoolerError)."""
        try:
            kept = session_is_kept(self.url, self.instance)
        except psycopg.OperationalError as exc:
            raise Unavailable(one_line(exc)) from None
        if not kept:
            raise PoolerError(f"{redact(self.url)}: {POOLER_MESSAGE}")

    @contextmanager
    def _session(self) -> Iterator[Connection]:
        if self._conn is None:
            raise SessionLost("not connected")
        try:
            yield self._conn
        except SQLAlchemyError as exc:
            if is_connection_error(exc):
                self.close()
                raise SessionLost(one_line(exc)) from None
            raise

    def abort(self) -> None:
        """Shut the session's socket down under a call that hangs (any thread).

        The blocked call then fails at once, and the gate reconnects. Used
        when no round trip has succeeded for holder_timeout: by then the server
        has ended the session anyway.
        """
        fd = self.fileno()
        if fd is None:
            return
        try:
            with socket.socket(fileno=os.dup(fd)) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def fileno(self) -> int | None:
        if self._conn is None:
            return None
        driver = self._conn.connection.driver_connection
        return driver.fileno() if isinstance(driver, psycopg.Connection) else None

    def check_alive(self) -> None:
        """The socket is readable while we wait for nothing: the server said goodbye."""
        if self._conn is None:
            raise SessionLost("not connected")
        driver = self._conn.connection.driver_connection
        assert isinstance(driver, psycopg.Connection)
        pgconn = driver.pgconn
        try:
            pgconn.consume_input()
        except psycopg.OperationalError as exc:
            self.close()
            raise SessionLost(str(exc).strip() or "the server closed the session") from None
        if pgconn.status != psycopg.pq.ConnStatus.OK:
            self.close()
            raise SessionLost("the server closed the session")
        while (notice := pgconn.notifies()) is not None:
            log.debug("ignoring notification %r", notice)

    # -- the gate's two steps ----------------------------------------------------

    def claim(
        self, requests: Sequence[ClaimRequest], instance: str, capacity: int
    ) -> list[ClaimResult]:
        """One call to scheduler_claim; other replicas' shares of a burst are not even sent.

        The share rule is the SQL function's (which stays the judge): while the
        fleet looks as it did at the last claim, a tick of another replica's
        share comes back `yielded` without a round trip, unless it is old
        enough for anyone to take.
        """
        sent, yielded = self._split_shares(requests)
        params = {
            "ns": self.namespace,
            "instance": instance,
            "capacity": capacity,
            "takeover": TAKEOVER_S,
            "share_from": SHARE_FROM,
            "keys": pg_numbers([r.key for r in sent]),
            "names": pg_texts([r.name for r in sent]),
            "ticks": pg_times([r.scheduled_at for r in sent]),
            "intents": pg_texts([r.intent for r in sent]),
            "graces": pg_numbers([r.grace_s for r in sent]),
            "thresholds": pg_numbers([r.skip_threshold for r in sent]),
        }
        with self._session() as conn:
            rows = conn.execute(_CLAIM, params).all() if sent else []
        if rows:
            self._fleet = (rows[0][11], rows[0][12])
        # Columns in ClaimResult's order, then the fleet's size and this replica's rank.
        results = [ClaimResult(row[0], row[1], Outcome(row[2]), *row[3:11]) for row in rows]
        # The function leaves out the ticks another replica owns: they are `lost`.
        answered = {(r.key, r.scheduled_at) for r in results}
        results += [
            ClaimResult(r.key, r.scheduled_at, Outcome.LOST)
            for r in sent
            if (r.key, r.scheduled_at) not in answered
        ]
        results += [ClaimResult(r.key, r.scheduled_at, Outcome.YIELDED) for r in yielded]
        return results

    def _split_shares(
        self, requests: Sequence[ClaimRequest]
    ) -> tuple[list[ClaimRequest], list[ClaimRequest]]:
        live, rank = self._fleet
        if live <= 1 or len(requests) < SHARE_FROM:
            return list(requests), []
        young = datetime.now(UTC) - timedelta(seconds=TAKEOVER_S)
        sent, yielded = [], []
        for r in requests:
            theirs = (
                r.intent is Intent.RUN and share_of(r.key, live) != rank and r.scheduled_at > young
            )
            (yielded if theirs else sent).append(r)
        return sent, yielded

    def release(self, keys: Sequence[int]) -> None:
        """Release locks a failed claim may have taken (they outlive a rollback)."""
        with self._session() as conn:
            conn.execute(
                text("SELECT pg_advisory_unlock(:ns, k) FROM unnest(CAST(:keys AS integer[])) k"),
                {"ns": self.namespace, "keys": pg_numbers(keys)},
            )

    def finish(self, requests: Sequence[FinishRequest]) -> list[FinishResult]:
        params = {
            "ns": self.namespace,
            "keys": pg_numbers([r.key for r in requests]),
            "ticks": pg_times([r.scheduled_at for r in requests]),
            "run_ids": pg_numbers([r.run_id for r in requests]),
            "statuses": pg_texts([r.status for r in requests]),
            "errors": pg_texts([r.error for r in requests]),
            "unlocks": pg_bools([r.unlock for r in requests]),
            "thresholds": pg_numbers([r.fail_threshold for r in requests]),
        }
        with self._session() as conn:
            rows = conn.execute(_FINISH, params).all()
        return [FinishResult(*row) for row in rows]  # columns in FinishResult's order

    def heartbeat(self) -> datetime:
        with self._session() as conn:
            now = conn.execute(text("SELECT now()")).scalar_one()
        assert isinstance(now, datetime)
        return now

    # -- housekeeping, on the ledger session -------------------------------------

    def now_expression(self) -> Any:
        return func.now()

    def now(self, conn: Connection) -> datetime:
        value = conn.execute(select(func.now())).scalar_one()
        assert isinstance(value, datetime)
        return value

    def free_locks(self, conn: Connection, keys: Sequence[int]) -> set[int]:
        """Which of these job locks no session of this database holds right now."""
        rows = conn.execute(
            text(
                "SELECT k FROM unnest(CAST(:keys AS integer[])) AS k WHERE NOT EXISTS ("
                " SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted"
                " AND l.database = (SELECT oid FROM pg_database"
                "                   WHERE datname = current_database())"
                " AND l.classid = CAST(CAST(:ns AS bigint) AS oid)"
                " AND l.objid = CAST(k AS oid) AND l.objsubid = 2)"
            ),
            {"keys": list(keys), "ns": self.namespace & 0xFFFFFFFF},
        )
        return {row[0] for row in rows}

    def live_instances(self, conn: Connection) -> list[dict[str, Any]]:
        """Replicas whose lock session is up: they hold (lock_namespace, 0) in share mode."""
        rows = conn.execute(
            text(
                "SELECT a.application_name AS name, a.backend_start AS since,"
                " host(a.client_addr) AS address, a.pid"
                " FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
                " WHERE l.locktype = 'advisory' AND l.granted AND l.mode = 'ShareLock'"
                " AND l.database = (SELECT oid FROM pg_database"
                "                   WHERE datname = current_database())"
                " AND l.classid = CAST(CAST(:ns AS bigint) AS oid)"
                " AND l.objid = CAST(:key AS oid) AND l.objsubid = 2"
                " ORDER BY a.application_name"
            ),
            {"ns": self.namespace & 0xFFFFFFFF, "key": PRESENCE_KEY},
        )
        return [dict(row._mapping) for row in rows]

    def lock_holders(self, conn: Connection) -> dict[int, str]:
        """Job key -> the instance whose session holds its lock right now."""
        rows = conn.execute(
            text(
                "SELECT CAST(l.objid AS bigint) AS key, a.application_name AS name"
                " FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
                " WHERE l.locktype = 'advisory' AND l.granted AND l.mode = 'ExclusiveLock'"
                " AND l.database = (SELECT oid FROM pg_database"
                "                   WHERE datname = current_database())"
                " AND l.classid = CAST(CAST(:ns AS bigint) AS oid) AND l.objsubid = 2"
                " AND l.objid <> CAST(0 AS oid)"
            ),
            {"ns": self.namespace & 0xFFFFFFFF},
        )
        return {int(row.key): row.name for row in rows}
