"""Cron at DST changes does what Debian's cron does, identically on every replica.

A job at a specific time (minute and hour fields both not starting with `*`)
runs its repeated autumn time once, at the first occurrence, and a tick in
the skipped spring hour once, right after the gap. Every other job follows the
local wall clock in real time. The tables give UTC instants, written out by
hand from the zones' calendars:

- Europe/Berlin (CET +1, CEST +2): 2026-03-29 01:00Z, 02:00 CET -> 03:00 CEST;
  2026-10-25 01:00Z, 03:00 CEST -> 02:00 CET (02:xx local at 00:xxZ and 01:xxZ).
- America/New_York (EST -5, EDT -4): 2026-03-08 07:00Z, 02:00 EST -> 03:00 EDT;
  2026-11-01 06:00Z, 02:00 EDT -> 01:00 EST (01:xx local at 05:xxZ and 06:xxZ).
- Australia/Sydney (AEST +10, AEDT +11): 2026-04-04 16:00Z, 03:00 AEDT -> 02:00
  AEST (02:xx local at 15:xxZ and 16:xxZ); 2026-10-03 16:00Z, 02:00 AEST -> 03:00 AEDT.
"""

from __future__ import annotations

import itertools
import threading
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from cronsim import CronSim

from scheduler.config.schedules import cron_trigger, next_ticks, tick_after, ticks_between

BERLIN, NEW_YORK, SYDNEY = "Europe/Berlin", "America/New_York", "Australia/Sydney"


def Z(text: str) -> datetime:
    """A UTC instant written as `YYYY-MM-DD HH:MM[:SS]`."""
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def test_the_transitions_are_where_the_tables_say():
    second = timedelta(seconds=1)
    for name, instant, before, after in [
        (BERLIN, "2026-03-29 01:00", 1, 2),
        (BERLIN, "2026-10-25 01:00", 2, 1),
        (NEW_YORK, "2026-03-08 07:00", -5, -4),
        (NEW_YORK, "2026-11-01 06:00", -4, -5),
        (SYDNEY, "2026-04-04 16:00", 11, 10),
        (SYDNEY, "2026-10-03 16:00", 10, 11),
    ]:
        tz = ZoneInfo(name)
        assert (Z(instant) - second).astimezone(tz).utcoffset() == timedelta(hours=before)
        assert Z(instant).astimezone(tz).utcoffset() == timedelta(hours=after)


# (zone, expression, after, the next ticks strictly after `after`, in UTC)
TABLE = [
    # Europe/Berlin, autumn: 02:00-02:59 local happens twice.
    (BERLIN, "30 2 * * *", "2026-10-24 23:00", ["2026-10-25 00:30", "2026-10-26 01:30"]),
    (BERLIN, "0 2 * * *", "2026-10-24 23:00", ["2026-10-25 00:00", "2026-10-26 01:00"]),
    (BERLIN, "30 2 * * *", "2026-10-25 00:45", ["2026-10-26 01:30"]),
    (BERLIN, "30 2 * * *", "2026-10-25 01:15", ["2026-10-26 01:30"]),
    (
        BERLIN,
        "0 1,2,3 * * *",
        "2026-10-24 22:30",
        ["2026-10-24 23:00", "2026-10-25 00:00", "2026-10-25 02:00", "2026-10-26 00:00"],
    ),
    (BERLIN, "0 0-23/2 * * *", "2026-10-24 23:00", ["2026-10-25 00:00", "2026-10-25 03:00"]),
    (
        BERLIN,
        "*/30 * * * *",
        "2026-10-24 23:00",
        [
            "2026-10-24 23:30",
            "2026-10-25 00:00",
            "2026-10-25 00:30",
            "2026-10-25 01:00",
            "2026-10-25 01:30",
            "2026-10-25 02:00",
        ],
    ),
    (
        BERLIN,
        "0 * * * *",
        "2026-10-24 23:30",
        ["2026-10-25 00:00", "2026-10-25 01:00", "2026-10-25 02:00", "2026-10-25 03:00"],
    ),
    (
        BERLIN,
        "0 */2 * * *",
        "2026-10-24 23:30",
        ["2026-10-25 00:00", "2026-10-25 01:00", "2026-10-25 03:00"],
    ),
    (
        BERLIN,
        "*/15 2 * * *",
        "2026-10-24 23:30",
        [
            "2026-10-25 00:00",
            "2026-10-25 00:15",
            "2026-10-25 00:30",
            "2026-10-25 00:45",
            "2026-10-25 01:00",
            "2026-10-25 01:15",
            "2026-10-25 01:30",
            "2026-10-25 01:45",
            "2026-10-26 01:00",
        ],
    ),
    (
        BERLIN,
        "*/20 30 2 * * *",
        "2026-10-24 23:00",
        ["2026-10-25 00:30:00", "2026-10-25 00:30:20", "2026-10-25 00:30:40", "2026-10-26 01:30"],
    ),
    (
        BERLIN,
        "0 */30 * * * *",
        "2026-10-25 00:15",
        ["2026-10-25 00:30", "2026-10-25 01:00", "2026-10-25 01:30", "2026-10-25 02:00"],
    ),
    # Europe/Berlin, spring: 02:00-02:59 local never happens.
    (BERLIN, "30 2 * * *", "2026-03-28 23:00", ["2026-03-29 01:00", "2026-03-30 00:30"]),
    (BERLIN, "0 2 * * *", "2026-03-28 23:00", ["2026-03-29 01:00", "2026-03-30 00:00"]),
    (
        BERLIN,
        "0 2,3 * * *",
        "2026-03-28 23:00",
        ["2026-03-29 01:00", "2026-03-30 00:00", "2026-03-30 01:00"],
    ),
    (BERLIN, "30 3 * * *", "2026-03-28 23:00", ["2026-03-29 01:30"]),
    (BERLIN, "0 0-23/2 * * *", "2026-03-28 23:30", ["2026-03-29 01:00", "2026-03-29 02:00"]),
    (
        BERLIN,
        "*/30 * * * *",
        "2026-03-28 23:00",
        [
            "2026-03-28 23:30",
            "2026-03-29 00:00",
            "2026-03-29 00:30",
            "2026-03-29 01:00",
            "2026-03-29 01:30",
        ],
    ),
    (
        BERLIN,
        "0 * * * *",
        "2026-03-28 23:30",
        ["2026-03-29 00:00", "2026-03-29 01:00", "2026-03-29 02:00"],
    ),
    (BERLIN, "0 */2 * * *", "2026-03-28 23:00", ["2026-03-29 02:00", "2026-03-29 04:00"]),
    (BERLIN, "*/15 2 * * *", "2026-03-28 23:00", ["2026-03-30 00:00"]),
    (
        BERLIN,
        "*/20 30 2 * * *",
        "2026-03-28 23:00",
        ["2026-03-29 01:00:00", "2026-03-29 01:00:20", "2026-03-29 01:00:40", "2026-03-30 00:30"],
    ),
    (BERLIN, "0 0 2,3 * * *", "2026-03-28 23:00", ["2026-03-29 01:00", "2026-03-30 00:00"]),
    # America/New_York, autumn: 01:00-01:59 local happens twice.
    (NEW_YORK, "30 1 * * *", "2026-11-01 04:00", ["2026-11-01 05:30", "2026-11-02 06:30"]),
    (
        NEW_YORK,
        "15 1-3 * * *",
        "2026-11-01 04:00",
        ["2026-11-01 05:15", "2026-11-01 07:15", "2026-11-01 08:15", "2026-11-02 06:15"],
    ),
    (
        NEW_YORK,
        "*/30 * * * *",
        "2026-11-01 04:00",
        [
            "2026-11-01 04:30",
            "2026-11-01 05:00",
            "2026-11-01 05:30",
            "2026-11-01 06:00",
            "2026-11-01 06:30",
            "2026-11-01 07:00",
        ],
    ),
    (
        NEW_YORK,
        "0 * * * *",
        "2026-11-01 04:30",
        ["2026-11-01 05:00", "2026-11-01 06:00", "2026-11-01 07:00"],
    ),
    # America/New_York, spring (2026-03-08 is a Sunday).
    (NEW_YORK, "30 2 * * *", "2026-03-08 06:00", ["2026-03-08 07:00", "2026-03-09 06:30"]),
    (
        NEW_YORK,
        "0 9,17 * * 1-5",
        "2026-03-06 00:00",
        ["2026-03-06 14:00", "2026-03-06 22:00", "2026-03-09 13:00", "2026-03-09 21:00"],
    ),
    (
        NEW_YORK,
        "*/30 * * * *",
        "2026-03-08 06:00",
        ["2026-03-08 06:30", "2026-03-08 07:00", "2026-03-08 07:30"],
    ),
    (NEW_YORK, "*/10 2 * * *", "2026-03-08 06:00", ["2026-03-09 06:00"]),
    # Australia/Sydney, autumn (April): 02:00-02:59 local happens twice.
    (SYDNEY, "30 2 * * *", "2026-04-04 14:00", ["2026-04-04 15:30", "2026-04-05 16:30"]),
    (
        SYDNEY,
        "0 * * * *",
        "2026-04-04 14:30",
        ["2026-04-04 15:00", "2026-04-04 16:00", "2026-04-04 17:00"],
    ),
    (SYDNEY, "0 2,3 * * *", "2026-04-04 14:30", ["2026-04-04 15:00", "2026-04-04 17:00"]),
    # Australia/Sydney, spring (October): 02:00-02:59 local never happens.
    (SYDNEY, "30 2 * * *", "2026-10-03 14:00", ["2026-10-03 16:00", "2026-10-04 15:30"]),
    (
        SYDNEY,
        "*/30 * * * *",
        "2026-10-03 14:00",
        [
            "2026-10-03 14:30",
            "2026-10-03 15:00",
            "2026-10-03 15:30",
            "2026-10-03 16:00",
            "2026-10-03 16:30",
        ],
    ),
    (SYDNEY, "0 0-23/2 * * *", "2026-10-03 15:00", ["2026-10-03 16:00", "2026-10-03 17:00"]),
]


@pytest.mark.parametrize(("zone", "expr", "after", "expected"), TABLE)
def test_ticks_around_dst_changes(zone, expr, after, expected):
    trigger = cron_trigger(expr, ZoneInfo(zone))
    ticks = next_ticks(trigger, Z(after), len(expected))
    assert [t.isoformat() for t in ticks] == [Z(e).isoformat() for e in expected]
    assert tick_after(trigger, Z(after)) == Z(expected[0])


def test_real_time_jobs_run_every_30_minutes_through_the_repeated_hour():
    trigger = cron_trigger("*/30 * * * *", ZoneInfo(BERLIN))
    local = [t.astimezone(ZoneInfo(BERLIN)) for t in next_ticks(trigger, Z("2026-10-24 23:59"), 4)]
    # From 02:00 CEST up to 03:00 CET: four runs, 30 real minutes apart.
    assert [t.isoformat() for t in local] == [
        "2026-10-25T02:00:00+02:00",
        "2026-10-25T02:30:00+02:00",
        "2026-10-25T02:00:00+01:00",
        "2026-10-25T02:30:00+01:00",
    ]


def _returns_within(seconds: float, call) -> object:
    """Run `call` in a thread: a hang fails the test instead of hanging the suite."""
    box: list[object] = []
    thread = threading.Thread(target=lambda: box.append(call()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"did not return within {seconds} s"
    return box[0]


@pytest.mark.parametrize(
    ("expr", "after", "until", "expected"),
    [
        ("30 2 * * *", "2026-10-25 01:29:55", "2026-10-25 01:30:25", []),
        ("30 2 * * *", "2026-10-25 00:29:55", "2026-10-25 01:30:25", ["2026-10-25 00:30"]),
        (
            "*/5 * * * *",
            "2026-10-25 00:52",
            "2026-10-25 01:08",
            ["2026-10-25 00:55", "2026-10-25 01:00", "2026-10-25 01:05"],
        ),
        (
            "0 * * * *",
            "2026-10-24 23:30",
            "2026-10-25 01:30",
            ["2026-10-25 00:00", "2026-10-25 01:00"],
        ),
    ],
)
def test_ticks_between_returns_promptly_in_the_repeated_hour(expr, after, until, expected):
    trigger = cron_trigger(expr, ZoneInfo(BERLIN))
    ticks = _returns_within(20, lambda: ticks_between(trigger, Z(after), Z(until), 100))
    assert ticks == [Z(e) for e in expected]


@pytest.mark.parametrize(
    "expr",
    ["*/30 * * * *", "*/5 * * * *", "0 * * * *", "*/15 2 * * *", "30 2 * * *", "*/10 * * * * *"],
)
def test_ticks_between_over_the_repeated_hour_lists_each_tick_once_in_order(expr):
    trigger = cron_trigger(expr, ZoneInfo(BERLIN))
    after, until = Z("2026-10-24 23:00"), Z("2026-10-25 03:00")
    ticks = _returns_within(20, lambda: ticks_between(trigger, after, until, 10_000))
    assert ticks, "no ticks at all"
    assert all(b > a for a, b in itertools.pairwise(ticks)), "not strictly increasing"
    assert all(after < t <= until and t.utcoffset() == timedelta(0) for t in ticks)
    # The same ticks as stepping forward one at a time.
    assert ticks == [t for t in next_ticks(trigger, after, len(ticks) + 5) if t <= until]
    # And the latest few when fewer are asked for.
    assert ticks_between(trigger, after, until, 3) == ticks[-3:]


def test_get_next_fire_time_steps_through_the_repeated_hour():
    """APScheduler's own loop: each fire time passed back as `previous_fire_time`."""
    trigger = cron_trigger("*/15 * * * *", ZoneInfo(BERLIN))
    now = Z("2026-10-25 00:50")
    fired = [trigger.get_next_fire_time(None, now)]
    while len(fired) < 6:
        fired.append(trigger.get_next_fire_time(fired[-1], fired[-1]))
    assert fired == [
        Z(f"2026-10-25 {t}") for t in ("01:00", "01:15", "01:30", "01:45", "02:00", "02:15")
    ]


# Oracle: cronsim iterated from well before each start (6 h: an unambiguous
# local time), with each UTC instant kept once. For 6-field expressions with a fixed
# minute and hour, the 5-field part gives the minutes and the seconds listed
# here fill them; other 6-field expressions are cronsim's own.
FIVE_FIELDS = [
    "30 2 * * *",
    "0 2 * * *",
    "59 1 * * *",
    "0 0 * * *",
    "0 9,17 * * 1-5",
    "0 0-23/2 * * *",
    "15,45 1-3 * * *",
    "0 2,3 * * *",
    "0 3 * * 0",
    "0 2 * * SUN",
    "0 2 1,29 * sun",
    "5 1 * 3,10,11 *",
    "*/30 * * * *",
    "0 * * * *",
    "0 */2 * * *",
    "*/15 2 * * *",
    "* * * * *",
    "*/7 * * * *",
    "5 * * * *",
    "* 2 * * *",
    "*/20 1-3 * * *",
    "0 */3 * * 1-5",
]
FIXED_SIX_FIELDS = {  # expression: the seconds its first field lists
    "*/20 30 2 * * *": [0, 20, 40],
    "0 0 2,3 * * *": [0],
    "15 0 0-23/2 * * *": [15],
    "10-12 59 1 * * *": [10, 11, 12],
}
REAL_TIME_SIX_FIELDS = ["30 */15 * * * *", "*/10 * 2 * * *", "0 0 */2 * * *", "*/20 * * * * *"]
CHANGES = {
    BERLIN: ["2026-03-29 01:00", "2026-10-25 01:00"],
    NEW_YORK: ["2026-03-08 07:00", "2026-11-01 06:00"],
    SYDNEY: ["2026-04-04 16:00", "2026-10-03 16:00"],
}
STARTS = [
    (zone, Z(change) + timedelta(minutes=13 * k, seconds=seconds))
    for zone, changes in CHANGES.items()
    for change in changes
    for k in range(-12, 13)
    for seconds in (0, 7)
]


def _oracle(
    expr: str, zone: str, after: datetime, n: int, seconds: list[int] | None, lookback: timedelta
) -> list[datetime]:
    tz = ZoneInfo(zone)
    out: list[datetime] = []
    for tick in CronSim(expr, (after - lookback).astimezone(tz)):
        base = tick.astimezone(UTC)
        for s in seconds or [0]:
            instant = base + timedelta(seconds=s)
            if instant > after and (not out or instant > out[-1]):
                out.append(instant)
        if len(out) >= n:
            return out[:n]
    return out


def _compare(
    expr: str,
    oracle_expr: str,
    seconds: list[int] | None = None,
    lookback: timedelta = timedelta(hours=6),
) -> None:
    mismatches = []
    for zone, after in STARTS:
        got = next_ticks(cron_trigger(expr, ZoneInfo(zone)), after, 8)
        want = _oracle(oracle_expr, zone, after, 8, seconds, lookback)
        if got != want:
            mismatches.append(
                (
                    zone,
                    after.isoformat(),
                    [t.isoformat() for t in got],
                    [t.isoformat() for t in want],
                )
            )
    assert not mismatches, f"{expr}: {len(mismatches)} mismatch(es), first: {mismatches[0]}"


@pytest.mark.parametrize("expr", FIVE_FIELDS)
def test_five_fields_match_cronsim(expr):
    _compare(expr, expr)


@pytest.mark.parametrize("expr", list(FIXED_SIX_FIELDS))
def test_six_fields_at_a_specific_time_follow_the_five_field_rule(expr):
    _compare(expr, " ".join(expr.split()[1:]), FIXED_SIX_FIELDS[expr])


@pytest.mark.parametrize("expr", REAL_TIME_SIX_FIELDS)
def test_six_fields_in_real_time_match_cronsim(expr):
    # cronsim steps 6-field expressions in UTC (never the wall-clock quirk), so
    # the walk may start shortly before: every second of it costs a step.
    _compare(expr, expr, lookback=timedelta(minutes=10))


def test_every_replica_computes_the_same_instants():
    """Where a replica starts looking (inside the fold or not) changes nothing."""
    trigger = cron_trigger("30 2 * * *", ZoneInfo(BERLIN))
    starts = [Z("2026-10-24 20:00") + timedelta(seconds=97 * k) for k in range(200)]
    firsts = {tuple(next_ticks(trigger, s, 2)) for s in starts if s < Z("2026-10-25 00:30")}
    assert firsts == {(Z("2026-10-25 00:30"), Z("2026-10-26 01:30"))}
    later = {tick_after(trigger, s) for s in starts if s >= Z("2026-10-25 00:30")}
    assert later == {Z("2026-10-26 01:30")}
