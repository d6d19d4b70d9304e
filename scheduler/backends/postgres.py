"""The PostgreSQL backend: one session per replica holds its locks and writes its ledger rows.

Why one session: advisory locks belong to the session that took them, and the
claim must take the lock in the same transaction that inserts the tick's row
(see postgres.sql). One session per replica, whatever the number of jobs or
of running jobs, and one round trip per batch of claims or of finishes.

How a frozen or cut-off replica loses its locks without any server
configuration: see `pg_session.session_timeouts`. The statements it sends are
named in queries.sql; the gate's steps are the functions of postgres.sql.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any, NamedTuple

import psycopg
from sqlalchemy import Connection, event, func, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import NullPool

from scheduler.backends import shares
from scheduler.backends.base import (
    ClaimAnswer,
    ClaimRequest,
    ClaimResult,
    Crashes,
    FinishRequest,
    FinishResult,
    Outcome,
    Recheck,
    Retries,
    SessionLost,
    TickRef,
    Unavailable,
)
from scheduler.backends.pg_session import (
    POOLER_MESSAGE,
    SessionPerUse,
    connect_args,
    ends_session,
    explain,
    is_permanent,
    node_of,
    psycopg_engine,
    refuse_standby,
    search_path,
    session_is_kept,
    session_timeouts,
)
from scheduler.backends.queries import QUERIES
from scheduler.backends.schema import migrate
from scheduler.config.urls import (
    database_url_secrets,
    redact_database_url,
    scrub,
)
from scheduler.errors import ConfigError, PoolerError, one_line
from scheduler.ledger.run_now import (
    RUN_NOW_TAKE_AT_ONCE,
    RunRequest,
    run_now_channel,
    take_run_requests,
)
from scheduler.statuses import CRASHED_LOST_LOCK

log = logging.getLogger("scheduler.postgres")

PRESENCE_KEY = 0  # every live replica holds (lock_namespace, 0) in share mode
TAKEOVER_S = 0.1  # a tick left unclaimed this long after its time is anyone's (see the SQL)
SHARE_FROM = shares.SHARE_FROM  # bursts of fewer ticks are not spread over the replicas


class Decision(NamedTuple):
    """scheduler_decide's one row (postgres.sql): column by column, the ticks this replica
    recorded or could not lock; then the rest, by outcome, as spans of places in the
    batch sent (1-based first places, and lengths). An outcome with no tick is NULL."""

    keys: list[int] | None
    ticks: list[datetime] | None
    outcomes: list[str] | None
    run_ids: list[int | None] | None
    started_at: list[datetime | None] | None
    holders: list[str | None] | None
    holder_since: list[datetime | None] | None
    streaks: list[int] | None
    alerts: list[bool] | None
    crashed: list[int] | None
    notices: list[int | None] | None
    lost_from: list[int] | None
    lost_counts: list[int] | None
    yielded_from: list[int] | None
    yielded_counts: list[int] | None
    deferred_from: list[int] | None
    deferred_counts: list[int] | None

    def claimed(self, sent: Sequence[ClaimRequest]) -> ClaimAnswer:
        """The answer, read column by column (a burst's hundred rows cost no lookups)."""
        columns = (
            self.keys, self.ticks, self.outcomes, self.run_ids, self.started_at, self.holders,
            self.holder_since, self.streaks, self.alerts, self.crashed, self.notices,
        )  # fmt: skip
        answered = [
            ClaimResult(key, tick, Outcome(outcome), run_id, started, holder, since, streak,
                        alert, crashed, () if notice is None else (notice,))
            for key, tick, outcome, run_id, started, holder, since, streak, alert, crashed, notice
            in _columns(columns)
        ]  # fmt: skip
        return ClaimAnswer(
            answered,
            _spans(sent, self.lost_from, self.lost_counts),
            _spans(sent, self.yielded_from, self.yielded_counts),
            _spans(sent, self.deferred_from, self.deferred_counts),
        )


class Finished(NamedTuple):
    """A row of scheduler_finish (postgres.sql)."""

    job_key: int
    scheduled_at: datetime
    recorded: bool
    finished_at: datetime | None
    failures: int | None
    alert: bool
    recovered: bool
    skips_recovered: bool
    notices: list[int]

    def result(self) -> FinishResult:
        return FinishResult(
            self.job_key,
            self.scheduled_at,
            self.recorded,
            self.finished_at,
            self.failures,
            self.alert,
            self.recovered,
            self.skips_recovered,
            tuple(self.notices),
        )


class RetriesStarted(NamedTuple):
    """scheduler_start_retries's one row (postgres.sql): the attempts started, column by
    column, and in how many seconds the next retry of these jobs is due."""

    keys: list[int]
    ticks: list[datetime]
    run_ids: list[int]
    started_at: list[datetime]
    attempts: list[int]
    crashed: list[int]
    next_in: float | None

    def retries(self) -> Retries:
        columns = (
            self.keys,
            self.ticks,
            self.run_ids,
            self.started_at,
            self.attempts,
            self.crashed,
        )
        started = [
            ClaimResult(key, tick, Outcome.RUN, run_id, started, crashed=stale, attempt=attempt)
            for key, tick, run_id, started, attempt, stale in _columns(columns)
        ]
        return Retries(started, None if self.next_in is None else float(self.next_in))


def _columns(arrays: Iterable[list[Any] | None]) -> Iterable[tuple[Any, ...]]:
    """Parallel arrays read row by row (NULL: none)."""
    return zip(*(array or () for array in arrays), strict=True)


def _spans(
    sent: Sequence[ClaimRequest], starts: list[int] | None, counts: list[int] | None
) -> list[TickRef]:
    """The ticks at these spans of places in the batch sent (1-based, as SQL counts)."""
    return [
        TickRef(r.key, r.scheduled_at)
        for first, n in _columns((starts, counts))
        for r in sent[first - 1 : first - 1 + n]
    ]


def _decision(result: Any, with_fleet: bool) -> tuple[Decision, tuple[int, int, datetime] | None]:
    """scheduler_decide's row, and with `with_fleet` the fleet's shape read beside it."""
    fleet = ("live", "rank", "db_now") if with_fleet else ()
    _expect_columns(result, Decision._fields + fleet)
    row = tuple(result.one())
    split = len(Decision._fields)
    return Decision(*row[:split]), (tuple(row[split:]) if with_fleet else None)


def named(result: Any, row: type[NamedTuple]) -> list[Any]:
    """A function's rows as `row`, once its columns are the ones named there."""
    _expect_columns(result, row._fields)
    return [row(*found) for found in result.all()]


def _expect_columns(result: Any, expected: tuple[str, ...]) -> None:
    if tuple(result.keys()) != expected:
        raise RuntimeError(f"unexpected columns {tuple(result.keys())}; expected {expected}")


# What goes out: array literals for the calls, cast server-side. A claim sends several
# arrays of hundreds of values each: formatting the literal here costs a fraction of
# adapting every element of a Python list, and one function per element type keeps it cheap.


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


class PostgresBackend:
    """A replica's lock session on PostgreSQL."""

    name = "postgresql"
    needs_watchdog = True
    notifies_requests = True  # LISTEN on the lock session
    claims_ahead = True  # a claim is a round trip: worth winning a few runs ahead

    def __init__(
        self,
        url: str,
        *,
        instance: str,
        namespace: int,
        holder_timeout: float,
        schema: str = "public",
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = url
        self.schema = schema
        self.instance = instance
        self.namespace = namespace
        self.holder_timeout = holder_timeout
        args = connect_args(instance, holder_timeout, url)
        self.secrets = database_url_secrets(url)
        self.engine = psycopg_engine(url, args, poolclass=NullPool)
        # The second session: housekeeping, notices, the page and the commands (never holds
        # a lock). It is opened for each use and closed after it: the chores come every
        # 30 s, so a replica holds one session between them (100 replicas on one server:
        # about 100 sessions, not 200), and each use finds the primary of now.
        self.ledger_engine = psycopg_engine(url, args, poolclass=SessionPerUse)
        event.listen(self.ledger_engine, "connect", self._ledger_session_settings)
        self._conn: Connection | None = None
        self._requests = False  # a run-now request may be waiting (notified, or seen)
        self._retry_in: float | None = None  # the next retry, as the last heartbeat saw it
        self.monotonic = monotonic
        self._shape: shares.Shape | None = None  # the fleet, as a recent claim saw it
        self._probe = True  # whether a claim that helps probes for taken ticks first

    def say(self, exc: BaseException) -> str:
        """A driver's error in one line, with no part of any password in it."""
        return scrub(explain(one_line(exc)), self.secrets)

    def _ledger_session_settings(self, dbapi_connection: Any, _record: Any) -> None:
        """A replica frozen mid-transaction must not hold ledger rows for long.

        A node that is not the primary is refused here, so the ledger is never
        read from a standby that lags, nor written where writes are lost.
        """
        refuse_standby(dbapi_connection)
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
        # The ledger sessions lived on the lock session's node: after a lost session
        # (a failover, a restart) they are opened anew, on whichever node is primary now,
        # rather than each failing once on its first use.
        self.ledger_engine.dispose()
        try:
            conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        except SQLAlchemyError as exc:
            raise Unavailable(self.say(exc)) from None
        try:
            driver = conn.connection.driver_connection
            assert isinstance(driver, psycopg.Connection)
            refuse_standby(driver)
            driver.execute(
                "SELECT set_config('idle_session_timeout', %s, false),"
                " set_config('statement_timeout', %s, false),"
                " set_config('lock_timeout', %s, false),"
                " set_config('tcp_user_timeout', %s, false),"
                " set_config('search_path', %s, false),"
                " set_config('TimeZone', 'UTC', false),"
                # Never compiled: the gate's statements are short, and a plan costed over a
                # guessed number of rows (unnest, a set-returning function) can cross
                # jit_above_cost and spend a second compiling, on the claim's path.
                " set_config('jit', 'off', false),"
                " pg_advisory_lock_shared(%s, %s)",
                (
                    *session_timeouts(self.holder_timeout),
                    search_path(self.schema),
                    self.namespace,
                    PRESENCE_KEY,
                ),
            )
            # Run-now requests wake the dispatcher: it selects on this session's socket.
            driver.execute(f'LISTEN "{run_now_channel(self.namespace)}"')
            driver.add_notify_handler(self._notified)
        except Exception as exc:
            conn.invalidate()
            conn.close()
            raise Unavailable(self.say(exc)) from None
        self._conn = conn
        self._requests = True  # requests made while this replica was away

    def _notified(self, notice: psycopg.Notify) -> None:
        if notice.channel == run_now_channel(self.namespace):
            self._requests = True

    def close(self) -> None:
        conn, self._conn = self._conn, None
        self._shape = None  # the next session has a rank of its own
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
            if notice.relname.decode(errors="replace") == run_now_channel(self.namespace):
                self._requests = True

    # -- the gate's two steps ----------------------------------------------------

    def claim(self, requests: Sequence[ClaimRequest], instance: str, capacity: int) -> ClaimAnswer:
        """One call to scheduler_decide, which answers every tick sent (see postgres.sql).

        Sent in the order given: the claim takes them in that order (oldest tick
        first, its own share of a burst first), so that the ticks left for lack of
        free workers come back as a few spans of places, however large the burst.
        Other replicas' young ticks of a burst are not sent but answered `yielded`
        here (shares.py), as the server would; now and then the claim also reads the
        fleet's shape that this takes. Other replicas' older ticks, offered to help with
        their shares, are probed first (`_taken_first`).
        """
        if not requests:
            return ClaimAnswer([], [], [], [])
        requests = sorted(requests, key=lambda r: r.scheduled_at)  # stable: in order given
        sent_at = self.monotonic()
        requests, others = shares.leave_out(
            requests, self._shape, sent_at, share_from=SHARE_FROM, takeover_s=TAKEOVER_S
        )
        helping = shares.helping(requests, self._shape)
        if len(helping) < SHARE_FROM:
            helping = []
        requests, taken = self._taken_first(requests, helping) if self._probe else (requests, [])
        answer = (
            self._decide(requests, instance, capacity, sent_at)
            if requests
            else ClaimAnswer([], [], [], [])
        )
        if helping:
            self._probe = 2 * (len(taken) + self._lost_among(answer, helping)) >= len(helping)
        if not (others or taken):
            return answer
        return answer._replace(
            lost=answer.lost + [TickRef(r.key, r.scheduled_at) for r in taken],
            yielded=answer.yielded + [TickRef(r.key, r.scheduled_at) for r in others],
        )

    def _taken_first(
        self, requests: list[ClaimRequest], helping: list[ClaimRequest]
    ) -> tuple[list[ClaimRequest], list[ClaimRequest]]:
        """(to send, found taken): a claim that helps with other replicas' shares offers
        hundreds of their ticks, most of them taken by their owners meanwhile (once the
        owners are nearly done: at 1,000 ticks a second, nine in ten). Those are found
        first by one plain probe of the ledger's key (a claim would answer them `lost`,
        at several times the cost of the probe), and only the rest are sent. Asked only
        while the last claim that helped found at least half of its offer taken: early in
        a large burst most are not, and the probe would be a round trip for nothing."""
        if not helping:
            return requests, []
        places = self._taken([(r.key, r.scheduled_at) for r in helping], with_fleet=False)
        taken = [helping[place - 1] for place in sorted(places)]
        if not taken:
            return requests, []
        found = {(r.key, r.scheduled_at) for r in taken}
        return [r for r in requests if (r.key, r.scheduled_at) not in found], taken

    def shape(self) -> shares.Shape | None:
        return self._shape

    def untaken(self, ticks: Sequence[tuple[int, datetime]]) -> list[int]:
        """The places (0-based) of the ticks no replica has recorded: a probe of the
        ledger's key for each, and the fleet's shape read beside it when due."""
        if not ticks:
            return []
        ask = shares.shape_due(self._shape, self.monotonic())
        taken = self._taken(ticks, with_fleet=ask)
        return [place - 1 for place in range(1, len(ticks) + 1) if place not in taken]

    def _taken(self, ticks: Sequence[tuple[int, datetime]], with_fleet: bool) -> set[int]:
        """The places (1-based) of the (job key, tick) some replica has recorded: one probe
        of the ledger's key each; with `with_fleet`, the fleet's shape is read beside."""
        instants: dict[datetime, int] = {}  # each distinct tick -> its place, 1-based
        at = [instants.setdefault(tick, len(instants) + 1) for _, tick in ticks]
        params = {
            "ns": self.namespace,
            "keys": pg_numbers([key for key, _ in ticks]),
            "at": pg_numbers(at),
            "instants": pg_times(instants),
        }
        sent_at = self.monotonic()
        with self._session() as conn:
            if not with_fleet:
                return set(conn.execute(QUERIES["taken"], params).scalar_one())
            places, live, rank, db_now = conn.execute(QUERIES["taken_and_fleet"], params).one()
        self._shape = shares.Shape(live, rank, db_now, sent_at)
        return set(places)

    @staticmethod
    def _lost_among(answer: ClaimAnswer, helping: list[ClaimRequest]) -> int:
        lost = set(answer.lost)
        return sum(TickRef(r.key, r.scheduled_at) in lost for r in helping)

    def _decide(
        self, requests: list[ClaimRequest], instance: str, capacity: int, sent_at: float
    ) -> ClaimAnswer:
        params = {
            "ns": self.namespace,
            "instance": instance,
            "capacity": capacity,
            "takeover": TAKEOVER_S,
            "share_from": SHARE_FROM,
            "crashed": CRASHED_LOST_LOCK,
            "keys": pg_numbers([r.key for r in requests]),
            "names": pg_texts([r.name for r in requests]),
            "ticks": pg_times([r.scheduled_at for r in requests]),
            "intents": pg_texts([r.intent for r in requests]),
            "graces": pg_numbers([r.grace_s for r in requests]),
            "thresholds": pg_numbers([r.skip_threshold for r in requests]),
            "fail_thresholds": pg_numbers([r.fail_threshold for r in requests]),
        }
        ask = shares.shape_due(self._shape, sent_at)
        with self._session() as conn:
            result = conn.execute(QUERIES["claim_and_fleet" if ask else "claim"], params)
            decision, fleet = _decision(result, with_fleet=ask)
        if fleet is not None:
            live, rank, db_now = fleet
            self._shape = shares.Shape(live, rank, db_now, sent_at)
        return decision.claimed(requests)

    def held_keys(self) -> set[int]:
        with self._session() as conn:
            return {row.key for row in conn.execute(QUERIES["own_locks"], {"ns": self.namespace})}

    def release_strays(self, expected: Collection[int]) -> list[int]:
        params = {"ns": self.namespace, "expected": pg_numbers(sorted(expected))}
        with self._session() as conn:
            return [row.key for row in conn.execute(QUERIES["release_strays"], params)]

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
            "retry_in": pg_numbers([r.retry_in_s for r in requests]),
        }
        with self._session() as conn:
            rows: list[Finished] = named(conn.execute(QUERIES["finish"], params), Finished)
        return [row.result() for row in rows]

    def recheck(self, runs: Sequence[Recheck]) -> list[Outcome]:
        params = {
            "ns": self.namespace,
            "keys": pg_numbers([r.key for r in runs]),
            "ticks": pg_times([r.scheduled_at for r in runs]),
            "run_ids": pg_numbers([r.run_id for r in runs]),
            "give_back": pg_bools([r.give_back for r in runs]),
            "kinds": pg_texts([r.kind for r in runs]),
        }
        with self._session() as conn:
            said = conn.execute(QUERIES["recheck"], params).scalar_one()
        return [Outcome(outcome) for outcome in said]

    def heartbeat(self, expected: Collection[int] | None = None) -> list[int]:
        """Also looks for run-now requests (one a notification missed is taken in time)
        and for the next retry, and keeps the lock invariant: one round trip in all.

        And asks whether its node still takes writes: an old primary its operator
        fenced by making it read-only (or restarted as a standby) loses the
        session here, even in a quiet spell with no claim whose write would fail.
        """
        wanted = None if expected is None else pg_numbers(sorted(expected))
        with self._session() as conn:
            params = {"ns": self.namespace, "expected": wanted}
            beat = conn.execute(QUERIES["heartbeat"], params).one()
            if beat.read_only:
                driver = conn.connection.driver_connection
                where = node_of(driver) if isinstance(driver, psycopg.Connection) else "the node"
                self.close()
                raise SessionLost(f"{where} no longer takes writes: it is not the primary")
        self._requests = self._requests or bool(beat.waiting)
        self._retry_in = None if beat.retry_in is None else float(beat.retry_in)
        return list(beat.released)

    def retry_due_in(self) -> float | None:
        return self._retry_in

    def claim_retries(
        self,
        instance: str,
        keys: Sequence[int],
        capacity: int,
        crashed: str,
        fail_thresholds: Sequence[int] | None = None,
    ) -> Retries:
        params = {
            "ns": self.namespace,
            "instance": instance,
            "keys": pg_numbers(keys),
            "capacity": capacity,
            "crashed": crashed,
            "fail_thresholds": pg_numbers(fail_thresholds or [3] * len(keys)),
        }
        with self._session() as conn:
            found = conn.execute(QUERIES["claim_retries"], params)
            rows: list[RetriesStarted] = named(found, RetriesStarted)
        return rows[0].retries()

    def requests_pending(self) -> bool:
        return self._requests

    def take_requests(self, instance: str, keys: Sequence[int]) -> list[RunRequest]:
        self._requests = False
        with self._session() as conn:
            taken = take_run_requests(conn, instance, list(keys), func.now())
        self._requests = len(taken) >= RUN_NOW_TAKE_AT_ONCE  # more may wait
        return taken

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
        held = {row.key for row in conn.execute(QUERIES["held_locks"], {"ns": self.namespace})}
        return {key for key in keys if key not in held}

    def live_instances(self, conn: Connection) -> list[dict[str, Any]]:
        """Replicas whose lock session is up: they hold (lock_namespace, 0) in share mode."""
        rows = conn.execute(QUERIES["live_instances"], {"ns": self.namespace})
        return [dict(row._mapping) for row in rows]

    def lock_holders(self, conn: Connection) -> dict[int, str]:
        """Job key -> the instance whose session holds its lock right now."""
        rows = conn.execute(QUERIES["lock_holders"], {"ns": self.namespace})
        return {int(row.key): row.name for row in rows}

    def count_crashes(self, conn: Connection, crashes: Mapping[int, Crashes]) -> dict[int, int]:
        """scheduler_count_crashes in postgres.sql, the claim's own step."""
        keys = sorted(crashes)
        found = [crashes[key] for key in keys]
        params = {
            "instance": self.instance,
            "keys": pg_numbers(keys),
            "names": pg_texts([c.name for c in found]),
            "counts": pg_numbers([c.count for c in found]),
            "ticks": pg_times([c.newest for c in found]),
            "thresholds": pg_numbers([c.fail_threshold for c in found]),
        }
        rows = conn.execute(QUERIES["count_crashes"], params)
        return {row.key: row.notice for row in rows if row.notice is not None}
