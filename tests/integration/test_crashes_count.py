"""A run recorded `crashed` ends its tick as a failure does, on every path (both backends).

A job whose replica dies during every run must alert: each crashed run grows
the failure streak, which raises one `job.failures_exceeded` at the threshold in
force (its facts say the runs crashed); a success ends it. Paths: a claim that
finds a dead replica's run, a retry look that does, the finish of a run
abandoned at shutdown (and the housekeeping sweep: tests/integration/test_housekeeping.py).
"""

from __future__ import annotations

import json

from sqlalchemy import select

from scheduler.backends.base import ClaimRequest, FinishRequest, Intent, Outcome
from scheduler.ledger import tables
from scheduler.ledger.job_states import job_states
from scheduler.statuses import CRASHED_LOST_LOCK
from tests.integration.test_gate_protocol import KEY, LATER, die, finish, rows, tick
from tests.integration.test_retries_and_catch_up import fail_attempt


def claim_with(backend, at, fail_threshold: int):
    request = ClaimRequest(
        key=KEY,
        name="job",
        scheduled_at=at,
        intent=Intent.RUN,
        grace_s=30.0,
        skip_threshold=3,
        fail_threshold=fail_threshold,
    )
    (result,) = backend.claim([request], backend.instance, capacity=10).every()
    return result


def failure_streak(backend) -> int:
    with backend.ledger_engine.connect() as conn:
        return int(job_states(conn).get(KEY, {}).get("consecutive_failures") or 0)


def failure_alerts(backend) -> list[dict]:
    n = tables.notices
    with backend.ledger_engine.connect() as conn:
        found = conn.execute(select(n).where(n.c.event == "job.failures_exceeded"))
        return [json.loads(row.facts) for row in found]


def test_runs_a_claim_finds_crashed_grow_the_failure_streak_and_alert_once(backends):
    a, b = backends("a"), backends("b")
    stale = claim_with(a, tick(25), 2)
    assert stale.outcome is Outcome.RUN
    die(a)
    first = claim_with(b, tick(20), 2)  # finds a's run: crashed, the streak is 1
    assert first.crashed == 1 and first.notices == ()
    assert failure_streak(b) == 1
    finish(b, first)  # succeeded: the streak ends
    assert failure_streak(b) == 0

    # Each replica dies during its run; the next one's claim finds it crashed.
    dying = [backends(name) for name in ("c", "d", "e")]
    claim_with(dying[0], tick(15), 2)
    die(dying[0])
    crashed_tick = tick(12)
    second = claim_with(dying[1], crashed_tick, 2)
    assert second.crashed == 1 and second.notices == ()
    assert failure_streak(b) == 1
    die(dying[1])
    third = claim_with(dying[2], tick(9), 2)
    assert third.crashed == 1
    assert failure_streak(b) == 2
    (alert,) = failure_alerts(b)
    assert alert["crashed"] == 1 and alert["consecutive_failures"] == 2 and alert["threshold"] == 2
    assert len(third.notices) == 1  # the claim that raised it says so: delivered at once
    assert rows(b)[crashed_tick]["status"] == "crashed"
    finish(dying[2], third)
    assert failure_streak(b) == 0  # a success ends the streak


def test_a_retry_look_that_finds_a_crashed_run_counts_it(backends):
    a, b = backends("a"), backends("b")
    failed = claim_with(a, tick(25), 1)
    fail_attempt(a, failed, retry_in=0)
    running = claim_with(a, tick(20), 1)  # a later tick of the job, on a, which then dies
    assert running.outcome is Outcome.RUN
    die(a)
    found = b.claim_retries("b", [KEY], 1, CRASHED_LOST_LOCK, [1])
    (started,) = found.started
    assert started.crashed == 1
    assert failure_streak(b) == 1
    (alert,) = failure_alerts(b)
    assert alert["crashed"] == 1


def test_a_run_abandoned_at_shutdown_counts_as_a_failure(backends):
    a = backends("a")
    running = claim_with(a, tick(10), 1)
    request = FinishRequest(
        key=KEY,
        scheduled_at=running.scheduled_at,
        run_id=running.run_id,
        status="crashed",
        error="still running when shutdown_grace ran out",
        unlock=False,
        fail_threshold=1,
        next_due=LATER,
    )
    (done,) = a.finish([request])
    assert done.recorded and done.alert
    assert failure_streak(a) == 1
    (alert,) = failure_alerts(a)
    assert alert["crashed"] == 1


def test_runs_the_sweep_finds_crashed_count_as_failures(backends):
    """The sweep is one more path that records `crashed`: its runs count too."""
    from datetime import UTC, datetime

    from scheduler.config.settings import Settings
    from scheduler.fleet.housekeeping import Housekeeping
    from scheduler.registry.catalog import Catalog
    from tests.support import make_job

    a, b = backends("a"), backends("b")
    from dataclasses import replace

    job = replace(make_job(KEY, lambda ctx: None, name="job"), fail_threshold=2)
    keeper = Housekeeping(b, Catalog((job,)), Settings(instance_name="b"))
    for ago in (25, 20):
        claim_with(a, tick(ago), 1)
        die(a)
        with b.ledger_engine.begin() as conn:
            crashed = keeper.sweep_crashed(conn, datetime.now(UTC), {"b"})
            raised = keeper.count_crashes(conn, crashed)
        assert len(crashed) == 1
        a.connect()
    assert failure_streak(b) == 2
    assert len(raised) == 1  # the second crash reached the job's fail_alert_after
    (alert,) = failure_alerts(b)
    assert alert["crashed"] == 1 and alert["consecutive_failures"] == 2
