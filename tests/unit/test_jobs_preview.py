"""`scheduler jobs [JOB] --next N [--after ISO-8601] [--json]`: the ticks before they happen."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from scheduler.cli.commands import main

JOBS = """
from scheduler import job

@job(key=1001)
def close_invoices(ctx):
    pass

@job(key=1002, name="nightly-report")
def report(ctx):
    pass

@job(key=1003)
def half_hourly(ctx):
    pass

@job(key=1004)
def by_hand(ctx):
    pass

@job(key=1005)
def dormant(ctx):
    pass
"""

CONFIG = """
scheduler:
  timezone: Europe/Berlin
jobs:
  close_invoices:
    interval: 30m
    timezone: UTC
  nightly-report:
    cron: "30 2 * * *"
  half_hourly:
    cron: "*/30 * * * *"
  dormant:
    cron: "0 3 * * *"
    enabled: false
"""


@pytest.fixture
def run(tmp_path: Path, capsys, monkeypatch):
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "billing.py").write_text(textwrap.dedent(JOBS))
    (tmp_path / "config.yaml").write_text(textwrap.dedent(CONFIG))
    for var in [v for v in os.environ if v.startswith("SCHEDULER_")]:
        monkeypatch.delenv(var)

    def run(*args: str) -> tuple[int, str, str]:
        code = main(["jobs", "--config", str(tmp_path / "config.yaml"), *args])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def by_name(out: str) -> dict[str, dict]:
    return {row["name"]: row for row in json.loads(out)}


def test_json_lists_the_next_ticks_in_each_jobs_local_time(run):
    code, out, err = run("--next", "3", "--after", "2026-10-25T00:00:00+02:00", "--json")
    assert (code, err) == (0, "")
    rows = by_name(out)
    assert rows["nightly-report"]["next_ticks"] == [
        "2026-10-25T02:30:00+02:00",  # the first 02:30 of the autumn day, and not the second
        "2026-10-26T02:30:00+01:00",
        "2026-10-27T02:30:00+01:00",
    ]
    assert rows["half_hourly"]["next_ticks"] == [
        "2026-10-25T00:30:00+02:00",
        "2026-10-25T01:00:00+02:00",
        "2026-10-25T01:30:00+02:00",
    ]
    assert rows["close_invoices"]["next_ticks"] == [
        "2026-10-24T22:30:00+00:00",
        "2026-10-24T23:00:00+00:00",
        "2026-10-24T23:30:00+00:00",
    ]
    assert rows["by_hand"]["next_ticks"] == [] and rows["dormant"]["next_ticks"] == []
    for row in rows.values():
        assert row["next_tick"] == (row["next_ticks"][0] if row["next_ticks"] else None)
        assert {"name", "key", "schedule", "timezone", "enabled", "source"} <= set(row)


def test_after_without_an_offset_is_read_in_the_timezone_setting(run):
    _, with_offset, _ = run("--next", "2", "--after", "2026-10-25T00:00:00+02:00", "--json")
    code, without, err = run("--next", "2", "--after", "2026-10-25T00:00:00", "--json")
    assert (code, err) == (0, "")
    assert without == with_offset
    _, utc, _ = run("--next", "2", "--after", "2026-10-25T00:00:00Z", "--json")
    assert by_name(utc)["half_hourly"]["next_ticks"] == [
        "2026-10-25T02:30:00+02:00",
        "2026-10-25T02:00:00+01:00",
    ]


def test_text_shows_one_block_per_job_with_local_times(run):
    code, out, err = run("half_hourly", "--next", "5", "--after", "2026-10-25T01:45:00+02:00")
    assert (code, err) == (0, "")
    assert "half_hourly" in out and "nightly-report" not in out and "close_invoices" not in out
    local = [line.split()[0] for line in out.splitlines() if line.startswith("  ")]
    assert local == [
        "2026-10-25T02:00:00+02:00",
        "2026-10-25T02:30:00+02:00",
        "2026-10-25T02:00:00+01:00",
        "2026-10-25T02:30:00+01:00",
        "2026-10-25T03:00:00+01:00",
    ]
    code, out, _ = run("--next", "1", "--after", "2026-10-25T00:00:00+02:00")
    assert code == 0
    for name in ("close_invoices", "nightly-report", "half_hourly", "by_hand", "dormant"):
        assert name in out
    assert "2026-10-25T02:30:00+02:00" in out


def test_the_next_json_of_one_job(run):
    code, out, _ = run("nightly-report", "--next", "1", "--after", "2026-03-29T00:00:00", "--json")
    assert code == 0
    # In the skipped spring hour: once, right after the gap.
    assert [row["next_ticks"] for row in json.loads(out)] == [["2026-03-29T03:00:00+02:00"]]


def test_without_next_the_listing_is_unchanged(run):
    code, out, _ = run("--json")
    assert code == 0
    rows = json.loads(out)
    assert len(rows) == 5
    for row in rows:
        assert set(row) == {"name", "key", "schedule", "timezone", "enabled", "next_tick", "source"}


def test_unknown_job_exits_2_with_one_line(run):
    code, out, err = run("nightly", "--next", "3")
    assert (code, out) == (2, "")
    assert err == "scheduler: no job named 'nightly' (see `scheduler jobs`)\n"


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--next", "0"], ["--next", "'0'", "1 to 1000"]),
        (["--next", "-2"], ["--next", "'-2'"]),
        (["--next", "three"], ["--next", "'three'"]),
        (["--next", "1001"], ["--next", "'1001'", "1 to 1000"]),
        (["--next", "3", "--after", "tomorrow"], ["--after", "'tomorrow'", "ISO-8601"]),
        (["--next", "3", "--after", "2026-13-01T00:00"], ["--after", "'2026-13-01T00:00'"]),
        (["--next", "3", "--after", "0001-01-01T00:00+05:00"], ["--after", "out of range"]),
        (["--next", "3", "--after", "0001-01-01T00:00"], ["--after", "out of range"]),
        (["--next", "3", "--after", "9999-12-31T23:59:59"], ["--after", "out of range"]),
        (["--next", "\u00b2"], ["--next", "1 to 1000"]),
        (["--next", "9" * 5000], ["--next", "1 to 1000"]),
    ],
)
def test_bad_values_exit_2_with_one_line(run, args, fragments):
    code, out, err = run(*args)
    assert (code, out) == (2, "")
    assert err.startswith("scheduler: ") and err.count("\n") == 1 and "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in {err!r}"
