"""The fleet simulation: every seed of the budget, on PostgreSQL and on the embedded backend.

A failure names its seed and the shortest trace of steps found that breaks the
same rule (`play.report`). SIM_SEEDS and SIM_STEPS scale the budget.
"""

from __future__ import annotations

import pytest

from tests.simulation import summary
from tests.simulation.play import budget, report

pytestmark = pytest.mark.simulation

SEEDS, STEPS = budget()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", ["postgresql", "embedded"])
def test_seed_keeps_every_rule(kind, seed, pg_server):
    played, failure = report(kind, pg_server, seed, STEPS)
    summary.add(kind, played, STEPS)
    assert failure is None, failure
    assert played.checked > 0
