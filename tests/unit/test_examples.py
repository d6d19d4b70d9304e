"""The shipped example jobs (jobs/examples.py) do what docs/jobs.md says of jobs like them."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from scheduler.gate.runner import execute
from scheduler.registry.context import RunContext
from scheduler.registry.jobs import discover
from scheduler.statuses import Status
from tests.support import ROOT


def run(name: str, told: str | None = None) -> tuple[Status, str | None]:
    spec = discover(ROOT / "jobs").jobs[name]
    ctx = RunContext(name, spec.key, datetime.now(UTC), "r1", run_id=1)
    if told is not None:
        getattr(ctx, told).set()
    return execute(spec, ctx)


@pytest.mark.parametrize("told", ["stopping", "lock_lost"])
def test_a_job_that_stops_early_when_told_is_recorded_interrupted(told):
    status, reason = run("slow_cleanup", told)
    assert status is Status.INTERRUPTED and reason  # not `succeeded`: it did not finish


@pytest.mark.parametrize("name", ["heartbeat", "nightly-report"])
def test_the_other_examples_run(name):
    assert run(name) == (Status.SUCCEEDED, None)
