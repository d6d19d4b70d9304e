"""The tick queue alone: which ticks a step offers, and that none is dropped while it may
still run (scheduler/gate/ticks.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from scheduler.backends.base import Intent
from scheduler.gate.runs import Running
from scheduler.gate.ticks import RETRY_FIRST, TickQueue
from tests.support import FakeMonotonic, make_job

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
JOB = make_job(41, lambda ctx: None, name="q")


def tick(n: int) -> datetime:
    return T0 + timedelta(seconds=n)


def offered(queue: TickQueue, state: Running = Running.NOT, free: int = 1) -> list:
    return [(r.tick, r.intent) for b in queue.take(free, lambda key: state) for r in b.requests]


def test_ticks_of_a_job_are_offered_oldest_first_one_run_at_a_time():
    queue = TickQueue(FakeMonotonic())
    for n in range(3):
        queue.add([JOB], tick(n))
    assert offered(queue) == [(tick(0), Intent.RUN)]
    assert offered(queue, Running.HERE) == []  # the other two wait behind its run
    assert offered(queue) == [(tick(1), Intent.RUN)]  # it ended
    assert offered(queue) == [(tick(2), Intent.RUN)]  # that one was lost to another replica
    assert offered(queue) == [] and len(queue) == 0


def test_a_tick_fired_during_the_run_is_skipped_and_the_ones_behind_it_still_run():
    queue = TickQueue(FakeMonotonic())
    queue.add([JOB], tick(0))
    queue.add([JOB], tick(1))
    assert offered(queue) == [(tick(0), Intent.RUN)]
    queue.add([JOB], tick(2))  # fired while the run of tick(0) goes on here
    assert offered(queue, Running.HERE) == [(tick(2), Intent.SKIP)]
    assert offered(queue) == [(tick(1), Intent.RUN)]


def test_a_deferred_tick_is_not_dropped_when_its_next_tick_comes():
    queue = TickQueue(FakeMonotonic())
    queue.add([JOB], tick(0))
    (batch,) = queue.take(1, lambda key: Running.NOT)
    queue.leave([(batch.entries[0], tick(0))])  # no worker was free after all
    queue.add([JOB], tick(1))
    assert offered(queue) == [(tick(0), Intent.RUN)]
    assert offered(queue) == [(tick(1), Intent.RUN)]


def test_a_failed_claim_waits_out_its_delay_though_ticks_wait_behind_it():
    clock = FakeMonotonic()
    queue = TickQueue(clock)
    queue.add([JOB], tick(0))
    queue.add([JOB], tick(1))
    (batch,) = queue.take(1, lambda key: Running.NOT)
    queue.put_back(batch.entries, failed=True)  # alone: it waits RETRY_FIRST
    assert offered(queue) == []
    clock.now += RETRY_FIRST
    assert offered(queue) == [(tick(0), Intent.RUN)]
