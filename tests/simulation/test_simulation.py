"""The fleet simulation: every seed of the budget, on PostgreSQL and on the embedded backend.

A failure names its seed and the shortest trace of steps found that breaks the
same rule (`play.report`). SIM_SEEDS and SIM_STEPS scale the budget.
"""

from __future__ import annotations

import pytest

from tests.simulation import summary
from tests.simulation.play import budget, compare, report, twin_steps

pytestmark = pytest.mark.simulation

SEEDS, STEPS = budget()
TWIN_STEPS = twin_steps()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", ["postgresql", "embedded"])
def test_seed_keeps_every_rule(kind, seed, pg_server):
    played, failure = report(kind, pg_server, seed, STEPS)
    summary.add(kind, played, STEPS)
    assert failure is None, failure
    assert played.checked > 0


@pytest.mark.parametrize("seed", SEEDS)
def test_both_backends_keep_one_ledger(seed, pg_server):
    """The same steps on PostgreSQL and on the embedded backend leave the same ledger, row
    for row, where the backends do not differ by design (twins.py, docs/faults.md)."""
    played, failure = compare(pg_server, seed, TWIN_STEPS)
    summary.add_twins(played, TWIN_STEPS)
    assert failure is None, failure
