"""Claiming ahead of the free workers (scheduler/gate/ahead.py), over the embedded backend:
the lease of a run won ahead, and what asks it again. The same scenarios run on
PostgreSQL in tests/integration/test_gate.py."""

from __future__ import annotations

import pytest

from scheduler.backends.base import Outcome
from scheduler.fleet import pauses
from scheduler.gate.ahead import HORIZON, LEASE, MAX_AHEAD, RunLengths
from scheduler.ledger import tables
from scheduler.observers import events
from scheduler.statuses import NOT_STARTED_LOCK_LOST, NOT_STARTED_UNSURE, Status
from tests.support import (
    a_pause_meanwhile_stops_a_run_won_ahead,
    a_run_won_ahead_past_its_lease_is_asked_again,
    claimed_ahead,
    settle,
)


def test_no_run_is_claimed_ahead_before_any_run_here_has_ended():
    assert RunLengths().ahead(20) == 0


def test_runs_ahead_are_what_the_free_workers_start_within_the_horizon():
    lengths = RunLengths()
    lengths.add(HORIZON / 5)  # five runs per worker within the horizon
    assert lengths.ahead(4) == 20
    assert lengths.ahead(0) == 0  # no worker free: none ahead either
    lengths.add(100.0)  # a long run pulls the mean up: fewer ahead
    assert lengths.ahead(4) < 20
    quick = RunLengths()
    quick.add(0.0)
    assert quick.ahead(1000) == MAX_AHEAD


def test_a_run_won_ahead_past_its_lease_is_asked_again_and_runs(gate_over_file):
    gate, seen, clock, _ = gate_over_file(max_workers=1)
    asked = a_run_won_ahead_past_its_lease_is_asked_again(gate, seen, clock, (601, 602, 603))
    assert all(not r.give_back for r in asked[0])


def test_a_run_that_waited_for_a_worker_reports_the_wait_in_its_lateness(gate_over_file):
    gate, seen, clock, _ = gate_over_file(max_workers=1)
    claimed_ahead(gate, clock, (605, 606))
    gate.table.workers.go(1)
    clock.now += LEASE / 2  # within its lease: it starts without asking again
    gate.table.workers.go()
    first, second = seen.of(events.RunStarted)
    # At least the wait, added to the lateness at the claim (in floats: not to the last bit).
    assert second.lateness_s - first.lateness_s >= LEASE / 2 - 1e-9


def test_a_job_paused_after_its_run_was_won_ahead_does_not_start(gate_over_file):
    gate, seen, clock, _ = gate_over_file(max_workers=1)
    a_pause_meanwhile_stops_a_run_won_ahead(gate, seen, clock, (611, 612))
    with gate.backend.ledger_engine.connect() as conn:
        t = tables.ticks
        status = conn.execute(t.select().where(t.c.job_key == 612)).one().status
    assert status == Status.PAUSED


def test_a_run_won_ahead_whose_job_a_reload_took_away_is_given_back(gate_over_file):
    gate, seen, clock, _ = gate_over_file(max_workers=1)
    jobs = claimed_ahead(gate, clock, (621, 622))
    gate.reloaded({621: jobs[0]}.get)  # 622 is no longer in this replica's config
    gate.table.workers.go()  # within the lease; 622 is handed back all the same
    gate.step()
    settle(gate, lambda: seen.of(events.RunFinished), "621's run")
    assert [e.key for e in seen.of(events.RunStarted)] == [621]
    with gate.backend.ledger_engine.connect() as conn:
        t = tables.ticks
        assert conn.execute(t.select().where(t.c.job_key == 622)).all() == []  # anyone's again
    assert 622 not in gate.backend.held_keys()
    assert not gate.table.running_keys()


def test_a_run_won_ahead_never_starts_once_its_lock_session_is_lost(gate_over_file):
    gate, seen, clock, _ = gate_over_file(max_workers=1)
    claimed_ahead(gate, clock, (631, 632))
    gate.session.lose("the server closed the session")
    gate.table.workers.go()
    assert not seen.of(events.RunStarted)
    assert {run.ended.status for run in gate.table.runs()} == {Status.CRASHED}
    assert {run.ended.error for run in gate.table.runs()} == {NOT_STARTED_LOCK_LOST}


def test_a_run_won_ahead_whose_recheck_failed_is_not_started(gate_over_file):
    gate, seen, clock, backend = gate_over_file(max_workers=1)
    claimed_ahead(gate, clock, (641, 642))

    def failing(runs):
        raise RuntimeError("canceling statement due to statement timeout")

    backend.recheck = failing
    clock.now += LEASE + 0.01
    gate.table.workers.go()
    gate.step()
    gate.table.workers.go()
    settle(gate, lambda: not gate.table.runs(), "both finishes to be recorded")
    assert not seen.of(events.RunStarted)
    finished = seen.of(events.RunFinished)
    assert {e.status for e in finished} == {Status.CRASHED}
    assert {e.error for e in finished} == {
        NOT_STARTED_UNSURE.format(reason="canceling statement due to statement timeout")
    }
    assert not backend.held_keys()


def test_pause_returns_only_once_the_lease_of_runs_claimed_before_it_has_passed():
    waited: list[float] = []
    pauses.settle(waited.append)
    assert waited == [pytest.approx(LEASE)]


def test_the_embedded_backend_answers_a_recheck_of_a_row_no_longer_its_lost(gate_over_file):
    from scheduler.backends.base import Recheck
    from tests.support import now_tick

    _, _, _, backend = gate_over_file()
    backend.connect()
    assert backend.recheck([Recheck(651, now_tick(-1), 1, give_back=False)]) == [Outcome.LOST]
