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
from scheduler.errors import ConfigError, PoolerError, one_line
from scheduler.statuses import CRASHED_LOST_LOCK
from scheduler.urls import (
    database_url_secrets,
    libpq_url,
    parse_database_url,
    redact_database_url,
    scrub,
)

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
    " :crashed, CAST(:keys AS integer[]),"
    " CAST(:names AS text[]), CAST(:ticks AS timestamptz[]), CAST(:intents AS text[]),"
    " CAST(:graces AS double precision[]), CAST(:thresholds AS integer[]))"
)
_FINISH = text(
    "SELECT * FROM scheduler_finish(:ns, :instance, CAST(:keys AS integer[]),"
    " CAST(:ticks AS timestamptz[]), CAST(:run_ids AS bigint[]), CAST(:statuses AS text[]),"
    " CAST(:errors AS text[]), CAST(:told AS text[]), CAST(:durations AS double precision[]),"
    " CAST(:unlocks AS boolean[]), CAST(:thresholds AS integer[]),"
    " CAST(:next_dues AS timestamptz[]))"
)
# SQLSTATEs that end the session itself: a connection failure (class 08), the server
# shutting down or ending the session (57P01-57P05), or a read-only node (a standby,
# after a failover). Any other error (a statement or lock timeout, a deadlock) leaves
# the session and its locks as they were.
_SESSION_ENDING = {"57P01", "57P02", "57P03", "57P04", "57P05", "25006"}


def connect_args(instance: str, holder_timeout: float, url: str) -> dict[str, Any]:
    """libpq options: the instance name for pg_stat_activity, and dead-peer detection."""
    given = parse_database_url(url).option_names
    wanted: dict[str, Any] = {
        "application_name": instance,
        "connect_timeout": max(2, math.ceil(holder_timeout / 3)),
        "keepalives": 1,
        "keepalives_idle": max(1, math.ceil(holder_timeout / 3)),
        "keepalives_interval": max(1, math.ceil(holder_timeout / 9)),
        "keepalives_count": 3,
        "tcp_user_timeout": int(holder_timeout * 1000),
    }
    return {k: v for k, v in wanted.items() if k not in given}


def psycopg_engine(url: str, args: dict[str, Any], **options: Any) -> Engine:
    """A SQLAlchemy engine that hands the URL to libpq as it is.

    SQLAlchemy's own URL parser cannot read multi-host URLs and splits user
    and host at another `@` than libpq does; libpq reads it here, once.
    """
    engine = create_engine("postgresql+psycopg://", connect_args=args, **options)

    @event.listens_for(engine, "do_connect")
    def _connect(_dialect: Any, _record: Any, cargs: list[Any], _cparams: Any) -> None:
        cargs[:] = [libpq_url(url)]

    return engine


def share_of(key: int, live: int) -> int:
    """Which live replica's share a job key falls in (as scheduler_share in postgres.sql)."""
    return (key * 2654435761) % 4294967296 % max(live, 1)


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


# Array literals, cast server-side. A claim sends several arrays of hundreds of
# values each: formatting the literal here costs a fraction of adapting every
# element of a Python list, and one function per element type keeps it cheap.


def pg_numbers(values: Iterable[int | float | None]) -> str:
    return "{" + ",".join("NULL" if v is None else repr(v) for v in values) + "}"


def pg_texts(values: Iterable[str | None]) -> str:
    return "{" + ",".join(map(_text_element, values)) + "}"


def pg_times(values: Iterable[datetime | None]) -> str:
    """A burst's ticks are mostly one instant: each distinct one is formatted once."""
    formatted: dict[datetime | None, str] = {None: "NULL"}
    items = []
    for value in values:
        item = formatted.get(value)
        if item is None:
            assert value is not None
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


class PostgresBackend:
    """A replica's lock session on PostgreSQL."""

    name = "postgresql"
    needs_watchdog = True

    def __init__(
        self,
        url: str,
        *,
        instance: str,
        namespace: int,
        holder_timeout: float,
        schema: str = "public",
    ) -> None:
        self.url = url
        self.schema = schema
        self.instance = instance
        self.namespace = namespace
        self.holder_timeout = holder_timeout
        args = connect_args(instance, holder_timeout, url)
        self.secrets = database_url_secrets(url)
        self.engine = psycopg_engine(url, args, poolclass=NullPool)
        # The second session: housekeeping, notices and the commands (never holds a lock).
        self.ledger_engine = psycopg_engine(
            url, args, pool_size=1, max_overflow=1, pool_recycle=600
        )
        event.listen(self.ledger_engine, "connect", self._ledger_session_settings)
        self._conn: Connection | None = None
        self._fleet = (1, 0)  # live replicas and this one's rank, as of the last claim

    def say(self, exc: BaseException) -> str:
        """A driver's error in one line, with no part of any password in it."""
        return scrub(one_line(exc), self.secrets)

    def _ledger_session_settings(self, dbapi_connection: Any, _record: Any) -> None:
        """A replica frozen mid-transaction must not hold ledger rows for long."""
        with dbapi_connection.cursor() as cursor:
            cursor.execute(
                "SELECT set_config('idle_in_transaction_session_timeout', %s, false),"
                " set_config('statement_timeout', '60s', false),"
                " set_config('search_path', %s, false),"
                " set_config('TimeZone', 'UTC', false)",
                (f"{int(self.holder_timeout * 1000)}ms", search_path(self.schema)),
            )
        dbapi_connection.commit()

    # -- the session ---------------------------------------------------------------

    def connect(self) -> None:
        self.close()
        try:
            conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        except SQLAlchemyError as exc:
            raise Unavailable(self.say(exc)) from None
        try:
            driver = conn.connection.driver_connection
            assert isinstance(driver, psycopg.Connection)
            driver.execute(
                "SELECT set_config('idle_session_timeout', %s, false),"
                " set_config('statement_timeout', %s, false),"
                " set_config('lock_timeout', %s, false),"
                " set_config('tcp_user_timeout', %s, false),"
                " set_config('search_path', %s, false),"
                " set_config('TimeZone', 'UTC', false),"
                " pg_advisory_lock_shared(%s, %s)",
                (
                    *session_timeouts(self.holder_timeout),
                    search_path(self.schema),
                    self.namespace,
                    PRESENCE_KEY,
                ),
            )
        except Exception as exc:
            conn.invalidate()
            conn.close()
            raise Unavailable(self.say(exc)) from None
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
            return migrate(conn, self.namespace, self.schema)

    def verify(self) -> None:
        """Refuse what no retry can mend: a pooler that does not keep sessions, a wrong
        password, a database that does not exist (ConfigError). Unavailable otherwise."""
        try:
            kept = session_is_kept(self.url, self.instance)
        except Exception as exc:
            if is_permanent(exc):
                raise ConfigError(f"{redact_database_url(self.url)}: {self.say(exc)}") from None
            raise Unavailable(self.say(exc)) from None
        if not kept:
            raise PoolerError(f"{redact_database_url(self.url)}: {POOLER_MESSAGE}")

    @contextmanager
    def _session(self) -> Iterator[Connection]:
        conn = self._conn
        if conn is None:
            raise SessionLost("not connected")
        try:
            yield conn
        except SQLAlchemyError as exc:
            if ends_session(exc, conn):
                self.close()
                raise SessionLost(self.say(exc)) from None
            raise

    def abort(self) -> None:
        """Shut the session's socket down under a call that hangs (any thread).

        The blocked call then fails at once, and the gate reconnects. Used
        when no round trip has succeeded for holder_timeout: by then the server
        has ended the session anyway.
        """
        try:
            fd = self.fileno()
            if fd is None:
                return
            with socket.socket(fileno=os.dup(fd)) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except Exception:  # the session is being replaced under us: nothing to cut short
            log.debug("aborting the lock session failed", exc_info=True)

    def fileno(self) -> int | None:
        conn = self._conn  # read once: the dispatcher may replace it meanwhile
        if conn is None:
            return None
        driver = conn.connection.driver_connection
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
            raise SessionLost(self.say(exc) or "the server closed the session") from None
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
            "crashed": CRASHED_LOST_LOCK,
            "keys": pg_numbers([r.key for r in sent]),
            "names": pg_texts([r.name for r in sent]),
            "ticks": pg_times([r.scheduled_at for r in sent]),
            "intents": pg_texts([r.intent for r in sent]),
            "graces": pg_numbers([r.grace_s for r in sent]),
            "thresholds": pg_numbers([r.skip_threshold for r in sent]),
        }
        with self._session() as conn:
            rows = conn.execute(_CLAIM, params).all() if sent else []
        results = [
            ClaimResult(
                row.job_key,
                row.scheduled_at,
                Outcome(row.outcome),
                row.run_id,
                row.started_at,
                row.holder,
                row.holder_since,
                row.streak,
                row.alert,
                row.crashed,
                () if row.notice is None else (row.notice,),
            )
            for row in rows
            if row.outcome != "fleet"
        ]
        summary = next((row for row in rows if row.outcome == "fleet"), None)
        if summary is not None:
            self._fleet = (summary.live, summary.rank)
            results += self._unanswered(sent, results, summary)
        results += [ClaimResult(r.key, r.scheduled_at, Outcome.YIELDED) for r in yielded]
        return results

    @staticmethod
    def _unanswered(
        sent: Sequence[ClaimRequest], answered: list[ClaimResult], summary: Any
    ) -> list[ClaimResult]:
        """What the claim's summary says of the ticks it did not answer one by one."""
        seen = {(r.key, r.scheduled_at) for r in answered}
        live = summary.live if len(sent) >= SHARE_FROM else 1
        cutoff = (
            (summary.deferred_after, summary.deferred_key)
            if summary.deferred_after is not None
            else None
        )
        out = []
        for r in sent:
            if (r.key, r.scheduled_at) in seen:
                continue
            age = (summary.db_now - r.scheduled_at).total_seconds()
            outcome = Outcome.LOST  # another replica owns it (or recorded it missed)
            if r.intent is Intent.RUN and age <= r.grace_s:
                if live > 1 and share_of(r.key, live) != summary.rank and age < TAKEOVER_S:
                    outcome = Outcome.YIELDED
                elif cutoff is not None and (r.scheduled_at, r.key) > cutoff:
                    outcome = Outcome.DEFERRED
            out.append(ClaimResult(r.key, r.scheduled_at, outcome))
        return out

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
            "instance": self.instance,
            "keys": pg_numbers([r.key for r in requests]),
            "ticks": pg_times([r.scheduled_at for r in requests]),
            "run_ids": pg_numbers([r.run_id for r in requests]),
            "statuses": pg_texts([r.status for r in requests]),
            "errors": pg_texts([r.error for r in requests]),
            "told": pg_texts([r.told for r in requests]),
            "durations": pg_numbers([r.duration_s for r in requests]),
            "unlocks": pg_bools([r.unlock for r in requests]),
            "thresholds": pg_numbers([r.fail_threshold for r in requests]),
            "next_dues": pg_times([r.next_due for r in requests]),
        }
        with self._session() as conn:
            rows = conn.execute(_FINISH, params).all()
        return [
            FinishResult(
                row.job_key,
                row.scheduled_at,
                row.recorded,
                row.finished_at,
                row.failures,
                row.alert,
                row.recovered,
                row.skips_recovered,
                tuple(row.notices),
            )
            for row in rows
        ]

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

    # Who holds which of this fleet's advisory locks: scheduler_locks in postgres.sql.

    def free_locks(self, conn: Connection, keys: Sequence[int]) -> set[int]:
        """Which of these job locks no session of this database holds right now."""
        held = {
            row.key
            for row in conn.execute(
                text("SELECT key FROM scheduler_locks(:ns)"), {"ns": self.namespace}
            )
        }
        return {key for key in keys if key not in held}

    def live_instances(self, conn: Connection) -> list[dict[str, Any]]:
        """Replicas whose lock session is up: they hold (lock_namespace, 0) in share mode."""
        rows = conn.execute(
            text(
                "SELECT a.application_name AS name, a.backend_start AS since,"
                " host(a.client_addr) AS address, a.pid"
                " FROM scheduler_locks(:ns) l JOIN pg_stat_activity a ON a.pid = l.pid"
                " WHERE l.key = 0 AND l.shared ORDER BY a.application_name"
            ),
            {"ns": self.namespace},
        )
        return [dict(row._mapping) for row in rows]

    def lock_holders(self, conn: Connection) -> dict[int, str]:
        """Job key -> the instance whose session holds its lock right now."""
        rows = conn.execute(
            text(
                "SELECT l.key, a.application_name AS name"
                " FROM scheduler_locks(:ns) l JOIN pg_stat_activity a ON a.pid = l.pid"
                " WHERE l.key BETWEEN 1 AND 2147483647 AND NOT l.shared"
            ),
            {"ns": self.namespace},
        )
        return {int(row.key): row.name for row in rows}
