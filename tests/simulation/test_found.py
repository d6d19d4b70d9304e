"""What the simulation found, each kept as the steps that showed it."""

from __future__ import annotations

import pytest

from tests.simulation.play import play
from tests.simulation.steps import CALL_FAULTS, Step

pytestmark = pytest.mark.simulation

REPLY_LOST = CALL_FAULTS.index("reply_lost")


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
