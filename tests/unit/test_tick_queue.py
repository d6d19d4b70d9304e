"""The tick queue alone: which ticks a step offers, and that none is dropped while it may
still run (scheduler/gate/ticks.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import example, given, settings
from hypothesis import strategies as st

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


def test_a_failed_entry_with_no_worker_free_wakes_the_dispatcher_only_once_one_frees():
    clock = FakeMonotonic()
    queue = TickQueue(clock)
    queue.add([JOB], tick(0))
    (batch,) = queue.take(1, lambda key: Running.NOT)
    queue.put_back(batch.entries, failed=True)
    clock.now += RETRY_FIRST
    assert offered(queue, free=0) == []  # no worker: nothing to claim
    assert queue.next_due(0, lambda key: Running.NOT) is None  # so nothing to wake for
    assert queue.next_due(1, lambda key: Running.NOT) == clock.now
    # A job running here has its ticks claimed `skip`, with no worker free or not.
    assert queue.next_due(0, lambda key: Running.HERE) == clock.now
    assert offered(queue, Running.HERE, free=0) == [(tick(0), Intent.SKIP)]


STATES = st.sampled_from([Running.NOT, Running.HERE, Running.LOST])


@settings(max_examples=500, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["add", "take", "defer", "fail", "wait"]),
            st.integers(0, 2),  # job
            st.integers(0, 3),  # free workers
            STATES,
        ),
        max_size=40,
    )
)
@example(  # a failed batch of two, tried again with no worker free
    [
        ("add", 0, 1, Running.NOT),
        ("add", 1, 1, Running.NOT),
        ("fail", 0, 2, Running.NOT),
        ("take", 0, 0, Running.NOT),
    ]
)
def test_the_dispatcher_never_wakes_for_nothing(ops):
    """Whenever a step claims nothing, the queue's next wake-up is in the future (or none):
    the dispatcher would otherwise turn without sleeping, and hold its lock from stop()."""
    clock = FakeMonotonic()
    queue = TickQueue(clock)
    jobs = [make_job(50 + i, lambda ctx: None, name=f"p{i}") for i in range(3)]
    states = {job.key: Running.NOT for job in jobs}
    n = 0
    for op, i, free, state in ops:
        states[jobs[i].key] = state
        running = states.__getitem__
        if op == "add":
            n += 1
            queue.add([jobs[i]], tick(n))
        elif op in ("take", "defer", "fail"):
            batches = queue.take(free, running)
            if not batches:
                due = queue.next_due(free, running)
                assert due is None or due > clock.now, (op, free, states)
            for batch in batches:
                if op == "defer":
                    queue.leave([(e, e.ticks[0]) for e in batch.entries])
                elif op == "fail":
                    queue.put_back(batch.entries, failed=True)
        else:
            clock.now += 0.5 * (free + 1)
