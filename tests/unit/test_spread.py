"""`spread`: each job's ticks moved by an offset from its key alone, the same on every replica,
never doubling or dropping a tick at a DST change (docs/run-policies.md: Spread)."""

from __future__ import annotations

import textwrap
from datetime import UTC, datetime, timedelta

import pytest

from scheduler.config.schedules import Shifted, next_ticks, spread_offset, ticks_between
from scheduler.config.settings import JobConfig
from scheduler.registry.catalog import CatalogJob, build_trigger, schedule_text, trigger_of
from scheduler.registry.jobs import JobSpec

TEN_MINUTES = timedelta(minutes=10)


def job(key: int, **schedule: object) -> CatalogJob:
    spec = JobSpec(key=key, name=f"j{key}", func=lambda: None, takes_context=False,
                   is_async=False, source="t")  # fmt: skip
    grace = timedelta(seconds=30)
    return CatalogJob(spec=spec, schedule=JobConfig(**schedule), timezone="Europe/Berlin",
                      skip_threshold=3, fail_threshold=3, misfire_grace=grace)  # fmt: skip


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text).astimezone(UTC)


def test_the_offset_comes_from_the_key_alone_in_whole_seconds_below_the_spread():
    offsets = [spread_offset(key, TEN_MINUTES) for key in range(1, 501)]
    assert all(timedelta(0) <= o < TEN_MINUTES and o.microseconds == 0 for o in offsets)
    assert len(set(offsets)) > 250  # 500 hourly jobs no longer start on one second
    assert spread_offset(42, TEN_MINUTES) == spread_offset(42, TEN_MINUTES)
    # Fixed forever: a replica of another version must fire the same instants.
    assert spread_offset(1001, TEN_MINUTES) == timedelta(
        seconds=spread_offset(1001, TEN_MINUTES).seconds
    )


@pytest.mark.parametrize(
    ("cron", "after", "base"),
    [
        # Europe/Berlin, autumn 2026-10-25: 02:30 happens twice and runs once (the first).
        ("30 2 * * *", "2026-10-23T12:00:00Z",
         ["2026-10-24T00:30:00Z", "2026-10-25T00:30:00Z", "2026-10-26T01:30:00Z"]),
        # Spring 2026-03-29: 02:30 does not exist and runs right after the gap (03:00 CEST).
        ("30 2 * * *", "2026-03-27T12:00:00Z",
         ["2026-03-28T01:30:00Z", "2026-03-29T01:00:00Z", "2026-03-30T00:30:00Z"]),
        # Hourly across the repeated hour: every real hour, once.
        ("0 * * * *", "2026-10-24T23:30:00Z",
         ["2026-10-25T00:00:00Z", "2026-10-25T01:00:00Z", "2026-10-25T02:00:00Z",
          "2026-10-25T03:00:00Z"]),
    ],
)  # fmt: skip
def test_a_spread_moves_each_dst_tick_once_and_keeps_their_order(cron, after, base):
    spread = job(7001, cron=cron, spread="10m")
    offset = spread_offset(7001, TEN_MINUTES)
    ticks = next_ticks(spread.trigger, utc(after), len(base))
    assert ticks == [utc(t) + offset for t in base]
    unspread = next_ticks(
        build_trigger(JobConfig(cron=cron), "Europe/Berlin"), utc(after), len(base)
    )
    assert unspread == [utc(t) for t in base]


def test_every_replica_computes_the_same_instants_and_writes_the_same_schedule():
    one, other = job(9, interval="1h", spread="10m"), job(9, interval="1h", spread="10m")
    after = utc("2026-11-30T00:00:00Z")
    assert next_ticks(one.trigger, after, 5) == next_ticks(other.trigger, after, 5)
    text = schedule_text(one)
    assert text == schedule_text(other) and '"offset":' in text
    # What the sweep and `status` read back from a replica's registration.
    assert next_ticks(trigger_of(text), after, 5) == next_ticks(one.trigger, after, 5)
    assert '"offset"' not in schedule_text(job(9, interval="1h"))  # unchanged without


def test_jobs_on_one_grid_with_a_spread_fire_apart_and_the_sweep_finds_their_ticks():
    a, b = job(1, interval="1h", spread="10m"), job(2, interval="1h", spread="10m")
    assert a.schedule_key != b.schedule_key  # each its own APScheduler job, its own instant
    assert isinstance(a.trigger, Shifted)
    after, until = utc("2026-11-30T00:00:00Z"), utc("2026-11-30T12:00:00Z")
    computed = ticks_between(a.trigger, after, until, 100)
    walked = [t for t in next_ticks(a.trigger, after, 20) if t <= until]
    assert computed == walked and len(computed) == 12
    assert "spread 10m (+" in a.describe()


def test_jobs_next_shows_the_moved_ticks(run, tmp_path):
    (tmp_path / "config.yaml").write_text(
        textwrap.dedent("""
        jobs:
          sync:
            interval: 1h
            spread: 10m
          report:
            cron: "0 2 * * *"
        """)
    )
    code, out, _ = run("jobs", "sync", "--next", "2", "--after", "2026-11-30T00:00:00Z")
    offset = spread_offset(2001, TEN_MINUTES)
    first = utc("2026-11-30T01:00:00Z") + offset
    assert code == 0 and "spread 10m (+" in out and first.isoformat() in out


@pytest.mark.parametrize(
    ("value", "expect"),
    [("0s", "longer than zero"), ("2d", "between 1 s and 1 day"),
     ("1.5", "whole seconds"), ("soon", "expected a duration")],
)  # fmt: skip
def test_a_bad_spread_is_one_line_naming_it(run, tmp_path, value, expect):
    (tmp_path / "config.yaml").write_text(
        f"jobs:\n  sync:\n    interval: 1h\n    spread: {value}\n"
    )
    code, _, err = run("check")
    assert code == 2 and "jobs.sync.spread" in err and expect in err and err.count("\n") == 1
