"""What the simulation found, each kept as the steps that showed it."""

from __future__ import annotations

from datetime import timedelta

import pytest

from scheduler.backends.base import ClaimRequest, Intent
from tests.simulation import jobs
from tests.simulation.play import compare, play
from tests.simulation.sites import PgSite
from tests.simulation.steps import ARMED, Step, draw

pytestmark = pytest.mark.simulation

REPLY_LOST = ARMED.index("reply_lost")


@pytest.mark.parametrize("kind", ["postgresql", "embedded"])
def test_two_run_now_requests_after_a_lost_reply_leave_no_lock(kind, pg_server):
    """Two run-now requests for one job in one step, the first claim's reply lost after its
    commit: the second must not take the job's lock again on top of the first (advisory
    locks stack), or the lock outlives the run (seed 1 found it through a catch-up pass)."""
    steps = [
        Step("step", 0),  # r0's lock session opens
        Step("run_now", 0, 0),  # job `fast`, at r0's "now"
        Step("clock_jump", 0, 5, 1),  # r0's clock moves on: the next request has its own tick
        Step("run_now", 0, 0),
        Step("fault_call", 0, REPLY_LOST),
        Step("step", 0),
        Step("finish", 0, 0),  # the run that started ends
        Step("step", 0),
        Step("step", 0),
    ]
    played = play(kind, pg_server, 1, steps)
    assert played.violation is None, played.violation
    assert played.faults["reply_lost"] == 1


def test_a_claim_that_records_a_skip_is_not_compiled(pg_server):
    """A claim recording a skip planned a LATERAL call that only a nested loop can run, which
    its `enable_nestloop = off` costed past jit_above_cost: JIT compiled it, 0.7 s of the lock
    session per skip (seed 1 spent 7 of its 10 s there). Every plan of a claim runs uncompiled."""
    site = PgSite(pg_server)
    backend = site.backend("r0")
    try:
        backend.connect()
        driver = backend._conn.connection.driver_connection
        # The lock session turns JIT off; here it is on, so that the functions' own
        # `jit = off` is what is tested (pg_jit_available is false while jit is off).
        driver.execute("SET jit = on")
        if not driver.execute("SELECT pg_jit_available()").fetchone()[0]:
            pytest.skip("this server has no JIT")
        plans: list[str] = []
        driver.add_notice_handler(lambda diag: plans.append(diag.message_primary or ""))
        driver.execute("LOAD 'auto_explain'")
        for name, value in EXPLAIN_EVERY_PLAN.items():
            driver.execute(f"SET {name} = {value}")
        tick = jobs.AUTUMN
        for intent, at in ((Intent.RUN, tick), (Intent.SKIP, tick + timedelta(seconds=5))):
            request = ClaimRequest(jobs.FAST, "fast", at, intent, 10**8, 3, 3)
            backend.claim([request], "r0", 3)
        assert any("scheduler_record_skips" in plan for plan in plans)
        assert not [plan for plan in plans if "JIT:" in plan]
    finally:
        site.close()


EXPLAIN_EVERY_PLAN = {
    "auto_explain.log_min_duration": "0",
    "auto_explain.log_nested_statements": "on",
    "auto_explain.log_level": "notice",
}


@pytest.mark.parametrize("kind", ["postgresql", "embedded"])
def test_a_sweep_by_a_replica_without_a_job_leaves_that_jobs_missed_ticks(kind, pg_server):
    """The missed-tick window is the fleet's, but a sweep walked only its own replica's
    jobs: a replica restarted without `night` swept first, and the night ticks of the
    fleet that was down were never recorded (seed 1 found it)."""
    steps = [
        Step("step_all"),  # every replica's session opens: all live
        Step("crash_restart", 2, 2),  # r2 comes back with the configuration without `night`
        Step("step", 2),
        Step("sweep", 2, 1),  # and wins the first sweep
    ]
    played = play(kind, pg_server, 1, steps)
    assert played.violation is None, played.violation


@pytest.mark.parametrize("kind", ["postgresql", "embedded"])
def test_a_run_with_a_tick_skipped_behind_it_did_not_keep_up(kind, pg_server):
    """A replica whose clock jumped ahead skipped `night`'s next tick before it was due, and
    the run then ended before that tick: the finish judged it kept up by the clock alone, so
    it sent a recovery and ended the overrun's alert while the streak it alerted for went on
    (the next skip would alert again for the same streak). Seed 1 found it once finishes
    were judged on the world's time (recoveries had never come about before)."""
    steps = [
        Step("fault_call", 14146, 21456, 51544),
        Step("fault_call", 1612, 26151, 30431),
        Step("fault_call", 45065, 46304, 60179),
        Step("clock_jump", 36857, 32710, 35211),
        Step("tick", 24197, 45144, 38048),
        Step("tick", 20922, 33451, 22039),
        Step("fault_call", 38599, 59598, 42205),
        Step("fault_call", 14967, 3097, 40895),
        Step("step_all", 52076, 19197, 4630),
        Step("fault_call", 28914, 59093, 29254),
        Step("fault_call", 4023, 51760, 42106),
        Step("fault_call", 55875, 7705, 39138),
        Step("step_all", 27804, 6218, 40158),
    ]
    played = play(kind, pg_server, 1, steps)
    assert played.violation is None, played.violation


def test_a_lock_given_back_on_the_embedded_backend_lets_the_job_run_as_on_postgresql(pg_server):
    """Seed 1's first 36 steps on both backends: a claim's reply is lost, its replica gives
    the job's lock back, and the next claim elsewhere runs the job on PostgreSQL (the row
    left `running` is crashed) but was skipped on the embedded backend for as long as the
    first replica lived: its lock file still named it. The ledgers differed."""
    _, failure = compare(pg_server, 1, 36)
    assert failure is None, failure


def test_ticks_the_sweeps_limit_left_are_not_asked_for(pg_server):
    """Seed 3035: the first whole sweep came 15 minutes in, its window holding more than
    `MISSED_LIMIT` due ticks of one job, so it recorded the latest 100 and left the older
    ones, as documented. It counted them among the ticks due by the registrations as it
    read them, where a replica that was reconnecting looked gone, its schedule ended early:
    two ticks more were due in its eyes than in the world's, and the rule asked for two
    ticks the sweep had rightly left (every_tick_explained, `_left_by_limit`)."""
    played = play("postgresql", pg_server, 3035, draw(3035, 500))
    assert played.violation is None, played.violation
    assert played.faults["killed_session"] + played.faults["database_restart"] > 0


@pytest.mark.parametrize("kind", ["postgresql", "embedded"])
def test_a_notice_is_not_given_up_before_its_fifteen_minutes(kind, pg_server):
    """Seed 5009 (800 steps): a notice whose next retry, after its backoff, would have fallen
    past its 15 minutes was given up at once, up to a minute early, never delivered
    (every_notice_delivered). The last retry now falls at the deadline itself."""
    played = play(kind, pg_server, 5009, draw(5009, 800))
    assert played.violation is None, played.violation


# A replica claims `fast` and `slow` and stops as it hands them over (world._handing);
# `fast` is paused meanwhile; the fleet settles, and the stopped replica's workers take
# both runs long after the pause has returned (`scheduler pause` waits `SETTLE`).
PAUSED_AS_IT_WAITED = [
    Step("tick", 15836, 2321, 28776),
    Step("fault_call", 28301, 18955, 18213),  # r2 claims both and stops, 3 s
    Step("pause_resume", 13004, 23121, 33865),  # `fast` paused
]


@pytest.mark.parametrize("kind", ["postgresql", "embedded"])
def test_a_run_won_ahead_whose_job_was_paused_as_it_waited_never_starts(kind, pg_server):
    """Seed 10 claims ahead on both backends: each run handed over has a lease, and past
    it is asked again (`Gate._recheck`): `fast` is recorded paused, `slow` starts."""
    played = play(kind, pg_server, 10, PAUSED_AS_IT_WAITED)
    assert played.violation is None, played.violation
    assert played.faults["stalled_replica"] == 1
    assert (played.faults["recheck_paused"], played.faults["recheck_run"]) == (1, 1)


def test_a_scheduled_run_has_its_lease_without_claims_ahead_too():
    """Seed 8 on the embedded backend, which does not claim ahead: the same steps. A
    scheduled tick's run had no lease there, and `fast` started 11 s after its pause
    committed; every scheduled tick's run now has one, and is asked again."""
    played = play("embedded", None, 8, PAUSED_AS_IT_WAITED)
    assert played.violation is None, played.violation
    assert played.faults["recheck_paused"] == 1
