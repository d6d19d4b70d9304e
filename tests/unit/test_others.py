"""Other replicas' shares of a fired tick, held whole until one probe (scheduler/gate/others.py)
and then helped with through the tick queue (scheduler/gate/ticks.py)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from scheduler.backends.base import Intent
from scheduler.backends.shares import SHARE_FROM, Shape, share_of
from scheduler.gate.others import (
    HELD_MAX,
    HELP_AFTER,
    HELPERS,
    LAG_MAX,
    PROBE_MAX,
    PROBES_PER_TICK,
    Others,
    help_part,
    patience,
)
from scheduler.gate.runs import Running
from scheduler.gate.ticks import TickQueue
from tests.support import FakeMonotonic, make_job

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
JOBS = [make_job(key, lambda ctx: None, name=f"j{key}") for key in range(100, 160)]
SHAPE = Shape(live=3, rank=1, db_now=T0, read_at=0.0)
OWN = {job.key for job in JOBS if share_of(job.key, 3) == 1}
PATIENT = [replace(job, misfire_grace=timedelta(days=1)) for job in JOBS]  # never past grace


def tick(n: int) -> datetime:
    return T0 + timedelta(seconds=n)


def offered(queue: TickQueue, free: int = 100) -> list[tuple[int, datetime, Intent]]:
    batches = queue.take(free, lambda key: Running.NOT)
    return [(r.job.key, r.tick, r.intent) for b in batches for r in b.requests]


def test_a_replica_that_knows_no_fleet_offers_every_tick():
    others = Others()
    assert others.split(JOBS, None) == (JOBS, ())
    assert others.split(JOBS, Shape(1, 0, T0, 0.0)) == (JOBS, ())


def test_the_split_is_the_servers_share_rule_and_follows_the_shape():
    others = Others()
    own, theirs = others.split(JOBS, SHAPE)
    assert {job.key for job in own} == OWN and 0 < len(OWN) < len(JOBS)
    assert {job.key for job in theirs} == {job.key for job in JOBS} - OWN
    own2, _ = others.split(JOBS, Shape(live=2, rank=0, db_now=T0, read_at=0.0))
    assert {job.key for job in own2} == {job.key for job in JOBS if share_of(job.key, 2) == 0}
    fewer = JOBS[:SHARE_FROM]  # another schedule: a split of its own, not the one remembered
    own3, theirs3 = others.split(fewer, SHAPE)
    assert {job.key for job in own3} == OWN & {job.key for job in fewer}
    assert len(own3) + len(theirs3) == SHARE_FROM


def test_a_schedule_of_fewer_jobs_than_a_shared_burst_is_every_replicas_to_claim():
    """The server shares out bursts of SHARE_FROM ticks or more; a smaller one goes to the
    first replica that claims it, so each replica offers all of it at once, as before."""
    fewer = JOBS[: SHARE_FROM - 1]
    assert Others().split(fewer, SHAPE) == (fewer, ())


def test_only_the_own_share_is_queued_and_the_rest_is_held_until_its_probe():
    clock = FakeMonotonic()
    queue = TickQueue(clock)
    queue.add(JOBS, tick(0), SHAPE)
    assert {key for key, _, _ in offered(queue)} == OWN
    assert queue.unowned() == []  # not yet anyone's
    assert queue.next_due(0, lambda key: Running.NOT) == clock.now + HELP_AFTER
    clock.now += HELP_AFTER
    (record,) = queue.unowned()
    assert {job.key for job in record.jobs} == {job.key for job in JOBS} - OWN
    assert record.tick == tick(0) and queue.unowned() == [] and len(queue) == 0


def test_only_the_ticks_the_probe_found_untaken_are_queued_to_help_with():
    clock = FakeMonotonic()
    queue = TickQueue(clock)
    queue.add(JOBS, tick(0), SHAPE)
    offered(queue)
    clock.now += HELP_AFTER
    (record,) = queue.unowned()
    untaken = record.jobs[:3]
    queue.help([(job, record.tick, record.since) for job in untaken])
    assert offered(queue) == [(job.key, tick(0), Intent.RUN) for job in untaken]
    assert len(queue) == 0


def test_a_tick_helped_with_keeps_the_older_one_of_its_job_that_waits():
    clock = FakeMonotonic()
    queue = TickQueue(clock)
    theirs = next(job for job in JOBS if job.key not in OWN)
    queue.add([theirs], tick(0))  # before the fleet was known: queued as any tick
    (batch,) = queue.take(0 + 1, lambda key: Running.NOT)
    queue.leave([(batch.entries[0], tick(0))], others=True)  # yielded to its owner
    queue.help([(theirs, tick(1), clock.now)])  # its next tick, found untaken
    assert offered(queue) == [(theirs.key, tick(0), Intent.RUN)]
    assert offered(queue) == [(theirs.key, tick(1), Intent.RUN)]


def test_a_reload_drops_held_ticks_of_jobs_no_longer_scheduled_and_close_forgets_them():
    clock = FakeMonotonic()
    queue = TickQueue(clock)
    queue.add(JOBS, tick(0), SHAPE)
    offered(queue)
    kept = {job.key: job for job in JOBS[:10]}
    queue.refresh(kept.get)
    clock.now += HELP_AFTER
    (record,) = queue.unowned()
    assert {job.key for job in record.jobs} == set(kept) - OWN
    queue.add(JOBS, tick(1), SHAPE)
    queue.close()
    clock.now += HELP_AFTER
    assert queue.unowned() == [] and len(queue) == 0


def test_records_held_are_bounded_and_a_probe_takes_a_bounded_number_of_ticks():
    others = Others()
    for n in range(HELD_MAX + 5):  # the lock session is down: nothing is probed
        others.hold(PATIENT, tick(n), float(n))
    assert len(others) == HELD_MAX  # the oldest went first
    probes = []
    while due := others.due(2e3):
        probes.append(due)
    assert probes[0][0].tick == tick(5)
    assert all(sum(len(r.jobs) for r in due) <= PROBE_MAX for due in probes)
    # The first budget's worth (the last record over it goes while any budget is left).
    assert sum(len(due) for due in probes) == -(-PROBE_MAX // len(PATIENT))
    assert others.next_due() is None  # no budget left: nothing wakes the dispatcher
    others.hold(PATIENT, tick(HELD_MAX + 5), 1e9)  # a tick fires: budget for twice its size
    assert sum(len(due) for due in iter(lambda: others.due(2e3), [])) == PROBES_PER_TICK
    big = PATIENT * (PROBE_MAX // len(PATIENT) + 1)  # one record over the bound still goes
    others = Others()
    others.hold(big, tick(0), 0.0)
    assert len(others.due(2e3)) == 1


def test_a_backlog_of_held_ticks_drains_at_a_rate_the_ticks_fired_set():
    """However many records wait (the fleet behind), a replica probes at most
    PROBES_PER_TICK ticks for each one it holds as it fires, beyond a first budget: ticks
    held again after a probe bring none, so probing never outgrows the ticks coming in."""
    others = Others()
    for n in range(HELD_MAX):
        others.hold(PATIENT, tick(n), 0.0)
    while others.due(2e3):  # the first budget
        pass
    probed = 0
    for n in range(50):  # a tick a second fires; everything probed is found untaken
        others.hold(PATIENT, tick(HELD_MAX + n), float(n))
        for record in others.due(2e3):
            probed += len(record.jobs)
            others.hold_again([(job, record.tick, 0.0) for job in record.jobs], float(n))
    # As much as the ticks fired allow, within a record (the one that overdraws).
    assert abs(probed - 50 * PROBES_PER_TICK * len(PATIENT)) <= len(PATIENT)


def test_a_replica_behind_on_its_own_share_waits_longer_before_probing_others():
    """Its own fresh ticks offered late: other replicas' owners are likely as late, so
    their ticks are probed that much later (at most LAG_MAX more); the lag is forgotten
    as time passes without a late tick."""
    assert patience(0.0) == HELP_AFTER and patience(-1.0) == HELP_AFTER
    assert patience(1.5) == HELP_AFTER + 1.5 and patience(1e6) == HELP_AFTER + LAG_MAX
    clock = FakeMonotonic()
    queue = TickQueue(clock)
    queue.add(PATIENT, tick(0), SHAPE)
    clock.now += 2.0  # the dispatcher comes to them 2 s after they fired
    offered(queue)
    queue.add(PATIENT, tick(1), SHAPE)
    fired = clock.now
    assert queue.next_due(0, lambda key: Running.NOT) == clock.now + HELP_AFTER  # the tick 0 record
    clock.now += HELP_AFTER
    (old,) = queue.unowned()  # held since 2 s ago: due with any patience up to 2 s
    assert old.tick == tick(0)
    assert queue.unowned() == []  # tick 1: 2 s of lag, less what passed, not waited yet
    clock.now = fired + 1.0  # 1 s of lag left: due 1.2 s after it fired
    assert queue.unowned() == []
    clock.now = fired + 1.2  # 0.8 s of lag left: due 1.0 s after it fired
    (record,) = queue.unowned()
    assert record.tick == tick(1)
    offered(queue)  # tick 1's own, late
    queue.add(PATIENT, tick(2), SHAPE)
    offered(queue)  # on time: no lag
    clock.now += HELP_AFTER
    (record,) = queue.unowned()
    assert record.tick == tick(2)


def test_each_replica_helps_with_its_part_of_what_owners_left_and_holds_the_rest_again():
    """Owners late or gone: each of the other live replicas takes HELPERS times its part
    of the untaken ticks at once (all of them in a fleet of three or fewer); the rest are
    held again and probed once more, so that an overloaded fleet does not multiply its
    work by its size, and no tick is let go."""
    assert help_part(7, None) == 7
    assert help_part(7, Shape(3, 0, T0, 0.0)) == 7
    assert help_part(100, Shape(11, 0, T0, 0.0)) == 100 * HELPERS // 10
    assert help_part(1, Shape(100, 0, T0, 0.0)) == 1
    clock = FakeMonotonic()
    queue = TickQueue(clock)
    rest = [(job, tick(0), clock.now) for job in JOBS[:5]]
    queue.hold_again(rest)
    assert queue.unowned() == []
    clock.now += HELP_AFTER
    (record,) = queue.unowned()
    assert (list(record.jobs), record.tick) == (JOBS[:5], tick(0))


def test_however_far_behind_a_replica_probes_a_tick_within_half_its_grace():
    """Past its grace a tick helped with is only recorded missed: a replica however far
    behind probes other replicas' ticks by half their shortest grace (a frozen owner's
    ticks still run), and its lag waits only up to that."""
    short = [replace(job, misfire_grace=timedelta(seconds=2)) for job in JOBS]
    clock = FakeMonotonic()
    queue = TickQueue(clock)
    queue.add(short, tick(0), SHAPE)
    clock.now += 4.0  # 4 s behind on its own share
    offered(queue)
    queue.add(short, tick(1), SHAPE)
    fired = clock.now
    queue.unowned()  # tick 0's record
    assert queue.next_due(0, lambda key: Running.NOT) == fired + 1.0
    clock.now = fired + 1.0
    (record,) = queue.unowned()
    assert record.tick == tick(1) and record.grace == 2.0
    queue.add(JOBS, tick(2), SHAPE)  # a grace of 30 s: the lag's whole wait
    clock.now += 1.0  # 2 s of lag left: due 2.2 s after it fired
    assert queue.unowned() == []
    clock.now += 1.0  # 1 s left: due 1.2 s after
    (record,) = queue.unowned()
    assert record.tick == tick(2) and record.grace == 30.0


def test_ticks_held_past_their_grace_are_let_go_unprobed():
    """A tick fired longer ago than its grace would only be recorded missed by a claim,
    as the sweep records it: a replica far behind (or back after a cut) does not spend
    its budget on such ticks, and probes the ones still due first."""
    others = Others()
    for n in range(40):
        others.hold(JOBS, tick(n), float(n))  # a grace of 30 s
    due = others.due(45.0)
    assert [record.tick for record in due] == [tick(n) for n in range(15, 40)]
    others.hold_again([(job, tick(20), 20.0) for job in JOBS], 45.0)  # fired at 20
    assert others.due(45.1) == []  # held again: waits from its probe
    assert others.due(50.5) == []  # fired 30.5 s ago: let go
    assert len(others) == 0


def test_a_replica_on_time_with_ticks_deferred_is_not_taken_for_behind():
    """A busy replica always has ticks of its own deferred for lack of workers; when the
    job's next tick comes they go together. The lag is how late the newest ticks were
    offered, not how long a deferred one waited: a replica on time probes on time."""
    clock = FakeMonotonic()
    queue = TickQueue(clock)
    queue.add(JOBS, tick(0), SHAPE)
    (batch,) = queue.take(1, lambda key: Running.NOT)
    queue.leave([(entry, tick(0)) for entry in batch.entries])  # deferred: no free worker
    clock.now += 1.0
    queue.unowned()  # tick 0's record
    queue.add(JOBS, tick(1), SHAPE)  # each own job's deferred tick joins its new one
    offered_now = {r.tick for b in queue.take(100, lambda key: Running.NOT) for r in b.requests}
    assert offered_now == {tick(0)}  # the oldest first; the new one waits behind its run
    clock.now += HELP_AFTER
    (record,) = queue.unowned()
    assert record.tick == tick(1)
