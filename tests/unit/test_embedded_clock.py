"""A stepped wall clock: said when seen, and never a tick recorded missed before it is due."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

from scheduler.config.settings import Settings
from scheduler.fleet.housekeeping import MISSED_MARGIN, Housekeeping
from scheduler.ledger.history import TickFilter, history
from scheduler.ledger.job_states import job_states, track_jobs
from scheduler.ledger.registrations import register
from scheduler.registry.catalog import Catalog, schedule_text
from tests.support import make_job
from tests.unit.embedded_helpers import replica


class Clocks:
    """A wall clock and a monotonic one that a test moves apart."""

    def __init__(self) -> None:
        self.wall_s, self.monotonic_s = 1_800_000_000.0, 100.0

    def wall(self) -> float:
        return self.wall_s

    def monotonic(self) -> float:
        return self.monotonic_s

    def run(self, seconds: float, step: float = 0.0) -> None:
        self.monotonic_s += seconds
        self.wall_s += seconds + step


def test_a_clock_step_is_said_once_with_what_it_does_to_ticks(tmp_path, caplog):
    clocks = Clocks()
    a = replica(tmp_path, "a", wall=clocks.wall, monotonic=clocks.monotonic)
    caplog.set_level(logging.WARNING, logger="scheduler.clock")
    try:
        a.keep_once()
        clocks.run(0.5)
        a.keep_once()
        assert not caplog.records  # a slew is no step
        clocks.run(0.5, step=-3600)
        a.keep_once()
        clocks.run(0.5)
        a.keep_once()
        (said,) = [r.getMessage() for r in caplog.records]
        assert "stepped back by 3600 s" in said
        assert "up to 3600 s with no run" in said
        caplog.clear()
        clocks.run(0.5, step=600)
        a.keep_once()
        (said,) = [r.getMessage() for r in caplog.records]
        assert "stepped forward by 600 s" in said and "recorded missed" in said
    finally:
        a.close()


def test_the_sweep_never_records_a_tick_missed_before_it_is_due_by_the_ledgers_clock(tmp_path):
    now = datetime.now(UTC).replace(microsecond=0)
    job = make_job(631, lambda ctx: None, name="steady")  # 1 s interval, 30 s grace
    a = replica(tmp_path, "a", connect=False, clock=lambda: now)
    keeper = Housekeeping(a, Catalog((job,)), Settings(instance_name="hk"))
    track_jobs(a.ledger_engine, [(631, "steady", "every 1s")], now - timedelta(hours=1))
    with a.ledger_engine.begin() as conn:  # its schedule, in force (scheduler.fleet.due)
        register(conn, "a", [(631, "steady", schedule_text(job))], set(), now - timedelta(hours=1))
    ahead = now + timedelta(hours=1)  # a sweep's `now` from a clock that was an hour ahead
    with a.ledger_engine.begin() as conn:
        keeper.sweep_missed(conn, job_states(conn), now - timedelta(seconds=60), ahead)
    with a.ledger_engine.connect() as conn:
        recorded = [row.scheduled_at for row in history(conn, TickFilter(631))]
    assert recorded, "the ticks that were due are recorded"
    assert max(recorded) <= now - job.missed_after - MISSED_MARGIN
    a.ledger_engine.dispose()
