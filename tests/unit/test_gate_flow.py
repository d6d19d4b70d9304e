"""The gate's flow, driven step by step over the embedded backend: no database server.

The dispatcher thread is not started; each test calls `gate.step()` where it
would, and moves a fake monotonic clock where time matters.
"""

from __future__ import annotations

import threading

from scheduler.backends.base import Intent, Outcome, TickRef
from scheduler.backends.embedded import EmbeddedBackend
from scheduler.gate import Gate
from scheduler.observers import events
from scheduler.registry.context import Interrupted
from tests.support import (
    FakeMonotonic,
    Recorder,
    a_waiting_tick_still_runs,
    make_job,
    now_tick,
    retried_claims_share_the_free_workers,
    settle,
)


class Calls:
    """Wraps a backend method: records each batch it was given, may fail some."""

    def __init__(self, method, fail_if=lambda requests: False) -> None:
        self.method, self.fail_if, self.batches = method, fail_if, []

    def __call__(self, requests, *args):
        self.batches.append(list(requests))
        if self.fail_if(requests):
            raise RuntimeError("canceling statement due to lock timeout")
        return self.method(requests, *args)


def test_a_job_running_here_has_its_next_ticks_skipped_without_its_lock(gate_over_file):
    release = threading.Event()
    job = make_job(11, lambda ctx: release.wait(10), name="long")
    gate, seen, _, backend = gate_over_file()
    backend.claim = Calls(backend.claim)
    gate.submit(job, now_tick(-2))
    settle(gate, lambda: seen.of(events.RunStarted), "the run")
    gate.submit(job, now_tick(-1))
    settle(gate, lambda: seen.of(events.TickSkipped), "the skip")
    assert backend.claim.batches[-1][0].intent is Intent.SKIP
    assert seen.of(events.TickSkipped)[0].holder == "u1"
    release.set()
    settle(gate, lambda: seen.of(events.RunFinished), "the finish")


def test_a_burst_is_claimed_in_one_round_trip(gate_over_file):
    jobs = [make_job(20 + i, lambda ctx: None, name=f"j{i}") for i in range(5)]
    gate, seen, _, backend = gate_over_file(max_workers=10)
    backend.claim = Calls(backend.claim)
    tick = now_tick(-1)
    with gate.burst():
        for job in jobs:
            gate.submit(job, tick)
        gate.step()  # the burst is not complete yet: nothing is claimed
    settle(gate, lambda: len(seen.of(events.RunFinished)) == 5, "five runs")
    assert [len(batch) for batch in backend.claim.batches] == [5]


def test_a_burst_larger_than_the_free_workers_is_still_claimed_in_one_round_trip(
    gate_over_file,
):
    release = threading.Event()
    jobs = [make_job(80 + i, lambda ctx: release.wait(10), name=f"w{i}") for i in range(5)]
    gate, seen, _, backend = gate_over_file(max_workers=3)
    backend.claim = Calls(backend.claim)
    gate.submit_all(jobs, now_tick(-1))
    gate.step()
    # All five are offered at once (in a fleet most would be other replicas' share);
    # the claim wins three, the workers there are, and defers the rest.
    assert [len(batch) for batch in backend.claim.batches] == [5]
    assert len(seen.of(events.RunStarted)) == 3
    release.set()
    settle(gate, lambda: len(seen.of(events.RunFinished)) == 5, "the deferred two to run too")


class Passing(FakeMonotonic):
    """A clock that moves on a microsecond each time it is read, as a real one does."""

    def __call__(self) -> float:
        self.now += 1e-6
        return self.now


def test_ticks_left_to_other_replicas_are_tried_again_in_one_round_trip(gate_over_file):
    jobs = [make_job(60 + i, lambda ctx: None, name=f"y{i}") for i in range(40)]
    gate, seen, clock, backend = gate_over_file(max_workers=50, clock=Passing())
    claim = backend.claim

    def others_first(requests, *args):
        if len(calls.batches) > 1:
            return claim(requests, *args)
        # The first time, as a fleet of two would answer: the odd keys are the other's share.
        mine = [r for r in requests if r.key % 2 == 0]
        theirs = [TickRef(r.key, r.scheduled_at) for r in requests if r.key % 2]
        return claim(mine, *args)._replace(yielded=theirs)

    calls = Calls(others_first)
    backend.claim = calls
    gate.submit_all(jobs, now_tick(-1))
    gate.step()
    assert len(seen.of(events.RunStarted)) == 20
    # The other replica did not take them in time: this one tries, waking when the
    # dispatcher would (at the first of them), and takes them all in one claim.
    clock.now = gate.queue.next_due(50, gate.table.running)
    gate.step()
    assert [len(batch) for batch in calls.batches] == [40, 20]
    settle(gate, lambda: len(seen.of(events.RunFinished)) == 40, "every tick to run")


def test_ticks_beyond_the_free_workers_wait_for_one(gate_over_file):
    release = threading.Event()
    first = make_job(31, lambda ctx: release.wait(10), name="first")
    second = make_job(32, lambda ctx: None, name="second")
    gate, seen, _, _ = gate_over_file(max_workers=1)
    gate.submit(first, now_tick(-1))
    settle(gate, lambda: seen.of(events.RunStarted), "the first run")
    gate.submit(second, now_tick(-1))
    gate.step()
    assert [e.job for e in seen.of(events.RunStarted)] == ["first"]
    release.set()
    settle(gate, lambda: len(seen.of(events.RunStarted)) == 2, "the waiting tick")


def test_a_tick_that_waited_for_a_worker_still_runs_when_its_next_tick_comes(gate_over_file):
    # Ticks are dropped nowhere while they may still run: one that waited here (for a
    # worker, or behind another replica's share) runs in its grace, then the next one.
    gate, seen, _, _ = gate_over_file(max_workers=1)
    a_waiting_tick_still_runs(gate, seen, (33, 34))


def test_ticks_due_before_a_run_wait_behind_it_and_one_fired_during_it_is_skipped(
    gate_over_file,
):
    release = threading.Event()
    job = make_job(35, lambda ctx: release.wait(10), name="slow")
    gate, seen, _, backend = gate_over_file(max_workers=2)
    backend.claim = Calls(backend.claim)
    first, second, third = now_tick(-4), now_tick(-3), now_tick(-2)
    with gate.burst():  # both were due before its run: they wait together
        gate.submit(job, first)
        gate.submit(job, second)
    settle(gate, lambda: seen.of(events.RunStarted), "the first run")
    gate.submit(job, third)  # fired while the run holds the lock
    settle(gate, lambda: seen.of(events.TickSkipped), "the skip")
    assert [e.scheduled_at for e in seen.of(events.TickSkipped)] == [third]
    assert [e.scheduled_at for e in seen.of(events.RunStarted)] == [first]
    release.set()
    settle(gate, lambda: len(seen.of(events.RunFinished)) == 2, "the tick behind it to run")
    assert [e.scheduled_at for e in seen.of(events.RunStarted)] == [first, second]
    run_intents = [r.intent for batch in backend.claim.batches for r in batch]
    assert run_intents.count(Intent.RUN) == 2


def test_batches_claimed_apart_share_the_free_workers(gate_over_file):
    gate, seen, _, _ = gate_over_file(max_workers=1)
    retried_claims_share_the_free_workers(gate, seen, (36, 37))


def test_a_failed_claim_is_tried_again_later_and_apart_from_healthy_ticks(gate_over_file):
    poisoned = make_job(41, lambda ctx: None, name="poisoned")
    healthy = make_job(42, lambda ctx: None, name="healthy")
    gate, seen, clock, backend = gate_over_file()
    failing = {"on": True}
    backend.claim = Calls(
        backend.claim, fail_if=lambda rs: failing["on"] and any(r.key == 41 for r in rs)
    )
    tick = now_tick(-1)
    gate.submit_all([poisoned, healthy], tick)
    gate.step()  # both in one batch: it fails; nobody is told anything
    assert not seen.of(events.RunStarted) and not seen.of(events.LockSessionLost)
    # At once, each alone: the healthy tick runs, the other waits for its retry.
    settle(gate, lambda: seen.of(events.RunStarted), "the healthy job's tick")
    assert [e.job for e in seen.of(events.RunStarted)] == ["healthy"]
    assert [41] in [[r.key for r in batch] for batch in backend.claim.batches]  # tried alone
    tries = len(backend.claim.batches)
    gate.step()
    assert len(backend.claim.batches) == tries  # not before its delay
    failing["on"] = False
    clock.now += 2.0  # the retry is due: tried alone
    settle(gate, lambda: len(seen.of(events.RunStarted)) == 2, "the retried tick")
    assert [r.key for r in backend.claim.batches[-1]] == [41]


def test_a_finish_that_fails_as_a_batch_is_recorded_one_row_at_a_time(gate_over_file):
    jobs = [make_job(50 + i, lambda ctx: None, name=f"f{i}") for i in range(3)]
    gate, seen, _, backend = gate_over_file()
    backend.finish = Calls(backend.finish, fail_if=lambda rs: len(rs) > 1)
    with gate.burst():
        for job in jobs:
            gate.submit(job, now_tick(-1))
    settle(gate, lambda: len(seen.of(events.RunStarted)) == 3, "three runs")
    settle(gate, lambda: len(seen.of(events.RunFinished)) == 3, "three finishes")
    assert all(e.recorded for e in seen.of(events.RunFinished))


def test_a_run_that_stops_when_told_is_interrupted_and_says_what_it_was_told(gate_over_file):
    def careful(ctx):
        ctx.stopping.wait(10)
        raise Interrupted("told to stop")

    job = make_job(61, careful, name="careful")
    gate, seen, _, _ = gate_over_file()
    gate.start()
    gate.submit(job, now_tick(-1))
    settle(gate, lambda: seen.of(events.RunStarted), "the run")
    assert gate.stop(grace=10) == []
    (finished,) = seen.of(events.RunFinished)
    assert (finished.status, finished.told, finished.error) == (
        "interrupted",
        "stopping",
        "told to stop",
    )
    assert finished.recorded


def test_a_run_started_after_its_session_was_told_gets_a_fresh_event(gate_over_file):
    release = threading.Event()
    job = make_job(71, lambda ctx: release.wait(10), name="blocking")
    other = make_job(72, lambda ctx: None, name="other")
    gate, seen, _, _ = gate_over_file()
    gate.submit(job, now_tick(-1))
    settle(gate, lambda: seen.of(events.RunStarted), "the first run")
    told = gate.session.tell("the session was lost")
    assert told.lock_lost.is_set()
    assert not gate.session.generation.lock_lost.is_set()
    gate.submit(other, now_tick(-1))
    settle(gate, lambda: len(seen.of(events.RunFinished)) == 1, "the other run")
    assert not seen.of(events.RunFinished)[0].lock_lost
    release.set()


def test_a_manual_trigger_runs_through_the_gate(gate_over_file):
    job = make_job(81, lambda ctx: None, name="by_hand")
    gate, seen, _, _ = gate_over_file()
    gate.start()
    try:
        result = gate.trigger(job, timeout=20)
    finally:
        gate.stop(5)
    assert result.outcome is Outcome.RUN and result.status == "succeeded"
    assert seen.of(events.RunStarted)[0].manual


def test_the_ledger_keeps_the_runs_own_duration(gate_over_file):
    """Measured where it ran, not the time between its row's start and its finish's commit.

    Here the replica's (fake) clock says the run took 5 s, while the ledger's own
    timestamps are about 0.2 s apart: the ledger keeps the replica's measure.
    """
    job = make_job(91, lambda ctx: threading.Event().wait(0.2), name="timed")
    gate, seen, clock, backend = gate_over_file()
    gate.submit(job, now_tick(-1))
    settle(gate, lambda: seen.of(events.RunStarted), "the run")
    clock.now += 5
    settle(gate, lambda: seen.of(events.RunFinished), "the finish")
    (finished,) = seen.of(events.RunFinished)
    from scheduler.ledger.history import TickFilter, history

    with backend.ledger_engine.connect() as conn:
        (row,) = history(conn, TickFilter(91, limit=1))
    assert row.duration_s == round(finished.duration_s, 6)


def test_a_paused_jobs_tick_is_reported_paused_and_a_manual_trigger_still_runs_it(
    gate_over_file,
):
    from datetime import UTC, datetime

    from scheduler.fleet import pauses

    ran = []
    job = make_job(95, ran.append, name="held_back")
    gate, seen, _, backend = gate_over_file()
    with backend.ledger_engine.begin() as conn:
        pauses.pause(conn, 95, "held_back", by="ops", reason=None, now=datetime.now(UTC))
    gate.submit(job, now_tick(-1))
    settle(gate, lambda: seen.of(events.TickPaused), "the paused tick")
    assert not ran and not seen.of(events.RunStarted) and not seen.of(events.TickSkipped)
    gate.start()
    try:
        result = gate.trigger(job, timeout=20)
    finally:
        gate.stop(5)
    assert result.outcome is Outcome.RUN and result.status == "succeeded" and len(ran) == 1


def test_a_row_whose_error_text_cannot_be_stored_is_recorded_with_a_placeholder(
    gate_over_file,
):
    """The batch fails, the row alone fails again: its error is replaced, its status kept."""

    def fails(ctx):
        raise ValueError("text the ledger refuses")

    jobs = [make_job(96, fails, name="poison"), make_job(97, lambda ctx: None, name="healthy")]
    gate, seen, _, backend = gate_over_file()

    def refused(requests) -> bool:
        return any(r.error and "refuses" in r.error for r in requests)

    backend.finish = Calls(backend.finish, fail_if=refused)
    with gate.burst():
        for job in jobs:
            gate.submit(job, now_tick(-1))
    settle(gate, lambda: len(seen.of(events.RunFinished)) == 2, "both finishes")
    assert all(e.recorded for e in seen.of(events.RunFinished))
    from scheduler.ledger.history import TickFilter, history

    with backend.ledger_engine.connect() as conn:
        poison, healthy = (history(conn, TickFilter(key=k, limit=1))[0] for k in (96, 97))
    assert (poison.status, healthy.status) == ("failed", "succeeded")
    assert poison.error.startswith("(the job's error text could not be stored: ")


def test_a_run_now_request_is_taken_run_here_and_its_outcome_written_back(tmp_path):
    from datetime import UTC, datetime

    from scheduler.fleet import run_now
    from scheduler.registry.catalog import Catalog

    ran = []
    job = make_job(98, ran.append, name="on_demand")
    backend = EmbeddedBackend(tmp_path / "scheduler.db", instance="u1", namespace=77)
    backend.migrate()
    desk = run_now.Desk(backend.ledger_engine, lambda: Catalog((job,)), lambda: datetime.now(UTC))
    seen = Recorder()
    gate = Gate(
        backend, instance="u1", max_workers=2, holder_timeout=30, listeners=[seen], desk=desk
    )
    try:
        with backend.ledger_engine.begin() as conn:
            mine = run_now.ask(conn, 98, "on_demand", by="ops", now=datetime.now(UTC), namespace=77)
            other = run_now.ask(
                conn, 12345, "elsewhere", by="ops", now=datetime.now(UTC), namespace=77
            )

        def state(request: int) -> dict:
            with backend.ledger_engine.connect() as conn:
                return run_now.state(conn, request)

        settle(gate, lambda: state(mine)["finished_at"] is not None, "the request's outcome")
        done = state(mine)
        assert (done["taken_by"], done["outcome"], done["status"]) == ("u1", "run", "succeeded")
        assert len(ran) == 1 and seen.of(events.RunStarted)[0].manual
        assert seen.of(events.RunStarted)[0].run_id == done["run_id"]
        assert state(other)["taken_by"] is None  # not a job of this replica: left to others
    finally:
        backend.close()


def test_a_run_now_taken_with_a_due_tick_never_takes_its_place(tmp_path):
    """Both in one step: the scheduled tick runs; the request finds the job running."""
    from datetime import UTC, datetime

    from scheduler.fleet import run_now
    from scheduler.registry.catalog import Catalog

    release = threading.Event()
    job = make_job(97, lambda ctx: release.wait(10), name="both")
    backend = EmbeddedBackend(tmp_path / "scheduler.db", instance="u1", namespace=77)
    backend.migrate()
    desk = run_now.Desk(backend.ledger_engine, lambda: Catalog((job,)), lambda: datetime.now(UTC))
    seen = Recorder()
    gate = Gate(
        backend, instance="u1", max_workers=2, holder_timeout=30, listeners=[seen], desk=desk
    )
    try:
        with backend.ledger_engine.begin() as conn:
            run_now.ask(conn, 97, "both", by="ops", now=datetime.now(UTC), namespace=77)
        tick = now_tick()
        gate.submit(job, tick)
        settle(gate, lambda: seen.of(events.RunStarted), "a run")
        (started,) = seen.of(events.RunStarted)
        assert started.scheduled_at == tick and not started.manual
        assert not seen.of(events.TickSkipped)
    finally:
        release.set()
        backend.close()


def test_without_notifications_the_gate_looks_for_run_now_requests_every_second(tmp_path):
    from datetime import UTC, datetime

    from scheduler.fleet import run_now
    from scheduler.registry.catalog import Catalog

    job = make_job(96, lambda: None, name="idle")
    backend = EmbeddedBackend(tmp_path / "scheduler.db", instance="u1", namespace=77)
    backend.migrate()
    desk = run_now.Desk(backend.ledger_engine, lambda: Catalog((job,)), lambda: datetime.now(UTC))
    gate = Gate(backend, instance="u1", max_workers=2, holder_timeout=30, desk=desk)
    try:
        gate.step()
        assert gate._wait_time() <= 1.0  # not the heartbeat's 10 s
    finally:
        backend.close()


def test_a_tick_caught_up_after_downtime_is_claimed_before_a_due_one(gate_over_file):
    """Oldest first: the caught-up tick takes the lock; the due tick of the same moment
    finds it held (recorded skipped) rather than the catch-up waiting behind every tick."""
    from concurrent.futures import Future

    gate, seen, _, _ = gate_over_file()
    job = make_job(95, lambda ctx: None, name="backlog")
    old, due = now_tick(-10), now_tick()
    gate.manual.add(job, Future(), old, Intent.CATCH_UP)
    gate.submit(job, due)
    settle(gate, lambda: seen.of(events.RunStarted), "a run")
    assert seen.of(events.RunStarted)[0].scheduled_at == old
