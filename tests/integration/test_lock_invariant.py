"""The lock invariant: a replica holds a job's lock only while it has a run of that job here.

Every path that takes a lock (a scheduled claim, a run-now, a caught-up tick, a
retry) is made to fail at each statement it writes with, and once after its
commit with the reply lost; right after the failed step no lock may be held
that no run here holds. On PostgreSQL the failures come from a trigger on
each ledger table (a row lock held from outside fails the same way, with a
lock timeout); on the embedded backend from each step of the claim.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from sqlalchemy import event, update

from scheduler.backends.base import Intent
from scheduler.backends.embedded import EmbeddedBackend
from scheduler.backends.embedded_steps import Steps
from scheduler.backends.postgres import PostgresBackend
from scheduler.gate import Gate
from scheduler.ledger import tables
from scheduler.observers import events
from tests.support import FakeMonotonic, JobsDesk, Recorder, make_job, now_tick, settle, wait_for

NAMESPACE = 4545
TABLES = ("scheduler_ticks", "scheduler_attempts", "scheduler_jobs", "scheduler_notices")

FAIL_TRIGGER = """
CREATE OR REPLACE FUNCTION test_fail_here() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('test.fail_on', true) = TG_TABLE_NAME || ':' || TG_OP THEN
        RAISE EXCEPTION 'injected failure on %', TG_TABLE_NAME || ':' || TG_OP
              USING ERRCODE = '55P03';  -- lock_not_available, as a row lock held elsewhere
    END IF;
    RETURN NEW;
END $$;
"""

# Every statement a claim path writes with, by table and operation.
PG_POINTS = [f"{table}:{op}" for table in TABLES for op in ("INSERT", "UPDATE")]
EMBEDDED_POINTS = [
    "choose",
    "lock_manual",
    "insert_ticks",
    "take_locks",
    "record_skips",
    "crash_stale",
    "skip_streaks",
    "claim_retries",
]
REPLY_LOST = "reply lost"
MINUTE = timedelta(seconds=60)


@dataclass
class Replica:
    gate: Gate
    backend: PostgresBackend | EmbeddedBackend
    seen: Recorder
    clock: FakeMonotonic
    fail: Callable[[str | None], None]  # inject at a point (None: stop injecting)
    raised: list[BaseException]  # what the backend's claim calls raised, in order

    def held(self) -> set[int]:
        """The job locks its session holds, read from outside the gate."""
        backend = self.backend
        if isinstance(backend, EmbeddedBackend):
            return set(backend.locks._held)
        assert backend._conn is not None
        pid = backend._conn.connection.driver_connection.info.backend_pid
        with psycopg.connect(backend.url, autocommit=True) as admin:
            rows = admin.execute(
                "SELECT objid::integer FROM pg_locks WHERE locktype = 'advisory'"
                " AND objsubid = 2 AND classid = %s::oid AND pid = %s AND mode = 'ExclusiveLock'"
                " AND objid <> 0",
                (NAMESPACE, pid),
            ).fetchall()
        return {key for (key,) in rows}

    def running_here(self) -> set[int]:
        return self.gate.table.running_keys()

    def assert_invariant(self, where: str) -> None:
        assert self.held() <= self.running_here(), (
            f"{where}: locks {sorted(self.held())} held with runs of {sorted(self.running_here())}"
        )


@pytest.fixture(params=["postgresql", "embedded"])
def replica(request, tmp_path) -> Iterator[Replica]:
    if request.param == "postgresql":
        url = request.getfixturevalue("database_url")
        backend: PostgresBackend | EmbeddedBackend = PostgresBackend(
            url, instance="r1", namespace=NAMESPACE, holder_timeout=30
        )
        backend.migrate()
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute(FAIL_TRIGGER)
            for table in TABLES:
                admin.execute(
                    f"CREATE OR REPLACE TRIGGER test_fail BEFORE INSERT OR UPDATE ON {table}"
                    " FOR EACH ROW EXECUTE FUNCTION test_fail_here()"
                )
    else:
        backend = EmbeddedBackend(tmp_path / "scheduler.db", instance="r1", namespace=NAMESPACE)
        backend.migrate()
    seen, clock = Recorder(), FakeMonotonic()
    gate = Gate(
        backend, instance="r1", max_workers=4, holder_timeout=30, listeners=[seen], monotonic=clock
    )
    raised: list[BaseException] = []
    for name in ("claim", "claim_retries"):
        setattr(backend, name, _spied(getattr(backend, name), raised))
    originals: list[tuple[object, str, Callable]] = []

    def fail(point: str | None) -> None:
        for target, name, method in originals:  # undo what the last call injected
            setattr(target, name, method)
        originals.clear()
        if point == REPLY_LOST:
            for name in ("claim", "claim_retries"):
                originals.append((backend, name, getattr(backend, name)))
                setattr(backend, name, _after_commit(getattr(backend, name)))
        elif isinstance(backend, PostgresBackend):
            if backend._conn is None:
                gate.step()  # connected
            assert backend._conn is not None
            setting = f"SELECT set_config('test.fail_on', '{point or ''}', false)"
            backend._conn.exec_driver_sql(setting)
        elif point is not None:
            originals.append((Steps, point, getattr(Steps, point)))
            setattr(Steps, point, _failing(point))

    replica = Replica(gate, backend, seen, clock, fail, raised)
    try:
        yield replica
    finally:
        fail(None)
        gate.table.stopping.set()
        backend.close()
        if isinstance(backend, PostgresBackend):
            backend.ledger_engine.dispose()


def _spied(call: Callable, raised: list[BaseException]) -> Callable:
    def spy(*args: object, **kwargs: object) -> object:
        try:
            return call(*args, **kwargs)
        except BaseException as exc:
            raised.append(exc)
            raise

    return spy


def _failing(point: str) -> Callable:
    def step(*args: object, **kwargs: object) -> object:
        raise RuntimeError(f"injected failure in {point}")

    return step


def _after_commit(call: Callable) -> Callable:
    def lost(*args: object, **kwargs: object) -> object:
        call(*args, **kwargs)
        raise RuntimeError("the reply was lost after the commit")

    return lost


def points(replica: Replica) -> list[str]:
    kinds = EMBEDDED_POINTS if isinstance(replica.backend, EmbeddedBackend) else PG_POINTS
    return [*kinds, REPLY_LOST]


def _stale_row(replica: Replica, key: int, name: str) -> None:
    """A running row of a replica that died, and a skip streak: every claim step writes."""
    tick = now_tick(-20)
    with replica.backend.ledger_engine.begin() as conn:
        conn.execute(
            tables.ticks.insert().values(
                job_key=key, scheduled_at=tick, job_name=name, status="running",
                instance="dead", run_id=1, started_at=tick,
            )
        )  # fmt: skip
        streak = update(tables.jobs).where(tables.jobs.c.job_key == key)
        if not conn.execute(streak.values(consecutive_skips=2)).rowcount:
            conn.execute(
                tables.jobs.insert().values(
                    job_key=key, job_name=name, tracked_since=tick, consecutive_skips=2
                )
            )


@contextlib.contextmanager
def busy_job(replica: Replica) -> Iterator[None]:
    """A run of job 900 goes on meanwhile: its lock must survive every give-back."""
    release = threading.Event()
    job = make_job(900, lambda ctx: release.wait(300), name="busy")
    replica.gate.submit(job, now_tick(-1))
    settle(replica.gate, lambda: 900 in replica.gate.table.running_keys(), "the busy run to start")
    try:
        yield
        assert 900 in replica.held()
    finally:
        release.set()


def _drive(replica: Replica, until: Callable[[], object], what: str) -> None:
    def stepped() -> object:
        replica.clock.now += 1.0  # failed claims are tried again after a growing delay
        replica.gate.step()
        return until()

    wait_for(stepped, 30, what, every=0.02)


def _said_failed(replica: Replica, caplog: pytest.LogCaptureFixture, what: str) -> None:
    """A claim call of any intent that failed is logged (WARNING or worse)."""
    failed, said = (
        list(replica.raised),
        [
            r.getMessage()
            for r in caplog.records
            if r.name.startswith("scheduler.gate") and r.levelno >= logging.WARNING
        ],
    )
    replica.raised.clear()
    caplog.clear()
    if failed:
        assert any("failed" in line for line in said), f"{what}: {failed[0]!r} not logged: {said}"


def test_a_failed_scheduled_claim_leaves_no_lock(replica, caplog):
    with busy_job(replica):
        for i, point in enumerate(points(replica)):
            _scheduled_claim_failing(replica, 910 + i, point, caplog)


def _scheduled_claim_failing(
    replica: Replica, key: int, point: str, caplog: pytest.LogCaptureFixture
) -> None:
    job = make_job(key, lambda ctx: None, name=f"run{key}")
    _stale_row(replica, key, job.name)
    replica.fail(point)
    replica.gate.submit(job, now_tick())
    _said_failed(replica, caplog, "before")
    replica.gate.step()
    replica.assert_invariant(f"scheduled claim failing at {point}")
    _said_failed(replica, caplog, f"scheduled claim failing at {point}")
    replica.fail(None)
    settled = lambda: key not in replica.gate.table.running_keys() and not replica.gate.queue  # noqa: E731
    _drive(replica, settled, f"the claim of {job.name} to settle")
    replica.assert_invariant(f"after the claim failing at {point} was tried again")


def test_a_failed_run_now_or_catch_up_claim_leaves_no_lock(replica, caplog):
    with busy_job(replica):
        for intent in (Intent.MANUAL, Intent.CATCH_UP):
            for i, point in enumerate(points(replica)):
                key = 1000 + 100 * (intent is Intent.CATCH_UP) + i
                _manual_claim_failing(replica, key, intent, point, caplog)


def _manual_claim_failing(
    replica: Replica, key: int, intent: Intent, point: str, caplog: pytest.LogCaptureFixture
) -> None:
    job = make_job(key, lambda ctx: None, name=f"{intent}{key}")
    _stale_row(replica, key, job.name)
    replica.fail(point)
    gate = replica.gate
    if intent is Intent.CATCH_UP:
        asked = threading.Thread(target=gate.catch_up, args=(job, now_tick(-5)), daemon=True)
    else:
        asked = threading.Thread(target=gate.trigger, args=(job, 20), daemon=True)
    asked.start()
    wait_for(lambda: gate.manual.pending(), 10, "the request to be queued")
    _said_failed(replica, caplog, "before")
    gate.step()
    replica.assert_invariant(f"{intent} claim failing at {point}")
    _said_failed(replica, caplog, f"{intent} claim failing at {point}")
    replica.fail(None)
    _drive(replica, lambda: not asked.is_alive(), f"the {intent} to answer")
    replica.assert_invariant(f"after the {intent} claim failing at {point}")


def test_a_failed_retry_claim_leaves_no_lock(replica, caplog):
    with busy_job(replica):
        for i, point in enumerate(points(replica)):
            _retry_claim_failing(replica, 1300 + i, point, caplog)


def _retry_claim_failing(
    replica: Replica, key: int, point: str, caplog: pytest.LogCaptureFixture
) -> None:
    attempts: list[int] = []

    def flaky(ctx) -> None:
        attempts.append(ctx.attempt)
        if ctx.attempt == 1:
            raise RuntimeError("first attempt fails")

    job = replace(make_job(key, flaky, name=f"retry{key}"), retries=1, retry_delay=MINUTE)
    gate = replica.gate
    gate.desk = JobsDesk(job)
    gate.submit(job, now_tick())

    def failed() -> bool:
        return (
            attempts == [1]
            and key not in gate.table.running_keys()
            and _retry_pending(replica, key)
        )

    _drive(replica, failed, "the first attempt to fail")
    _stale_row(replica, key, job.name)
    _retry_due_now(replica, key)
    replica.fail(point)
    gate.retries.due_in(0)
    _said_failed(replica, caplog, "before")
    gate.step()
    replica.assert_invariant(f"retry claim failing at {point}")
    _said_failed(replica, caplog, f"retry claim failing at {point}")
    replica.fail(None)

    def taken() -> bool:
        if point == REPLY_LOST:  # the attempt was started, but this replica never knew
            return not _retry_pending(replica, key)
        return attempts == [1, 2] and key not in gate.table.running_keys()

    _drive(replica, taken, "the retry to be taken")
    replica.assert_invariant(f"after the retry claim failing at {point}")


def test_the_heartbeat_releases_a_stray_lock_and_says_so(replica):
    """Whatever left it, a lock with no run here is released at the next heartbeat."""
    with busy_job(replica):
        backend = replica.backend
        if isinstance(backend, EmbeddedBackend):
            assert backend.locks.try_lock(77)
            assert not backend.locks.try_lock(77)  # file locks never stack
        else:
            assert backend._conn is not None
            for _ in range(3):  # advisory locks stack: three takes, three releases
                backend._conn.exec_driver_sql(f"SELECT pg_advisory_lock({NAMESPACE}, 77)")
        assert 77 in replica.held()
        replica.clock.now += replica.gate.session.heartbeat_every + 1
        replica.gate.step()
        assert replica.held() == {900}
        (released,) = replica.seen.of(events.LocksReleased)
        assert released.jobs == ((77, None),) and released.after is None


def test_the_heartbeat_keeps_the_invariant_in_its_own_round_trip(replica):
    """One statement proves the session alive and gives strays back (none with `None`,
    as at shutdown, where abandoned runs keep their locks)."""
    backend = replica.backend
    replica.gate.step()  # the lock session up
    statements: list[str] = []
    if isinstance(backend, EmbeddedBackend):
        assert backend.locks.try_lock(77)
    else:
        assert backend._conn is not None
        backend._conn.exec_driver_sql(f"SELECT pg_advisory_lock({NAMESPACE}, 77)")
        event.listen(backend.engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
    assert backend.heartbeat(None) == []
    assert 77 in replica.held()
    assert backend.heartbeat({5}) == [77]
    assert 77 not in replica.held()
    assert backend.heartbeat({5}) == []
    if isinstance(backend, PostgresBackend):
        assert len(statements) == 3, statements


def _retry_pending(replica: Replica, key: int) -> bool:
    with replica.backend.ledger_engine.connect() as conn:
        rows = conn.execute(
            tables.ticks.select().where(
                tables.ticks.c.job_key == key, tables.ticks.c.retry_at.is_not(None)
            )
        ).all()
    return bool(rows)


def _retry_due_now(replica: Replica, key: int) -> None:
    past = datetime.now(UTC) - timedelta(seconds=1)
    with replica.backend.ledger_engine.begin() as conn:
        conn.execute(
            update(tables.ticks)
            .where(tables.ticks.c.job_key == key, tables.ticks.c.retry_at.is_not(None))
            .values(retry_at=past)
        )
