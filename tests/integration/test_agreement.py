"""Replicas that run different schedules for a job: status shows them, the fleet is told
once when it lasts, once when it ends (both backends; docs/changing.md: Rolling deploys)."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta

from sqlalchemy import select

from scheduler.config.settings import JobConfig, Settings
from scheduler.fleet.housekeeping import SEEN_RECENTLY, Housekeeping
from scheduler.fleet.status import fleet_status, schedule_checks
from scheduler.ledger import tables
from scheduler.ledger.job_states import job_states
from scheduler.ledger.registrations import registrations_of
from scheduler.registry.catalog import Catalog
from tests.support import make_job

KEY = 88


def every(job, interval: str):
    return replace(job, schedule=JobConfig(interval=interval))


def keeper_of(backend, catalog: Catalog, grace: float = 0.0) -> Housekeeping:
    settings = Settings(instance_name=backend.instance, schedule_drift_grace=grace)
    return Housekeeping(backend, catalog, settings)


def started(*keepers: Housekeeping) -> None:
    """Each replica registers, then its lock session is up: it is live."""
    for keeper in keepers:
        keeper.track_jobs()
        keeper.backend.connect()


def drift(keeper: Housekeeping) -> list[int]:
    """One drift sweep, as the elected replica runs it."""
    with keeper.backend.ledger_engine.begin() as conn:
        live = {i["name"] for i in keeper.backend.live_instances(conn)}
        states = job_states(conn)
        registered = registrations_of(conn)
        return keeper.sweep_drift(conn, states, registered, live, datetime.now(UTC))


def notices(backend) -> list[dict]:
    with backend.ledger_engine.connect() as conn:
        rows = conn.execute(select(tables.notices).order_by(tables.notices.c.id))
        return [{**row._mapping, "facts": json.loads(row.facts)} for row in rows]


def test_replicas_that_disagree_are_shown_and_told_once_and_their_agreement_once(backends):
    old_job = make_job(KEY, lambda ctx: None, name="sync")  # every 1 s
    new_job = every(old_job, "2s")
    a, b = backends("a", connect=False), backends("b", connect=False)
    old, new = keeper_of(a, Catalog((old_job,))), keeper_of(b, Catalog((new_job,)))
    started(old, new)

    found = fleet_status(a, Catalog((old_job,)), datetime.now(UTC))["jobs"][0]
    assert found["schedules_agree"] is False
    assert found["schedules"] == [
        {"schedule": "every 1s", "instances": ["a"]},
        {"schedule": "every 2s", "instances": ["b"]},
    ]
    (check,) = schedule_checks(a, Catalog((old_job,)))
    assert check == (
        False,
        "sync: live replicas run every 1s on a; every 2s on b; this config.yaml: every 1s",
    )

    assert len(drift(old)) == 1  # grace 0: told at once
    assert drift(new) == []  # once for the fleet, whoever sweeps next
    (told,) = notices(a)
    assert told["event"] == "job.schedule_drift" and told["job_name"] == "sync"
    assert [v["instances"] for v in told["facts"]["schedules"]] == [["a"], ["b"]]
    with a.ledger_engine.connect() as conn:
        assert job_states(conn)[KEY]["drift_since"] is not None

    old.reregister(Catalog((new_job,)))  # a reload: both run every 2 s now
    assert fleet_status(a, Catalog((new_job,)), datetime.now(UTC))["jobs"][0]["schedules"] == [
        {"schedule": "every 2s", "instances": ["a", "b"]}
    ]
    assert schedule_checks(a, Catalog((new_job,)))[0][0] is True
    assert len(drift(new)) == 1 and drift(old) == []
    assert [n["event"] for n in notices(a)] == ["job.schedule_drift", "job.schedule_agreed"]
    with a.ledger_engine.connect() as conn:
        state = job_states(conn)[KEY]
    assert state["drift_since"] is None and not state["drift_alerted"]


def test_a_disagreement_within_the_grace_is_not_told(backends):
    job = make_job(KEY, lambda ctx: None, name="sync")
    a, b = backends("a", connect=False), backends("b", connect=False)
    first = keeper_of(a, Catalog((job,)), grace=600)
    second = keeper_of(b, Catalog((every(job, "2s"),)), grace=600)
    started(first, second)
    assert drift(first) == [] and notices(a) == []
    second.reregister(Catalog((job,)))
    assert drift(first) == [] and notices(a) == []


def test_replicas_starting_together_each_keep_their_schedule_in_force(backends):
    """The second registers while the first is not live yet: the first, seen alive at its
    registration, is starting, not gone, and its schedule stays in force."""
    job = make_job(KEY, lambda ctx: None, name="sync")
    a, b = backends("a", connect=False), backends("b", connect=False)
    first, second = keeper_of(a, Catalog((job,))), keeper_of(b, Catalog((every(job, "2s"),)))
    first.track_jobs()
    second.track_jobs()
    a.connect()
    b.connect()
    shown = fleet_status(a, Catalog((job,)), datetime.now(UTC))["jobs"][0]["schedules"]
    assert [v["instances"] for v in shown] == [["a"], ["b"]]
    with a.ledger_engine.connect() as conn:
        assert {r.instance for r in registrations_of(conn) if r.until is None} == {"a", "b"}


def test_a_replica_taken_for_gone_while_it_started_gets_its_schedule_back(backends):
    """The second registers while the first is not live and not seen for a while (a start
    slower than `SEEN_RECENTLY`) and supersedes its schedule; the first's next
    housekeeping pass (one second after its start) puts it back."""
    job = make_job(KEY, lambda ctx: None, name="sync")
    a, b = backends("a", connect=False), backends("b", connect=False)
    first, second = keeper_of(a, Catalog((job,))), keeper_of(b, Catalog((every(job, "2s"),)))
    first.track_jobs()
    with a.ledger_engine.begin() as conn:
        long_ago = datetime.now(UTC) - timedelta(seconds=SEEN_RECENTLY + 60)
        conn.execute(tables.seen.update().values(seen_at=long_ago))
    second.track_jobs()  # `a` is not live, nor seen lately: it looks like a gone replica
    a.connect()
    b.connect()
    shown = fleet_status(a, Catalog((job,)), datetime.now(UTC))["jobs"][0]["schedules"]
    assert [v["instances"] for v in shown] == [["b"]]
    first.run_once()
    shown = fleet_status(a, Catalog((job,)), datetime.now(UTC))["jobs"][0]["schedules"]
    assert [v["instances"] for v in shown] == [["a"], ["b"]]


def test_a_replica_starting_keeps_its_rows_when_another_starts_with_the_same_schedule(backends):
    """Not taken over as a gone replica's: it would put them all back at its first pass,
    and every replica starting after it would take them again (100 replicas of 1,000
    jobs starting together did that, under the writers' table lock)."""
    job = make_job(KEY, lambda ctx: None, name="sync")
    a, b = backends("a", connect=False), backends("b", connect=False)
    first, second = keeper_of(a, Catalog((job,))), keeper_of(b, Catalog((job,)))
    first.track_jobs()
    with a.ledger_engine.connect() as conn:
        (mine,) = registrations_of(conn)
    second.track_jobs()
    with a.ledger_engine.connect() as conn:
        found = {r.instance: r for r in registrations_of(conn)}
    assert found["a"] == mine
    assert found["b"].until is None and found["b"].since >= mine.since
