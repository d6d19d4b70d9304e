"""What `scheduler.daemon` relies on in APScheduler 3 beyond its public API (the reasons
are in docs/architecture.md, "APScheduler"). A release that changes any of it fails here,
before the fleet's bursts fragment or a tick is held back by APScheduler's instance limit."""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

from apscheduler.executors.base import BaseExecutor
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.schedulers.base import BaseScheduler

from scheduler.daemon import GateScheduler, _add_group
from scheduler.registry.catalog import CatalogJob
from tests.unit.test_schedule_groups import job

WAIT = 10.0  # seconds; each wait ends as soon as the scheduler's thread has done its pass


class BurstGate:
    """Records each tick with the burst it came in (0: none)."""

    def __init__(self) -> None:
        self.bursts = 0
        self.open = 0
        self.seen: list[tuple[str, datetime, int]] = []
        self.changed = threading.Condition()

    def submit_all(self, jobs: list[CatalogJob], tick: datetime) -> None:
        with self.changed:
            self.seen.append((jobs[0].name, tick, self.bursts if self.open else 0))
            self.changed.notify_all()

    @contextlib.contextmanager
    def burst(self) -> Iterator[None]:
        self.bursts += 1
        self.open += 1
        try:
            yield
        finally:
            self.open -= 1

    def wait_for(self, count: int) -> list[tuple[str, datetime, int]]:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.seen) >= count, WAIT), self.seen
            return list(self.seen)


def started(gate: BurstGate, names: list[str], due: datetime) -> GateScheduler:
    groups = {name: [job(name, key, interval=f"{key}s")] for key, name in enumerate(names, 1)}
    scheduler = GateScheduler(gate, groups, timezone=UTC)
    for name, group in groups.items():
        _add_group(scheduler, name, group, next_run_time=due)
    scheduler.start()
    return scheduler


def test_the_hooks_keep_their_names_and_shapes():
    assert list(inspect.signature(BaseScheduler._process_jobs).parameters) == ["self"]
    assert BackgroundScheduler._process_jobs is BaseScheduler._process_jobs
    assert list(inspect.signature(BaseExecutor.submit_job).parameters) == [
        "self",
        "job",
        "run_times",
    ]
    assert BaseExecutor.__abstractmethods__ == frozenset({"_do_submit_job"})


def test_one_pass_hands_every_due_job_over_inside_one_burst_one_tick_each():
    gate = BurstGate()
    now = datetime.now(UTC)
    scheduler = started(gate, ["a", "b", "c"], now - timedelta(minutes=10))
    try:
        seen = gate.wait_for(3)
    finally:
        scheduler.shutdown(wait=False)
    assert sorted(name for name, _, _ in seen) == ["a", "b", "c"]  # coalesced: one each
    assert {burst for _, _, burst in seen} == {1}  # the first pass, whole, inside the burst
    for _, tick, _ in seen:  # the latest tick due, however late (no misfire grace)
        assert now - timedelta(seconds=3) <= tick <= datetime.now(UTC)


def test_a_tick_reaches_the_gate_while_the_jobs_earlier_one_is_still_out():
    gate = BurstGate()
    past = datetime.now(UTC) - timedelta(minutes=1)
    scheduler = started(gate, ["a"], past)
    try:
        gate.wait_for(1)  # never reported done: APScheduler would count it running
        scheduler.modify_job("a", next_run_time=past)  # due again at once (max_instances=1)
        seen = gate.wait_for(2)
    finally:
        scheduler.shutdown(wait=False)
    assert [name for name, _, _ in seen] == ["a", "a"]
