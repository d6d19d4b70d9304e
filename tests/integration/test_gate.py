"""The gate itself, driven step by step with a fake monotonic clock (no sleeping).

Real PostgreSQL sessions underneath; the gate's dispatcher thread is not
started: each test calls `step()` where the thread would.
"""

from __future__ import annotations

import threading

import psycopg

from scheduler.backends.base import Outcome, Recheck
from scheduler.observers import events
from tests.support import (
    a_pause_meanwhile_stops_a_run_won_ahead,
    a_run_won_ahead_past_its_lease_is_asked_again,
    a_waiting_tick_still_runs,
    claimed_ahead,
    make_job,
    now_tick,
    retried_claims_share_the_free_workers,
    settle,
)


def test_a_job_still_running_here_is_skipped_without_asking_for_its_lock_again(gate_factory):
    release = threading.Event()
    job = make_job(501, lambda ctx: release.wait(10), name="blocking")
    gate, seen, _ = gate_factory()
    gate.submit(job, now_tick(-1))
    settle(gate, lambda: seen.of(events.RunStarted), "the first run to start")
    gate.submit(job, now_tick())
    settle(gate, lambda: seen.of(events.TickSkipped), "the next tick to be skipped")
    skipped = seen.of(events.TickSkipped)[0]
    assert (skipped.holder, skipped.consecutive_skips) == ("g1", 1)
    release.set()
    settle(gate, lambda: seen.of(events.RunFinished), "the run to finish")
    assert seen.of(events.RunFinished)[0].status == "succeeded"


def test_only_free_workers_claim_ticks_the_rest_wait(gate_factory):
    release = threading.Event()
    first = make_job(511, lambda ctx: release.wait(10), name="first")
    second = make_job(512, lambda ctx: None, name="second")
    gate, seen, _ = gate_factory(max_workers=1)
    gate.submit(first, now_tick())
    settle(gate, lambda: seen.of(events.RunStarted), "the first run to start")
    gate.submit(second, now_tick())
    gate.step()
    assert [e.job for e in seen.of(events.RunStarted)] == ["first"]  # no free worker: waits
    release.set()
    settle(gate, lambda: len(seen.of(events.RunStarted)) == 2, "the waiting tick to run")
    assert [e.job for e in seen.of(events.RunStarted)] == ["first", "second"]


def test_a_tick_that_waited_for_a_worker_still_runs_when_its_next_tick_comes(gate_factory):
    gate, seen, _ = gate_factory(max_workers=1)
    a_waiting_tick_still_runs(gate, seen, (521, 522))


def test_claims_tried_again_apart_share_the_free_workers(gate_factory):
    gate, seen, _ = gate_factory(max_workers=1)
    retried_claims_share_the_free_workers(gate, seen, (523, 524))


def test_a_killed_lock_session_sets_lock_lost_and_the_gate_reconnects(gate_factory, database_url):
    release = threading.Event()
    job = make_job(521, lambda ctx: release.wait(10), name="victim")
    gate, seen, _ = gate_factory()
    gate.submit(job, now_tick())
    settle(gate, lambda: seen.of(events.RunStarted), "the run to start")
    run = next(iter(gate.table.runs()))
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE application_name = 'g1' AND datname = current_database()"
        )
    settle(gate, lambda: seen.of(events.LockSessionLost), "the lost session to be noticed")
    assert run.ctx.lock_lost.is_set()
    assert seen.of(events.LockSessionLost)[0].runs == ("victim",)
    settle(gate, lambda: gate.connected, "the gate to reconnect")
    release.set()
    settle(gate, lambda: seen.of(events.RunFinished), "the stale run to report")
    finished = seen.of(events.RunFinished)[0]
    assert finished.lock_lost
    assert finished.recorded  # nobody took its row over, so the truth is recorded


def test_no_round_trip_within_holder_timeout_means_the_locks_are_lost(gate_factory):
    release = threading.Event()
    job = make_job(531, lambda ctx: release.wait(10), name="frozen")
    gate, seen, clock = gate_factory(holder_timeout=6)
    gate.submit(job, now_tick())
    settle(gate, lambda: seen.of(events.RunStarted), "the run to start")
    run = next(iter(gate.table.runs()))
    clock.now += 7  # as after a SIGSTOP: the server has ended the session by now
    gate.step()
    assert run.ctx.lock_lost.is_set()
    assert seen.of(events.LockSessionLost)
    release.set()


def test_a_manual_trigger_runs_through_the_gate(gate_factory):
    job = make_job(541, lambda ctx: None, name="by_hand")
    gate, seen, _ = gate_factory()
    gate.start()
    try:
        result = gate.trigger(job, timeout=20)
    finally:
        gate.stop(5)
    assert result.outcome is Outcome.RUN and result.status == "succeeded"
    assert seen.of(events.RunStarted)[0].manual


def test_a_run_won_ahead_past_its_lease_is_asked_again_and_runs(gate_factory):
    gate, seen, clock = gate_factory(max_workers=1)
    a_run_won_ahead_past_its_lease_is_asked_again(gate, seen, clock, (531, 532, 533))
    assert gate.backend.held_keys() == set()


def test_a_job_paused_after_its_run_was_won_ahead_does_not_start(gate_factory, database_url):
    gate, seen, clock = gate_factory(max_workers=1)
    a_pause_meanwhile_stops_a_run_won_ahead(gate, seen, clock, (541, 542))
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT status, run_id, started_at FROM scheduler_ticks WHERE job_key = 542"
        ).fetchone()
    assert row == ("paused", None, None)


def test_a_recheck_gives_back_a_run_won_ahead_and_answers_a_row_not_its_own_lost(
    gate_factory, database_url
):
    gate, _, clock = gate_factory(max_workers=1)
    claimed_ahead(gate, clock, (551, 552))
    first, second = sorted(gate.table.runs(), key=lambda run: run.job.key)
    asked = [
        Recheck(551, first.ctx.scheduled_at, first.ctx.run_id, give_back=True),
        Recheck(552, second.ctx.scheduled_at, second.ctx.run_id + 1000, give_back=False),
    ]
    assert gate.backend.held_keys() == {551, 552}
    assert gate.backend.recheck(asked) == [Outcome.LOST, Outcome.LOST]
    assert gate.backend.held_keys() == set()  # neither will start here: both locks go
    with psycopg.connect(database_url) as conn:
        rows = conn.execute(
            "SELECT job_key, status FROM scheduler_ticks WHERE job_key IN (551, 552)"
        ).fetchall()
    assert rows == [(552, "running")]  # 551's tick is anyone's again; 552's row untouched


def test_a_replica_holds_other_shares_whole_and_helps_with_the_ticks_their_owner_left(
    gate_factory,
):
    """Once it knows the fleet, a replica queues only its own share of a burst; a probe
    after HELP_AFTER finds what the other share's owner (here: never stepped) left, and
    those run here, each once. The owner's late claim then finds every tick taken."""
    from scheduler.backends.shares import share_of
    from scheduler.gate.others import HELP_AFTER

    jobs = [make_job(key, lambda ctx: None, name=f"s{key}") for key in range(600, 664)]
    g1, seen1, clock1 = gate_factory("g1", max_workers=64)
    g2, seen2, clock2 = gate_factory("g2", max_workers=64)
    g1.step(), g2.step()  # both lock sessions up: the fleet is two
    first = now_tick(-3)
    for gate in (g1, g2):
        gate.submit_all(jobs, first)
    for gate in (g1, g2):  # each reads the fleet's shape beside a claim
        settle(gate, lambda gate=gate: gate.backend.shape() is not None, "the fleet's shape")
    settle(g1, lambda: g1.table.free_slots() == 64, "the first burst's runs to end")
    settle(g2, lambda: g2.table.free_slots() == 64, "the first burst's runs to end")
    shape = g1.backend.shape()
    assert shape is not None and shape.live == 2
    own = {job.key for job in jobs if share_of(job.key, 2) == shape.rank}

    later = now_tick(-1)  # anyone's by the time the probe comes (the takeover is 0.1 s)
    g1.submit_all(jobs, later)
    g2.submit_all(jobs, later)  # g2 is frozen: it takes no step until the end
    settle(
        g1,
        lambda: {e.key for e in seen1.of(events.RunStarted) if e.scheduled_at == later} == own,
        "g1's own share to start",
    )
    assert len(g1.queue) == 1  # the other share: one record, held
    clock1.now += HELP_AFTER
    settle(
        g1,
        lambda: (
            len([e for e in seen1.of(events.RunStarted) if e.scheduled_at == later]) == len(jobs)
        ),
        "the other share to be helped with",
    )

    clock2.now += HELP_AFTER
    settle(g2, lambda: len(g2.queue) == 0, "g2 to look at its queue")
    assert [e for e in seen2.of(events.RunStarted) if e.scheduled_at == later] == []
    assert rows_of(g1, later) == [("succeeded", "g1", len(jobs))]


def test_a_replica_alone_among_frozen_ones_helps_a_part_at_a_time_and_runs_every_tick(
    gate_factory,
):
    """Four replicas, three frozen after the fleet is known: the one left helps with its
    part of the untaken ticks per probe (others.HELPERS), holds the rest again, and so
    runs every tick of the burst after a few probes, each once."""
    from scheduler.backends.shares import share_of
    from scheduler.gate.others import HELP_AFTER, HELPERS

    jobs = [make_job(key, lambda ctx: None, name=f"p{key}") for key in range(700, 764)]
    made = [gate_factory(f"h{n}", max_workers=64) for n in range(4)]
    for gate, _, _ in made:
        gate.step()  # every lock session up: the fleet is four
    first = now_tick(-3)
    for gate, _, _ in made:
        gate.submit_all(jobs, first)
    for gate, _, _ in made:
        settle(gate, lambda gate=gate: gate.backend.shape() is not None, "the fleet's shape")
        settle(gate, lambda gate=gate: gate.table.free_slots() == 64, "the first runs to end")
    g1, seen, clock = made[0]
    shape = g1.backend.shape()
    assert shape is not None and shape.live == 4

    later = now_tick(-1)

    def started() -> set[int]:
        return {e.key for e in seen.of(events.RunStarted) if e.scheduled_at == later}

    own = {job.key for job in jobs if share_of(job.key, 4) == shape.rank}
    g1.submit_all(jobs, later)  # the other three are frozen: no step from them
    settle(g1, lambda: started() == own, "g1's own share")
    untaken = len(jobs) - len(own)
    part = -(-untaken * HELPERS // 3)  # the part of one of the other three
    assert part < untaken
    clock.now += HELP_AFTER
    settle(g1, lambda: len(started()) == len(own) + part, "a first part of the others' ticks")
    g1.step()  # the rest is held until its next probe
    assert len(started()) == len(own) + part
    for _ in range(20):  # each probe: a part of what is left, and the rest held again
        clock.now += HELP_AFTER
        settle(g1, lambda: True, "a step")
    settle(g1, lambda: len(started()) == len(jobs), "every tick of the burst")
    assert rows_of(g1, later) == [("succeeded", "h0", len(jobs))]


def rows_of(gate, tick) -> list[tuple[str, str, int]]:
    """The ledger's rows of `tick`: (status, replica, how many)."""
    with psycopg.connect(gate.backend.url) as conn:
        return conn.execute(
            "SELECT status, instance, count(*) FROM scheduler_ticks WHERE scheduled_at = %s"
            " GROUP BY status, instance",
            (tick,),
        ).fetchall()


def test_a_probe_answers_each_tick_of_several_instants_by_its_own_row(gate_factory):
    """The probe sends each distinct instant once and each tick as its place among them:
    a tick is taken only where its own (job, instant) row is, whatever other rows its
    job or its instant has."""
    gate, _, _ = gate_factory("p1")
    gate.step()
    first, second = now_tick(-5), now_tick(-4)
    gate.submit_all([make_job(key, lambda ctx: None, name=f"p{key}") for key in (701, 702)], first)
    gate.submit_all([make_job(703, lambda ctx: None, name="p703")], second)
    settle(gate, lambda: len(rows_of(gate, first)) + len(rows_of(gate, second)) == 2, "rows")
    settle(gate, lambda: gate.table.free_slots() == 4, "the runs to end")
    asked = [(701, second), (701, first), (703, first), (703, second), (702, first), (704, first)]
    assert gate.backend.untaken(asked) == [0, 2, 5]
    assert gate.backend.untaken([]) == []
