"""Every replica must compute the same ticks, and cron must mean what cron means."""

from __future__ import annotations

import itertools
import logging
import re
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from apscheduler.triggers.base import BaseTrigger

from scheduler.config.schedules import (
    cron_trigger,
    format_duration,
    interval_trigger,
    next_ticks,
    parse_duration,
    tick_after,
    ticks_between,
)
from scheduler.config.settings import JobConfig
from scheduler.registry.catalog import build_trigger


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


def test_cron_ticks_are_aware_utc_instants():
    trigger = cron_trigger("0 2 * * *", ZoneInfo("Europe/Berlin"))
    tick = trigger.get_next_fire_time(None, datetime(2026, 11, 29, 12, 0, tzinfo=UTC))
    assert tick.utcoffset() == timedelta(0)
    assert next_ticks(trigger, tick, 2) == [tick + timedelta(days=1), tick + timedelta(days=2)]
    assert tick_after(trigger, tick - timedelta(microseconds=1)) == tick
    assert tick_after(trigger, tick) == tick + timedelta(days=1)


def test_get_next_fire_time_keeps_apschedulers_contract():
    # The first tick at or after min(now, previous + 1 µs); never `previous` again.
    trigger = cron_trigger("*/10 * * * * *", UTC)
    t = datetime(2026, 11, 29, 10, 0, 0, tzinfo=UTC)
    assert trigger.get_next_fire_time(None, t) == t
    assert trigger.get_next_fire_time(None, t + timedelta(microseconds=1)) == t + timedelta(
        seconds=10
    )
    assert trigger.get_next_fire_time(t, t) == t + timedelta(seconds=10)
    # APScheduler catching up after a pause: the tick after the previous one, not after now.
    assert trigger.get_next_fire_time(t, t + timedelta(minutes=5)) == t + timedelta(seconds=10)
    grid = build_trigger(JobConfig(interval="10s"), "UTC")
    assert grid.get_next_fire_time(t, t) == t + timedelta(seconds=10)
    assert grid.get_next_fire_time(t, t + timedelta(minutes=5)) == t + timedelta(seconds=10)
    assert grid.get_next_fire_time(None, t) == t


@pytest.mark.parametrize(
    ("expr", "weekdays"),
    [
        ("0 9 * * 0", [6]),
        ("0 9 * * 7", [6]),
        ("0 9 * * SUN", [6]),
        ("0 9 * * Sun", [6]),
        ("0 9 * * mon-fri", [0, 1, 2, 3, 4]),
        ("0 9 * * 1-7", [0, 1, 2, 3, 4, 5, 6]),
        ("0 9 * * 5-7", [4, 5, 6]),
        ("0 9 * JAN-dec *", [0, 1, 2, 3, 4, 5, 6]),
    ],
)
def test_cron_names_in_any_case_and_sunday_as_0_or_7(expr, weekdays):
    start = datetime(2026, 11, 28, 12, 0, tzinfo=UTC)  # a Saturday
    fired = ticks_between(cron_trigger(expr, UTC), start, start + timedelta(days=7), limit=10)
    assert sorted(t.weekday() for t in fired) == weekdays


def test_cron_day_fields_are_anded_when_either_starts_with_a_star():
    start = datetime(2026, 11, 25, tzinfo=UTC)
    # */2 starts with a star: odd days that are also Mondays (Nov 2026: 2, 9, 16, 23, 30).
    fired = ticks_between(cron_trigger("0 0 */2 * mon", UTC), start, start + timedelta(days=60), 10)
    assert [t.date().isoformat() for t in fired] == ["2026-12-07", "2026-12-21", "2027-01-11"]
    # Neither starts with a star: the 1st, the 15th, and every Monday.
    fired = ticks_between(cron_trigger("0 0 1,15 * 1", UTC), start, start + timedelta(days=14), 10)
    assert [t.date().isoformat() for t in fired] == ["2026-11-30", "2026-12-01", "2026-12-07"]


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        ("0 0 30 2 *", "never fires: day-of-month '30' does not occur in month '2'"),
        ("0 0 31 4 *", "never fires: day-of-month '31' does not occur in month '4'"),
        ("0 0 30,31 feb *", "never fires"),
        ("0 25 * * *", "bad hour field '25': expected 0-23,"),
        ("61 * * * *", "bad minute field '61'"),
        ("0 0 * * 8", "bad day-of-week field '8'"),
        ("0 0 * 13 *", "bad month field '13'"),
        ("60 * * * * *", "bad second field '60'"),
        ("0 0 * * * * *", "expected 5 fields (or 6 with seconds first), found 7"),
    ],
)
def test_cron_errors_name_the_field(expr, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        cron_trigger(expr, UTC)


def test_leap_day_is_not_never():
    trigger = cron_trigger("0 0 29 2 *", ZoneInfo("Europe/Berlin"))
    assert tick_after(trigger, datetime(2026, 1, 1, tzinfo=UTC)) == datetime(
        2028, 2, 28, 23, 0, tzinfo=UTC
    )


@pytest.mark.parametrize(
    "every",
    [
        timedelta(microseconds=1),
        timedelta(microseconds=7),
        timedelta(milliseconds=1),
        timedelta(days=3650),
        timedelta(days=3_000_000),
        timedelta.max,
    ],
    ids=str,
)
def test_interval_grids_of_any_size_stay_bounded(every):
    trigger = interval_trigger(every, None)
    now = datetime(2026, 11, 29, 10, 0, 0, 123457, tzinfo=UTC)
    ticks = ticks_between(trigger, now - timedelta(days=30), now, limit=100)
    assert len(ticks) <= 100 and all(t <= now for t in ticks)
    if every <= timedelta(milliseconds=1):
        assert len(ticks) == 100 and ticks[-1] > now - every
        assert all(b - a == every for a, b in itertools.pairwise(ticks))
    else:
        assert ticks == []
    upcoming = next_ticks(trigger, now, 5)
    first = tick_after(trigger, now)
    assert upcoming[:1] == ([first] if first else [])
    assert all(t > now for t in upcoming)
    assert all(b - a == every for a, b in itertools.pairwise(upcoming))
    if every > timedelta(days=4000):  # beyond year 9999: no tick, and no error
        assert upcoming == [] and first is None
        assert trigger.get_next_fire_time(None, now) is None


def test_interval_grid_end_of_time_is_no_error():
    trigger = interval_trigger(timedelta(days=1), None)
    last = datetime(9999, 12, 31, tzinfo=UTC)
    assert next_ticks(trigger, last - timedelta(days=2), 5) == [last - timedelta(days=1), last]
    assert tick_after(trigger, last) is None
    assert trigger.get_next_fire_time(last, last) is None
    end = datetime.max.replace(tzinfo=UTC)
    assert ticks_between(trigger, end - timedelta(days=3), end, 10)[-1] == last


class Stuck(BaseTrigger):
    """A trigger that keeps answering the same instant."""

    def get_next_fire_time(self, previous_fire_time, now):
        return datetime(2026, 11, 29, 10, 0, tzinfo=UTC)


def test_a_trigger_that_does_not_advance_stops_the_walk_with_an_error(caplog):
    start = datetime(2026, 11, 29, 9, 0, tzinfo=UTC)
    with caplog.at_level(logging.ERROR, logger="scheduler.schedules"):
        ticks = ticks_between(Stuck(), start, start + timedelta(hours=2), limit=100)
    assert ticks == [datetime(2026, 11, 29, 10, 0, tzinfo=UTC)]
    assert "is not after" in caplog.text
    assert next_ticks(Stuck(), start, 5) == ticks


@pytest.mark.parametrize(
    ("expr", "dates"),
    [
        ("0 0 L * *", ["2026-01-31", "2026-02-28"]),
        ("0 0 LW * *", ["2026-01-30", "2026-02-27"]),
        ("0 0 * * 5L", ["2026-01-30", "2026-02-27"]),
        ("0 0 * * 5#2", ["2026-01-09", "2026-02-13"]),
    ],
)
def test_cronsim_extensions(expr, dates):
    ticks = next_ticks(cron_trigger(expr, UTC), datetime(2026, 1, 1, tzinfo=UTC), 2)
    assert [t.date().isoformat() for t in ticks] == dates


@pytest.mark.parametrize("expr", ["* * * * *", "*/20 * * * * *", "0 0 * * *"])
def test_cron_at_the_end_of_time_is_no_error(expr):
    trigger = cron_trigger(expr, ZoneInfo("Pacific/Kiritimati"))  # UTC+14
    end = datetime.max.replace(tzinfo=UTC)
    late = next_ticks(trigger, end - timedelta(days=3), 20_000)
    assert 0 < len(late) < 20_000 and late[-1] <= end
    assert all(a < b for a, b in itertools.pairwise(late))
    assert tick_after(trigger, end - timedelta(seconds=1)) is None
    assert ticks_between(trigger, end - timedelta(days=3), end, 5) == late[-5:]
