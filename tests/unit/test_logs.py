"""Run lines are built by the log writer thread, stamped with the moment of the event."""

from __future__ import annotations

import io
import json
import logging
from datetime import UTC, datetime

import pytest

from scheduler import logs
from scheduler.observers import events
from scheduler.observers.runlog import RunLog


@pytest.fixture
def captured():
    stream = io.StringIO()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield stream
    logs.stop_logging()
    root.handlers[:] = handlers
    root.setLevel(level)


def started(run_id: int) -> events.RunStarted:
    return events.RunStarted(
        job="report",
        key=7,
        scheduled_at=datetime(2026, 1, 1, 12, 0, tzinfo=UTC),
        run_id=run_id,
        instance="r1",
        lateness_s=0.012,
        manual=False,
        crashed=0,
        skips_ended=0,
        ping_url=None,
    )


def test_json_run_lines_carry_the_events_fields_and_time(captured):
    logs.setup_logging("json", stream=captured)
    run_log = RunLog(structured=True)
    for run_id in range(1, 501):
        run_log(started(run_id))
    logging.getLogger("scheduler.test").warning("plain %s", "record")
    logs.stop_logging()  # writes out everything queued
    lines = [json.loads(line) for line in captured.getvalue().splitlines()]
    assert [line["run_id"] for line in lines[:500]] == list(range(1, 501))
    first = lines[0]
    assert first["message"].startswith("run started: report tick 2026-01-01T12:00:00+00:00")
    assert first["job"] == "report" and first["lateness_s"] == 0.012
    assert lines[-1]["message"] == "plain record" and lines[-1]["level"] == "warning"


def test_a_line_is_stamped_when_the_event_happened_not_when_written():
    logger = logging.getLogger("test.runs")
    logger.setLevel(logging.INFO)
    run_log = RunLog(logger, structured=True)
    (record,) = run_log.records(started(1), created=1_767_268_800.25)
    line = json.loads(logs.JsonFormatter().format(record))
    assert line["time"] == "2026-01-01T12:00:00.250+00:00"


def test_text_lines_without_the_writer_go_through_the_logger(caplog):
    caplog.set_level(logging.INFO, logger="scheduler.runs")
    RunLog()(started(3))
    assert caplog.messages == [
        "run started: report tick 2026-01-01T12:00:00+00:00 run_id 3 (0.012 s late)"
    ]
