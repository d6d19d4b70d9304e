"""`timeout`: a run past it is told (ctx.timed_out), a coroutine cancelled, the run recorded
failed when it returns, one job.timed_out notice (embedded backend, real timers of 1 s)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import select

from scheduler.config.settings import JobConfig
from scheduler.ledger import tables
from scheduler.ledger.history import TickFilter, history
from scheduler.observers import events
from scheduler.observers.metrics import Metrics
from scheduler.observers.notices import Notices
from tests.support import make_job, now_tick, settle


def with_timeout(key: int, func: Any, timeout: str = "1s"):
    job = make_job(key, func, name=f"t{key}")
    return replace(job, schedule=JobConfig(interval="1h", timeout=timeout))


@pytest.fixture
def gate(gate_over_file):
    gate, seen, _, backend = gate_over_file()
    return gate, seen, backend


def ran(gate, seen, job) -> events.RunFinished:
    gate.submit(job, now_tick(-1))
    settle(gate, lambda: seen.of(events.RunFinished), f"{job.name} to finish")
    (finished,) = seen.of(events.RunFinished)
    return finished


def test_a_thread_job_is_told_keeps_running_until_it_returns_and_is_recorded_failed(gate):
    gate, seen, backend = gate
    told = threading.Event()

    def careful(ctx) -> None:  # returns soon after being told
        if ctx.timed_out.wait(10):
            told.set()

    finished = ran(gate, seen, with_timeout(301, careful))
    assert told.is_set()
    assert (finished.status, finished.error) == ("failed", "timed out after 1s")
    (timed_out,) = seen.of(events.RunTimedOut)
    assert (timed_out.run_id, timed_out.timeout_s) == (finished.run_id, 1.0)
    with backend.ledger_engine.connect() as conn:
        (row,) = history(conn, TickFilter(301, limit=5))
    assert (row.status, row.error) == ("failed", "timed out after 1s")


def test_a_coroutine_job_is_cancelled(gate):
    gate, seen, _ = gate
    cancelled = threading.Event()

    async def slow(ctx) -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    finished = ran(gate, seen, with_timeout(302, slow))
    assert cancelled.is_set() and finished.duration_s < 20
    assert (finished.status, finished.error) == ("failed", "timed out after 1s")


def test_a_coroutine_that_swallows_its_cancellation_is_cancelled_again_until_it_ends(gate, caplog):
    """It keeps the job's lock while it goes on: cancelled again every second, said once."""
    gate, seen, _ = gate
    swallowed = []

    async def stubborn(ctx) -> None:
        while len(swallowed) < 3:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                swallowed.append(time.monotonic())

    with caplog.at_level(logging.WARNING):
        finished = ran(gate, seen, with_timeout(305, stubborn))
    assert len(swallowed) == 3 and finished.duration_s < 8
    assert 0.5 < swallowed[1] - swallowed[0] < 3
    assert (finished.status, finished.error) == ("failed", "timed out after 1s")
    said = [r.getMessage() for r in caplog.records if "cancelling it again" in r.getMessage()]
    assert said == ["cancelled after its timeout, it goes on: cancelling it again every second"]


def test_a_run_within_its_timeout_is_untouched(gate):
    gate, seen, _ = gate
    finished = ran(gate, seen, with_timeout(303, lambda ctx: None, timeout="30s"))
    assert finished.status == "succeeded" and not seen.of(events.RunTimedOut)


def test_a_time_out_raises_one_notice_and_counts(tmp_path, gate):
    _, _, backend = gate
    notices = Notices(backend.ledger_engine, "u1")
    metrics = Metrics()
    event = events.RunTimedOut("t304", 304, datetime.now(UTC), 17, "u1", 300.0)
    notices.run_timed_out(event)
    metrics(event)
    notices.close()
    with backend.ledger_engine.connect() as conn:
        (row,) = conn.execute(select(tables.notices)).all()
    assert (row.event, row.job_name, row.raised_by) == ("job.timed_out", "t304", "u1")
    assert '"timeout": "5m"' in row.facts and '"run_id": 17' in row.facts
    assert b'scheduler_job_timeouts_total{job="t304"} 1.0' in metrics.render()


@pytest.mark.parametrize("value", ["0s", "31d", "soon"])
def test_a_bad_timeout_is_one_line_naming_it(run, tmp_path, value):
    (tmp_path / "config.yaml").write_text(
        f"jobs:\n  sync:\n    interval: 1h\n    timeout: {value}\n"
    )
    code, _, err = run("check")
    assert code == 2 and "jobs.sync.timeout" in err and err.count("\n") == 1
