"""Every replica must compute the same ticks, and cron must mean what cron means."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from scheduler.catalog import build_trigger
from scheduler.config import JobConfig
from scheduler.schedules import (
    cron_trigger,
    format_duration,
    parse_duration,
    ticks_between,
)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90s", 90),
        ("5m", 300),
        ("1h30m", 5400),
        ("1d", 86400),
        (45, 45),
        ("2.5", 2.5),
        ("1d2h3m4s", 93784),
    ],
)
def test_durations(text, seconds):
    assert parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["5x", "", "m", "-5", 0, "1h-5m", True])
def test_bad_durations(text):
    with pytest.raises(ValueError):
        parse_duration(text)


def test_format_duration_round_trips():
    for text in ("90s", "5m", "1h30m", "1d"):
        assert parse_duration(format_duration(parse_duration(text))) == parse_duration(text)


def test_interval_ticks_are_anchored_at_the_epoch_not_at_start_up():
    trigger = build_trigger(JobConfig(interval="7s"), "UTC")
    now = datetime(2026, 11, 29, 10, 0, 3, 123456, tzinfo=UTC)
    tick = trigger.get_next_fire_time(None, now)
    assert tick.timestamp() % 7 == 0
    # A replica started a moment later computes the same tick.
    assert trigger.get_next_fire_time(None, now + (tick - now) / 2) == tick
    assert trigger.get_next_fire_time(None, tick) == tick


def test_interval_ticks_can_be_anchored_at_start():
    trigger = build_trigger(JobConfig(interval="1h", start="2026-01-01T00:15:00"), "Europe/Berlin")
    tick = trigger.get_next_fire_time(None, datetime(2026, 11, 29, 10, 0, tzinfo=UTC))
    assert (tick.minute, tick.second) == (15, 0)
    assert tick.astimezone(UTC) == datetime(2026, 11, 29, 10, 15, tzinfo=UTC)


def test_cron_weekdays_follow_cron_not_apscheduler():
    # In cron, 1 is Monday and 0 (or 7) is Sunday.
    trigger = cron_trigger("0 9 * * 1", UTC)
    saturday = datetime(2026, 11, 28, 12, 0, tzinfo=UTC)
    assert trigger.get_next_fire_time(None, saturday).date().isoformat() == "2026-11-30"
    for sunday in ("0 9 * * 0", "0 9 * * 7", "0 9 * * sun"):
        tick = cron_trigger(sunday, UTC).get_next_fire_time(None, saturday)
        assert tick.weekday() == 6
    weekdays = cron_trigger("0 9 * * 1-5", UTC)
    fired = ticks_between(weekdays, saturday, saturday + timedelta(days=7), limit=10)
    assert [t.weekday() for t in fired] == [0, 1, 2, 3, 4]
    every_other = cron_trigger("0 9 * * */2", UTC)
    fired = ticks_between(every_other, saturday, saturday + timedelta(days=7), limit=10)
    assert sorted(t.weekday() for t in fired) == [1, 3, 5, 6]  # tue thu sat sun


def test_cron_day_of_month_or_weekday_like_cron():
    trigger = cron_trigger("0 0 1 * mon", UTC)
    start = datetime(2026, 11, 25, tzinfo=UTC)
    fired = ticks_between(trigger, start, start + timedelta(days=14), limit=10)
    assert [t.date().isoformat() for t in fired] == ["2026-11-30", "2026-12-01", "2026-12-07"]


def test_six_fields_means_seconds_first():
    trigger = cron_trigger("*/15 * * * * *", UTC)
    start = datetime(2026, 11, 29, 10, 0, 1, tzinfo=UTC)
    fired = ticks_between(trigger, start, start + timedelta(minutes=1), limit=10)
    assert [t.second for t in fired[:4]] == [15, 30, 45, 0]


def test_cron_in_a_time_zone():
    trigger = cron_trigger("0 2 * * *", ZoneInfo("Europe/Berlin"))
    tick = trigger.get_next_fire_time(None, datetime(2026, 11, 29, 12, 0, tzinfo=UTC))
    assert tick.astimezone(UTC) == datetime(2026, 11, 30, 1, 0, tzinfo=UTC)


def test_ticks_between_is_bounded_and_cheap_over_long_gaps():
    trigger = build_trigger(JobConfig(interval="1s"), "UTC")
    until = datetime(2026, 11, 29, tzinfo=UTC)
    ticks = ticks_between(trigger, until - timedelta(days=30), until, limit=100)
    assert len(ticks) == 100 and ticks[-1] == until
    assert ticks[0] == until - timedelta(seconds=99)
