"""Fleet chores: one replica at a time; stale runs, missed ticks, retention; indexes."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from itertools import pairwise

import psycopg
import pytest
from sqlalchemy import select

from scheduler.backends.base import ClaimRequest, Intent, Outcome
from scheduler.backends.postgres import PostgresBackend
from scheduler.config.settings import Settings
from scheduler.fleet.housekeeping import MISSED_MARGIN, Housekeeping
from scheduler.ledger import tables
from scheduler.ledger.history import TickFilter, history
from scheduler.ledger.job_states import job_states, track_jobs
from scheduler.ledger.outbox import add_notice
from scheduler.ledger.registrations import (
    names_in_force,
    register,
    registrations_of,
    supersede,
)
from scheduler.ledger.retention import prune_batch
from scheduler.observers.notices import Notices
from scheduler.registry.catalog import Catalog, schedule_text
from tests.support import make_job, wait_for

NAMESPACE = 4242  # as the `backends` fixture


@pytest.fixture
def backend_factory(backends):
    return lambda instance: backends(instance, connect=False)


def sweep_missed(keeper: Housekeeping, previous: datetime, now: datetime) -> int:
    with keeper.backend.ledger_engine.begin() as conn:
        return keeper.sweep_missed(conn, job_states(conn), previous, now)


def settings(**values) -> Settings:
    return Settings(instance_name="hk", **values)


def track(backend, job, since: datetime, instance: str = "hk") -> None:
    """The job as a replica starts it at `since`: its state row and its schedule in force."""
    track_jobs(backend.ledger_engine, [(job.key, job.name, job.describe())], since)
    with backend.ledger_engine.begin() as conn:
        register(conn, instance, [(job.key, job.name, schedule_text(job))], set(), since)


def test_one_replica_at_a_time_does_the_chores(backend_factory):
    job = make_job(601, lambda ctx: None, name="chore")
    keepers = [
        Housekeeping(backend_factory(f"h{i}"), Catalog((job,)), settings()) for i in range(3)
    ]
    done = [keeper.run_once() for keeper in keepers]
    assert sum("crashed" in d for d in done) == 1
    assert sum("pruned" in d for d in done) == 1
    assert [keeper.run_once() for keeper in keepers] == [{}, {}, {}]  # not due again yet


def test_a_running_row_whose_lock_is_free_is_marked_crashed(backend_factory):
    job = make_job(611, lambda ctx: None, name="orphan")
    dead, alive = backend_factory("dead"), backend_factory("alive")
    dead.connect()
    alive.connect()
    tick = datetime.now(UTC).replace(microsecond=0)
    request = ClaimRequest(
        key=611, name="orphan", scheduled_at=tick, intent=Intent.RUN, grace_s=30, skip_threshold=3
    )
    assert dead.claim([request], "dead", capacity=1).every()[0].outcome is Outcome.RUN
    keeper = Housekeeping(alive, Catalog((job,)), settings())
    with alive.ledger_engine.begin() as conn:
        assert keeper.sweep_crashed(conn, datetime.now(UTC), {"alive"}) == []  # lock still held
    dead.close()  # the replica dies; its next tick is hours away

    def swept() -> bool:  # the server ends the session a moment after the client goes
        with alive.ledger_engine.begin() as conn:
            return len(keeper.sweep_crashed(conn, datetime.now(UTC), {"alive"})) == 1

    wait_for(swept, 10, "the sweep to find the dead replica's run")
    with alive.ledger_engine.connect() as conn:
        assert history(conn, TickFilter(key=611, limit=1))[0].status == "crashed"


def test_a_sweep_spares_this_replicas_own_run_still_going_after_its_session_was_lost(
    backend_factory,
):
    """Its finish records how it ended (told its lock was lost, it may stop: interrupted).
    Once it is not here any more, the sweep finds it crashed, as other replicas' would."""
    job = make_job(612, lambda ctx: None, name="told")
    lost, again, other = backend_factory("hk"), backend_factory("hk"), backend_factory("other")
    lost.connect()
    tick = datetime.now(UTC).replace(microsecond=0)
    request = ClaimRequest(
        key=612, name="told", scheduled_at=tick, intent=Intent.RUN, grace_s=30, skip_threshold=3
    )
    (won,) = lost.claim([request], "hk", capacity=1).every()
    assert won.outcome is Outcome.RUN
    lost.close()  # the session is lost; the replica ("hk") reconnects, its run goes on
    again.connect()
    going = {won.run_id}
    mine = Housekeeping(again, Catalog((job,)), settings(), going_here=lambda: going)

    def free() -> bool:  # the server ends the session a moment after the client goes
        with again.ledger_engine.connect() as conn:
            return bool(again.free_locks(conn, [612]))

    wait_for(free, 10, "the lost session's lock to go")
    with again.ledger_engine.begin() as conn:
        assert mine.sweep_crashed(conn, datetime.now(UTC), {"hk", "other"}) == []
    going.clear()  # recorded, or ended without a finish: the run is not here any more
    with again.ledger_engine.begin() as conn:
        assert len(mine.sweep_crashed(conn, datetime.now(UTC), {"hk", "other"})) == 1
    with other.ledger_engine.connect() as conn:
        assert history(conn, TickFilter(key=612, limit=1))[0].status == "crashed"


def test_ticks_nobody_claimed_in_time_are_recorded_missed(backend_factory):
    job = make_job(621, lambda ctx: None, name="lonely")  # 1 s interval, 30 s grace
    backend = backend_factory("h")
    keeper = Housekeeping(backend, Catalog((job,)), settings())
    now = datetime.now(UTC).replace(microsecond=0)
    track(backend, job, now - timedelta(minutes=10))
    cutoff = now - job.misfire_grace - MISSED_MARGIN
    ran = cutoff - timedelta(seconds=5)
    with backend.ledger_engine.begin() as conn:
        conn.execute(
            tables.ticks.insert().values(
                job_key=621, scheduled_at=ran, job_name="lonely", status="succeeded"
            )
        )
    recorded = sweep_missed(keeper, now - timedelta(seconds=40), now)
    with backend.ledger_engine.connect() as conn:
        rows = history(conn, TickFilter(621, limit=1000))
    missed = [r.scheduled_at for r in rows if r.status == "missed"]
    assert recorded == len(missed) > 0
    assert ran not in missed  # a tick that has a row keeps it
    assert max(missed) <= cutoff  # a tick still within its grace may yet be claimed
    assert sweep_missed(keeper, now - timedelta(seconds=40), now) == 0  # idempotent


def test_missed_ticks_are_bounded_per_job(backend_factory):
    job = make_job(631, lambda ctx: None, name="long_gone")
    backend = backend_factory("h")
    keeper = Housekeeping(backend, Catalog((job,)), settings())
    now = datetime.now(UTC)
    track(backend, job, now - timedelta(days=3))
    assert sweep_missed(keeper, now - timedelta(days=3), now) == 100


def test_retention_prunes_old_finished_rows_only(backend_factory):
    backend = backend_factory("h")
    now = datetime.now(UTC)
    old, fresh = now - timedelta(days=2), now - timedelta(hours=1)
    with backend.ledger_engine.begin() as conn:
        for i in range(30):
            conn.execute(
                tables.ticks.insert().values(
                    job_key=641,
                    scheduled_at=old - timedelta(seconds=i),
                    job_name="j",
                    status="succeeded",
                )
            )
        conn.execute(
            tables.ticks.insert().values(
                job_key=641,
                scheduled_at=old + timedelta(seconds=1),
                job_name="j",
                status="running",
                run_id=1,
            )
        )
        conn.execute(
            tables.ticks.insert().values(
                job_key=641, scheduled_at=fresh, job_name="j", status="succeeded"
            )
        )
    pruned = []
    while True:
        with backend.ledger_engine.begin() as conn:
            pruned.append(prune_batch(conn, now - timedelta(days=1), batch=7))
        if not pruned[-1]:
            break
    assert sum(pruned) == 30 and len(pruned) > 2  # in several bounded batches
    with backend.ledger_engine.connect() as conn:
        left = {r.status for r in history(conn, TickFilter(641, limit=100))}
    assert left == {"running", "succeeded"}  # a run still going is never pruned


def test_the_elected_replica_prunes(backend_factory):
    backend = backend_factory("h")
    old = datetime.now(UTC) - timedelta(days=3)
    with backend.ledger_engine.begin() as conn:
        conn.execute(
            tables.ticks.insert().values(
                job_key=651, scheduled_at=old, job_name="j", status="succeeded"
            )
        )
    keeper = Housekeeping(backend, Catalog(()), settings(retention_days=1))
    assert keeper.run_once()["pruned"] == 1


def test_indexes_serve_the_claim_history_and_prune_with_millions_of_rows(database_url):
    backend = PostgresBackend(database_url, instance="ix", namespace=NAMESPACE, holder_timeout=30)
    backend.migrate()
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO scheduler_ticks (job_key, scheduled_at, job_name, status, run_id)"
            " SELECT k, now() - make_interval(secs => s), 'job' || k, 'succeeded', s * 500 + k"
            " FROM generate_series(1, 500) k, generate_series(1, 2000) s"
        )
        conn.execute("ANALYZE scheduler_ticks")
        assert conn.execute("SELECT count(*) FROM scheduler_ticks").fetchone()[0] == 1_000_000
        plans = {
            "history of one job": "SELECT * FROM scheduler_ticks WHERE job_key = 7"
            " ORDER BY scheduled_at DESC LIMIT 50",
            "history of all jobs": "SELECT * FROM scheduler_ticks"
            " ORDER BY scheduled_at DESC, job_key LIMIT 50",
            "running runs": "SELECT * FROM scheduler_ticks WHERE status = 'running'",
            "claim conflict": "SELECT 1 FROM scheduler_ticks WHERE job_key = 7"
            " AND scheduled_at = now()",
            "prune batch": "SELECT scheduled_at FROM scheduler_ticks"
            " WHERE scheduled_at < now() - interval '1 hour' ORDER BY scheduled_at"
            " OFFSET 4999 LIMIT 1",
        }
        for name, query in plans.items():
            plan = "\n".join(r[0] for r in conn.execute("EXPLAIN " + query))
            assert "Seq Scan" not in plan, f"{name} scans the table:\n{plan}"
    backend.connect()
    tick = datetime.now(UTC).replace(microsecond=0)
    requests = [
        ClaimRequest(
            key=k,
            name=f"job{k}",
            scheduled_at=tick,
            intent=Intent.RUN,
            grace_s=30,
            skip_threshold=3,
        )
        for k in range(1, 501)
    ]
    assert {r.outcome for r in backend.claim(requests, "ix", capacity=500).every()} == {Outcome.RUN}
    backend.close()


def job_every(key: int, seconds: int, name: str):
    """A catalog job on a grid of `seconds` (make_job's jobs tick every second)."""
    from dataclasses import replace

    from scheduler.config.settings import JobConfig

    base = make_job(key, lambda ctx: None, name=name)
    return replace(base, schedule=JobConfig(interval=f"{seconds}s"))


def test_replicas_that_differ_never_have_one_schedule_recorded_missed_for_the_other(
    backend_factory,
):
    """A rolling deploy: r-old runs the job every 2 s, r-new every 3 s, both live."""
    old, new = job_every(641, 2, "deploying"), job_every(641, 3, "deploying")
    backend = backend_factory("h")
    now = datetime.now(UTC).replace(microsecond=0)
    start = now - timedelta(minutes=5)
    track_jobs(backend.ledger_engine, [(641, "deploying", "every 2s")], start)
    with backend.ledger_engine.begin() as conn:
        register(conn, "r-old", [(641, "deploying", schedule_text(old))], set(), start)
        register(conn, "r-new", [(641, "deploying", schedule_text(new))], {"r-old"}, start)
    keeper = Housekeeping(backend, Catalog((new,)), Settings(instance_name="r-new"))
    sweep_missed(keeper, now - timedelta(seconds=60), now)
    with backend.ledger_engine.connect() as conn:
        missed = [r.scheduled_at for r in history(conn, TickFilter(641, limit=1000))]
    assert missed  # nobody claimed anything here: the common ticks are missed ...
    assert all(t.timestamp() % 6 == 0 for t in missed)  # ... and only those (every 6 s)


def test_a_fleet_that_comes_back_with_a_new_schedule_explains_every_old_tick(backend_factory):
    """Down for a minute with a 2 s schedule; back with a 3 s one: no unexplained gap."""
    old, new = job_every(651, 2, "changed"), job_every(651, 3, "changed")
    backend = backend_factory("h")
    now = datetime.now(UTC).replace(microsecond=0)
    down = now - timedelta(seconds=100)  # the old fleet's last replica died here
    track_jobs(backend.ledger_engine, [(651, "changed", "every 2s")], now - timedelta(hours=1))
    with backend.ledger_engine.begin() as conn:
        register(
            conn, "r-old", [(651, "changed", schedule_text(old))], set(), now - timedelta(hours=1)
        )
        back = now - timedelta(seconds=40)  # the new fleet's first replica started here
        register(conn, "r-new", [(651, "changed", schedule_text(new))], set(), back)
        supersede(conn, {"r-new"}, back)  # r-old is gone: its schedule ends
    keeper = Housekeeping(backend, Catalog((new,)), Settings(instance_name="r-new"))
    sweep_missed(keeper, down - timedelta(seconds=1), now)
    with backend.ledger_engine.connect() as conn:
        missed = sorted(r.scheduled_at for r in history(conn, TickFilter(651, limit=1000)))
    cutoff = now - new.misfire_grace - MISSED_MARGIN
    old_ticks = [t for t in missed if t < back]
    new_ticks = [t for t in missed if t > back]
    # Every tick of the old schedule from the downtime until the change is explained ...
    assert old_ticks and all(t.timestamp() % 2 == 0 for t in old_ticks)
    gaps = {b - a for a, b in pairwise(old_ticks)}
    assert gaps == {timedelta(seconds=2)} and back - old_ticks[-1] <= timedelta(seconds=2)
    # ... and the new schedule's ticks count from its start, not before.
    assert all(t.timestamp() % 3 == 0 for t in new_ticks)
    assert all(t <= cutoff for t in missed)


def test_a_replica_takes_over_the_registrations_of_gone_replicas_with_its_schedule(
    backend_factory,
):
    """Restarts (new instance names) must not grow the table: one row per live replica."""
    job = job_every(661, 2, "steady")
    backend = backend_factory("h")
    text = schedule_text(job)
    first = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=2)
    with backend.ledger_engine.begin() as conn:
        for n in range(5):  # five restarts of a one-replica fleet, each under a new name
            register(conn, f"r{n}", [(661, "steady", text)], set(), first + timedelta(minutes=n))
        rows = registrations_of(conn, [661])
    assert [(r.instance, r.since) for r in rows] == [("r4", first)]


def test_a_sweep_cut_short_after_its_election_loses_no_missed_tick(backend_factory):
    """The replica that won the sweep dies (or loses its session) before recording the
    missed ticks: the next sweep, whoever runs it, records them."""
    from sqlalchemy import update

    job = make_job(641, lambda ctx: None, name="unlucky")
    backend = backend_factory("h")
    keeper = Housekeeping(backend, Catalog((job,)), settings())
    now = datetime.now(UTC).replace(microsecond=0)
    track(backend, job, now - timedelta(minutes=2))
    with backend.ledger_engine.begin() as conn:  # the last sweeps were two minutes ago
        conn.execute(
            update(tables.maintenance)
            .where(tables.maintenance.c.task.in_(["sweep", "missed"]))
            .values(last_run_at=now - timedelta(minutes=2))
        )
    recorded = keeper.sweep_missed

    def cut_short(*args, **kwargs):
        raise ConnectionError("server closed the connection unexpectedly")

    keeper.sweep_missed = cut_short  # type: ignore[method-assign]
    with pytest.raises(ConnectionError):
        keeper.run_once()
    keeper.sweep_missed = recorded  # type: ignore[method-assign]
    with backend.ledger_engine.begin() as conn:  # the next sweep is due
        conn.execute(
            update(tables.maintenance)
            .where(tables.maintenance.c.task == "sweep")
            .values(last_run_at=now - timedelta(minutes=1))
        )
    done = keeper.run_once()
    with backend.ledger_engine.connect() as conn:
        missed = [
            r.scheduled_at
            for r in history(conn, TickFilter(641, limit=1000))
            if r.status == "missed"
        ]
    assert done["missed"] == len(missed)
    # From the last sweep before the failure (two minutes ago, less the grace and margin).
    assert min(missed) <= now - timedelta(minutes=2) + timedelta(seconds=1)


def test_a_pass_spends_one_transaction_and_one_more_per_chore_with_work(backend_factory):
    """The idle budget of housekeeping: one session and one transaction for a pass that
    wins the sweep and finds nothing to do; the missed-tick window then waits for a pass
    that has a tick to judge, which spends one transaction more and judges it whole."""
    from sqlalchemy import event, update

    quiet, busy = job_every(651, 3600, "hourly"), job_every(652, 10, "busy")
    backend = backend_factory("h")
    now = datetime.now(UTC).replace(microsecond=0)
    track(backend, quiet, now)
    began: list[object] = []
    opened: list[object] = []
    event.listen(backend.ledger_engine, "begin", began.append)
    event.listen(backend.ledger_engine, "connect", lambda *a: opened.append(a))

    def next_sweep(last_missed: datetime | None = None) -> None:
        with backend.ledger_engine.begin() as conn:
            for task, last in (("sweep", now - timedelta(minutes=1)), ("prune", now)):
                conn.execute(
                    update(tables.maintenance)
                    .where(tables.maintenance.c.task == task)
                    .values(last_run_at=last)
                )
            if last_missed is not None:
                conn.execute(
                    update(tables.maintenance)
                    .where(tables.maintenance.c.task == "missed")
                    .values(last_run_at=last_missed)
                )
        began.clear()
        opened.clear()

    next_sweep(last_missed=now - timedelta(minutes=5))
    done = Housekeeping(backend, Catalog((quiet,)), settings()).run_once()
    assert "crashed" in done and not {"missed", "requests", "pruned"} & set(done)
    assert len(began) == 1 and len(opened) <= 1  # the file's engine may keep its connection
    track(backend, busy, now - timedelta(minutes=10))
    next_sweep()
    done = Housekeeping(backend, Catalog((quiet, busy)), settings()).run_once()
    assert len(began) == 2 and len(opened) <= 1
    with backend.ledger_engine.connect() as conn:
        missed = [r.scheduled_at for r in history(conn, TickFilter(652, limit=1000))]
    assert done["missed"] == len(missed) > 0
    # The window the first pass left to grow (from five minutes back) is judged whole; had
    # that pass moved the watermark, this one would start less than a minute back.
    assert min(missed) < now - timedelta(minutes=4)


class LeaseWitness(Notices):
    """A deliverer that, for each notice handed to it, reads who holds the notice's lease on
    a session of its own, as the delivery thread does, and delivers nothing."""

    def __init__(self, engine, instance: str) -> None:
        super().__init__(engine, instance)
        self.seen: dict[int, str | None] = {}

    def schedule(self, ids, delay: float = 0.0) -> None:
        n = tables.notices
        with self.engine.connect() as conn:
            for row in conn.execute(select(n.c.id, n.c.lease_by).where(n.c.id.in_(list(ids)))):
                self.seen[row.id] = row.lease_by


def test_a_pass_hands_a_notice_to_its_deliverer_only_once_its_lease_is_committed(
    backend_factory,
):
    """The delivery reads a notice only if it sees this replica's lease: a notice handed over
    inside the transaction that adopted it was dropped, its lease then kept by nobody for
    30 s, again at every adoption that lost the race, and it was never delivered."""
    job = make_job(661, lambda ctx: None, name="told")
    backend = backend_factory("hk")
    then = datetime.now(UTC) - timedelta(minutes=2)
    with backend.ledger_engine.begin() as conn:
        unleased = add_notice(conn, "job.paused", 661, "told", {}, raised_by="cli", now=then)
        dead = add_notice(
            conn, "job.skips_exceeded", 661, "told", {}, raised_by="r9", now=then, deliverer="r9"
        )  # r9 died delivering it: its lease ran out
    witness = LeaseWitness(backend.ledger_engine, "hk")
    done = Housekeeping(backend, Catalog((job,)), settings(), notices=witness).run_once()
    assert done["notices"] == 2
    assert witness.seen == {unleased: "hk", dead: "hk"}


def test_replicas_that_register_together_keep_the_schedule_both_ran(backend_factory):
    """Two replicas restart together, and neither is live yet, so each looks gone to the
    other. Each took over the other's row and kept its own as it had read it, and both
    rows went: the ticks of the downtime were then never due. Writers take turns now."""
    job = make_job(671, lambda ctx: None, name="both")
    first, second = backend_factory("r1"), backend_factory("r2")
    entries = [(job.key, job.name, schedule_text(job))]
    then = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=10)
    for instance, other in (("r1", "r2"), ("r2", "r1")):  # both have run it since then
        with first.ledger_engine.begin() as conn:
            register(conn, instance, entries, {other}, then)
    now = then + timedelta(minutes=10)

    def restart_second() -> None:
        with second.ledger_engine.begin() as conn:
            register(conn, "r2", entries, set(), now)

    with first.ledger_engine.connect() as conn:
        assert len(registrations_of(conn, [job.key])) == 2
    restart = threading.Thread(target=restart_second)
    with first.ledger_engine.begin() as conn:
        register(conn, "r1", entries, set(), now)
        restart.start()
        restart.join(1.0)  # without turns, it has written and committed by now
    restart.join(30)
    with first.ledger_engine.connect() as conn:
        open_rows = [r for r in registrations_of(conn, [job.key]) if r.until is None]
    assert open_rows, "the fleet lost the schedule it ran"
    assert min(r.since for r in open_rows) == then


def test_a_starting_replica_reads_one_row_per_job_and_name_of_the_live_ones(backend_factory):
    """The clash check at start reads each job's names among the live replicas' schedules
    in force, one row per job and name however many replicas run it; rows ended, and rows
    of replicas not live, are not read."""
    backend = backend_factory("h")
    now = datetime.now(UTC).replace(microsecond=0)
    entries = [(key, f"job{key}", "every 1s") for key in range(700, 710)]
    with backend.ledger_engine.begin() as conn:
        for name in ("a", "b", "c"):
            register(conn, name, entries, set(), now)
        register(conn, "gone", [(700, "old_name", "every 1s")], set(), now)
        register(conn, "a", [(*entries[0][:2], "every 2s"), *entries[1:]], {"b", "c"}, now)
        found = names_in_force(conn, {"a", "b"})
    assert sorted(found) == [(key, f"job{key}", "a") for key in range(700, 710)]


def test_a_pass_never_waits_on_another_replicas_election(database_url):
    """While one replica holds the sweep's row (elected, its pass not yet committed), the
    others' passes lose the election at once instead of queueing behind it, and the one
    that commits first after it finds the chore done."""
    from sqlalchemy import text

    from scheduler.ledger.election import Chore, elect

    backends = [
        PostgresBackend(database_url, instance=f"e{i}", namespace=NAMESPACE, holder_timeout=30)
        for i in (1, 2)
    ]
    for backend in backends:
        backend.migrate()
    winner, other = (b.ledger_engine.connect() for b in backends)
    try:
        with winner.begin():
            assert elect(winner, Chore.SWEEP, backends[0].now_expression(), 30) is not None
            with other.begin():
                other.execute(text("SET LOCAL lock_timeout = '2s'"))  # waiting fails the test
                assert elect(other, Chore.SWEEP, backends[1].now_expression(), 30) is None
        with other.begin():  # after the winner's commit: done, not due again
            assert elect(other, Chore.SWEEP, backends[1].now_expression(), 30) is None
    finally:
        winner.close()
        other.close()
        for backend in backends:
            backend.ledger_engine.dispose()


def test_a_pass_that_finds_its_schedules_in_force_takes_no_table_lock(database_url):
    """Reasserting is every replica's work every pass: while a writer of registrations
    (a replica starting) holds their table, a replica whose rows are all in force goes on;
    one with a row to put back waits its turn."""
    from sqlalchemy import text

    from scheduler.ledger.registrations import reassert, take_turns

    backend = PostgresBackend(database_url, instance="r", namespace=NAMESPACE, holder_timeout=30)
    backend.migrate()
    now = datetime.now(UTC)
    mine = [(k, f"j{k}", "every 5s") for k in (701, 702)]
    with backend.ledger_engine.begin() as conn:
        register(conn, "r", mine, set(), now)
    writer, reader = backend.ledger_engine.connect(), backend.ledger_engine.connect()
    try:
        with writer.begin():
            take_turns(writer)
            with reader.begin():
                reader.execute(text("SET LOCAL lock_timeout = '2s'"))
                assert reassert(reader, "r", mine, now) == 0
            with reader.begin(), pytest.raises(Exception, match="lock timeout"):
                reader.execute(text("SET LOCAL lock_timeout = '200ms'"))
                reassert(reader, "r", [*mine, (703, "j703", "every 5s")], now)
    finally:
        writer.close()
        reader.close()
        backend.ledger_engine.dispose()
