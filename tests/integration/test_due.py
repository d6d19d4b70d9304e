"""Ticks are judged by the schedule in force at them, on both backends: the sweep,
catch-up (`all` and `latest`), a reload, and the registrations that remember."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import inspect

from scheduler.config.settings import JobConfig, Settings
from scheduler.fleet.catch_up import CatchUp, submit_latest
from scheduler.fleet.housekeeping import Housekeeping
from scheduler.ledger import registrations, tables
from scheduler.ledger.history import TickFilter, TickRow, history
from scheduler.ledger.job_states import job_states, track_jobs
from scheduler.ledger.registrations import reassert, registrations_of, supersede
from scheduler.ledger.retention import prune_registrations
from scheduler.registry.catalog import Catalog, CatalogJob, schedule_text
from tests.support import make_job

KEY, NAME = 671, "judged"


def every(seconds: int, **policy) -> CatalogJob:
    base = make_job(KEY, lambda ctx: None, name=NAME)
    return replace(base, schedule=JobConfig(interval=f"{seconds}s", **policy))


def on_grid(tick: datetime, seconds: int) -> bool:
    return tick.timestamp() % seconds == 0


def register(backend, job: CatalogJob, at: datetime, live: set[str] = frozenset()) -> None:
    """Replica r1 starts (or reloads) with `job` at `at`, as Housekeeping registers."""
    with backend.ledger_engine.begin() as conn:
        registrations.register(conn, "r1", [(KEY, NAME, schedule_text(job))], set(live), at)
        supersede(conn, {*live, "r1"}, at)


def ran(backend, ticks: list[datetime]) -> None:
    base = {"job_key": KEY, "job_name": NAME, "status": "succeeded", "instance": "r1"}
    with backend.ledger_engine.begin() as conn:
        conn.execute(tables.ticks.insert(), [{**base, "scheduled_at": t} for t in ticks])


def rows(backend) -> dict[datetime, TickRow]:
    with backend.ledger_engine.connect() as conn:
        found = history(conn, TickFilter(KEY, limit=10_000))
    return {r.scheduled_at: r for r in found}


def grid(seconds: int, after: datetime, until: datetime) -> list[datetime]:
    first = int(after.timestamp()) // seconds * seconds + seconds
    return [
        datetime.fromtimestamp(t, UTC)
        for t in range(first, int(until.timestamp()) + 1, seconds)
        if datetime.fromtimestamp(t, UTC) <= until
    ]


@pytest.fixture
def backend(backends):
    return backends("h", connect=False)


def test_a_fleet_down_then_back_with_another_schedule_then_reloaded_is_judged_tick_by_tick(
    backend,
):
    """7 s until the fleet went down; back 52 s later with 10 s; reloaded to 5 s."""
    now = datetime.now(UTC).replace(microsecond=0)
    start = now - timedelta(minutes=4)
    down = now - timedelta(seconds=150)
    back = down + timedelta(seconds=52, milliseconds=500)  # changes fall between ticks
    reloaded = back + timedelta(seconds=40)
    track_jobs(backend.ledger_engine, [(KEY, NAME, "every 7s")], start)
    register(backend, every(7), start)
    ran(backend, grid(7, start, down))
    register(backend, every(10), back)  # the same replica restarts with another config
    ran(backend, grid(10, back + timedelta(seconds=1), reloaded))
    register(backend, every(5), reloaded, live={"r1"})  # a reload: r1 is live
    keeper = Housekeeping(backend, Catalog((every(5),)), Settings(instance_name="r1"))
    with backend.ledger_engine.begin() as conn:
        keeper.sweep_missed(conn, job_states(conn), start, now)
    found = rows(backend)
    cutoff = now - every(5).misfire_grace - timedelta(seconds=5)
    # No row for a tick that no schedule in force at it contained ...
    for tick in found:
        in_force = 7 if tick <= back else 10 if tick <= reloaded else 5
        assert on_grid(tick, in_force), (tick, in_force)
    # ... and a row for every tick that one did: the ledger explains the downtime.
    due = [*grid(7, start, back), *grid(10, back, reloaded), *grid(5, reloaded, cutoff)]
    assert [t for t in due if t not in found and t > start] == []
    assert {found[t].status for t in grid(7, down, back)} == {"missed"}


def test_catch_up_after_a_restart_with_a_new_schedule_runs_only_ticks_of_the_old_one(backend):
    """5 s for 35 s; stopped; back 2 s later every 7 s: the gap is the 5 s schedule's."""
    job = every(7, catch_up="all", catch_up_window="1m", catch_up_limit=10)
    now = datetime.now(UTC)
    start = now - timedelta(seconds=40)
    stopped = now - timedelta(seconds=3)  # the 5 s ticks of the gap were never run ...
    back = now - timedelta(seconds=1)
    track_jobs(backend.ledger_engine, [(KEY, NAME, "every 5s")], start)
    register(backend, every(5), start)
    ran(backend, grid(5, start, stopped))
    register(backend, job, back)
    catching_up = CatchUp(None, backend, lambda: Catalog((job,)), instance="r1")  # type: ignore[arg-type]
    to_run, missed = catching_up._plan(job)
    before = [t for t in to_run if t < back]
    assert before == grid(5, stopped, back) and missed == []  # ... and nothing else is
    assert all(on_grid(t, 7) for t in to_run if t > back)  # no live replica fired those


def test_catch_up_latest_takes_the_latest_tick_of_the_schedule_in_force(backend):
    class Gate:
        def __init__(self) -> None:
            self.submitted: list[datetime] = []

        def submit(self, job, tick):
            self.submitted.append(tick)

    job = every(7, catch_up="latest")
    now = datetime.now(UTC).replace(microsecond=0)
    back = now - timedelta(seconds=1, milliseconds=500)
    track_jobs(backend.ledger_engine, [(KEY, NAME, "every 5s")], now - timedelta(hours=1))
    register(backend, every(5), now - timedelta(hours=1))
    register(backend, job, back)
    gate = Gate()
    submit_latest(Catalog((job,)), gate, backend.ledger_engine, now)  # type: ignore[arg-type]
    expected = [t for t in grid(5, now - timedelta(seconds=30), back)][-1:]
    newer = grid(7, back - timedelta(microseconds=1), now)
    assert gate.submitted == (newer[-1:] or expected)


def test_a_reload_ends_the_old_schedule_and_keeps_it_where_only_retention_removes_it(backend):
    keeper = Housekeeping(backend, Catalog((every(5),)), Settings(instance_name="r1"))
    keeper.track_jobs()
    at = keeper.reregister(Catalog((every(7),)))
    with backend.ledger_engine.begin() as conn:
        entries = [(KEY, NAME, schedule_text(every(7)))]
        assert reassert(conn, "r1", entries, at) == 0  # the old one stays ended
        supersede(conn, set(), at + timedelta(hours=1))  # r1 gone: no live one runs
        found = sorted(registrations_of(conn, [KEY]), key=lambda r: r.since)
    assert [(r.schedule, r.until) for r in found] == [
        (schedule_text(every(5)), at),
        (schedule_text(every(7)), None),
    ]
    assert found[1].since == at
    with backend.ledger_engine.begin() as conn:
        prune_registrations(conn, at + timedelta(seconds=1))
        assert [r.schedule for r in registrations_of(conn, [KEY])] == [schedule_text(every(7))]


def test_a_replica_superseded_while_it_started_gets_its_newest_schedule_back(backend):
    now = datetime.now(UTC)
    register(backend, every(5), now - timedelta(minutes=2))
    register(backend, every(7), now - timedelta(minutes=1), live={"r1"})
    with backend.ledger_engine.begin() as conn:  # another replica took r1 for gone
        supersede(conn, {"r2"}, now)
        conn.execute(
            tables.registrations.update()
            .where(tables.registrations.c.until.is_(None))
            .values(until=now)
        )
        assert reassert(conn, "r1", [(KEY, NAME, schedule_text(every(7)))], now) == 1
        found = {r.schedule: r.until for r in registrations_of(conn, [KEY])}
    assert found == {
        schedule_text(every(5)): now - timedelta(minutes=1),
        schedule_text(every(7)): None,
    }


def test_a_version_6_ledger_keeps_its_registrations_and_gains_their_history(backends):
    from scheduler.backends.schema import CURRENT_VERSION

    a = backends("a", connect=False)
    since = datetime.now(UTC).replace(microsecond=0)
    kind = "TIMESTAMP WITH TIME ZONE" if backends.kind == "postgresql" else "DATETIME"
    with a.ledger_engine.begin() as conn:
        conn.exec_driver_sql("DROP TABLE scheduler_registrations")
        conn.exec_driver_sql("DROP TABLE IF EXISTS scheduler_seen")
        conn.exec_driver_sql(
            "CREATE TABLE scheduler_registrations (instance TEXT NOT NULL,"
            " job_key INTEGER NOT NULL, job_name TEXT NOT NULL, schedule TEXT,"
            f" since {kind} NOT NULL, until {kind}, PRIMARY KEY (instance, job_key))"
        )
    register(a, every(5), since)
    with a.ledger_engine.begin() as conn:
        conn.exec_driver_sql("DELETE FROM scheduler_schema")
        conn.exec_driver_sql(
            "INSERT INTO scheduler_schema (version, applied_at) VALUES (6, CURRENT_TIMESTAMP)"
        )
    assert a.migrate() == 6
    assert a.migrate() == CURRENT_VERSION
    with a.ledger_engine.connect() as conn:
        key = inspect(conn).get_pk_constraint("scheduler_registrations")["constrained_columns"]
        assert [(r.instance, r.since) for r in registrations_of(conn)] == [("r1", since)]
    assert key == ["instance", "job_key", "since"]
    register(a, every(7), since + timedelta(seconds=1))  # a change now keeps the old one
    with a.ledger_engine.connect() as conn:
        assert len(registrations_of(conn)) == 2


def test_replicas_starting_together_with_one_schedule_each_keep_it_registered(backends):
    """Each registers while the others are not live yet, so each takes the others' rows
    over as a gone replica's; its first housekeeping pass puts its own back."""
    from scheduler.fleet.status import fleet_status

    job = every(5)
    replicas = [backends(name, connect=False) for name in ("p1", "p2", "p3")]
    keepers = [
        Housekeeping(b, Catalog((job,)), Settings(instance_name=b.instance)) for b in replicas
    ]
    for keeper in keepers:
        keeper.track_jobs()
    for replica in replicas:
        replica.connect()
    for keeper in keepers:
        keeper.run_once()
    shown = fleet_status(replicas[0], Catalog((job,)), datetime.now(UTC))["jobs"][0]["schedules"]
    assert [v["instances"] for v in shown] == [["p1", "p2", "p3"]]


def test_a_replica_gets_back_many_schedules_at_once_some_reopened_some_new(backend):
    """The rows a pass puts back, in two statements: its newest row reopened where the
    schedule is the same, and a row from now where it is gone; jobs in force untouched."""
    now = datetime.now(UTC).replace(microsecond=0)
    keys = range(2000, 2300)
    five, seven = schedule_text(every(5)), schedule_text(every(7))
    with backend.ledger_engine.begin() as conn:
        registrations.register(conn, "r1", [(k, f"j{k}", five) for k in keys], set(), now)
        c = tables.registrations.c
        ended = now + timedelta(seconds=1)
        conn.execute(tables.registrations.update().where(c.job_key < 2100).values(until=ended))
        conn.execute(tables.registrations.delete().where(c.job_key >= 2200))
        wanted = [(k, f"j{k}", five if k < 2100 else seven) for k in keys]
        assert reassert(conn, "r1", wanted, now + timedelta(seconds=2)) == 200
        assert reassert(conn, "r1", wanted, now + timedelta(seconds=3)) == 0
        found = registrations_of(conn, list(keys))
    assert {(r.key, r.schedule, r.until) for r in found} == {
        (k, five if k < 2200 else seven, None) for k in keys
    }
    assert {r.since for r in found if r.key < 2200} == {now}
    assert {r.since for r in found if r.key >= 2200} == {now + timedelta(seconds=2)}
