"""Schedules: `interval` and `cron` from config.yaml turned into APScheduler triggers.

Every replica must compute the same ticks: interval grids are anchored at a
fixed instant (the Unix epoch, or the job's ``start``), never at the moment a
replica started, and no trigger ever gets APScheduler's random jitter.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta, tzinfo
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from apscheduler.triggers.base import BaseTrigger
from apscheduler.triggers.combining import OrTrigger
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_DURATION = re.compile(
    r"^(?:(?P<d>\d+)d)?(?:(?P<h>\d+)h)?(?:(?P<m>\d+)m)?(?:(?P<s>\d+(?:\.\d+)?)s)?$"
)
_DAYS = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"]


def parse_duration(value: object) -> timedelta:
    """`90s`, `5m`, `1h30m`, `1d`, or a number of seconds; must be positive."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 90s, 5m, 1h30m, 1d or a number of seconds")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and value.strip():
        text = value.strip().replace(" ", "")
        try:
            seconds = float(text)
        except ValueError:
            match = _DURATION.fullmatch(text)
            if not match or not any(match.groupdict().values()):
                raise ValueError(
                    "expected a duration such as 90s, 5m, 1h30m, 1d or a number of seconds"
                ) from None
            parts = {k: float(v) if v else 0.0 for k, v in match.groupdict().items()}
            seconds = parts["d"] * 86400 + parts["h"] * 3600 + parts["m"] * 60 + parts["s"]
    else:
        raise ValueError("expected a duration such as 90s, 5m, 1h30m, 1d or a number of seconds")
    if not seconds > 0:
        raise ValueError("must be longer than zero")
    return timedelta(seconds=seconds)


def format_duration(delta: timedelta) -> str:
    seconds = delta.total_seconds()
    if seconds != int(seconds):
        return f"{seconds:g}s"
    out, rest = "", int(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if rest >= size:
            out += f"{rest // size}{unit}"
            rest %= size
    return out


def zone(name: str) -> tzinfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(
            "unknown time zone (expected an IANA name such as Europe/Berlin)"
        ) from None


def _cron_days(field: str) -> str:
    """Standard cron weekdays (0 or 7 = Sunday) as APScheduler 3 names.

    APScheduler 3 numbers weekdays from Monday = 0; cron numbers them from
    Sunday = 0. Spelling the set out as names removes the ambiguity.
    """
    days: set[int] = set()
    for item in field.lower().split(","):
        base, _, step_text = item.partition("/")
        step = int(step_text) if step_text.isdigit() and int(step_text) > 0 else None
        if step_text and step is None:
            raise ValueError(f"bad step in day-of-week {item!r}")
        if base == "*":
            low, high = 0, 6
        else:
            ends = base.split("-")
            if len(ends) > 2:
                raise ValueError(f"bad day-of-week {item!r}")
            numbers = [_day_number(end) for end in ends]
            low, high = numbers[0], numbers[-1]
            if step is not None and len(ends) == 1:
                high = 6
        if high < low:
            if high == 0:  # mon-sun written as 1-7 or mon-sun
                high = 7
            else:
                raise ValueError(f"bad day-of-week range {item!r}")
        days.update(day % 7 for day in range(low, high + 1, step or 1))
    if days == set(range(7)):
        return "*"
    return ",".join(_DAYS[d] for d in sorted(days))


def _day_number(text: str) -> int:
    if text in _DAYS:
        return _DAYS.index(text)
    if text.isdigit() and 0 <= int(text) <= 7:
        return int(text)
    raise ValueError(f"bad day-of-week {text!r} (expected 0-7 or sun-sat)")


def cron_trigger(expr: str, tz: tzinfo) -> BaseTrigger:
    """Five fields (minute first) or six (seconds first), with cron's semantics.

    As in cron, when both day-of-month and day-of-week are restricted, a tick
    fires when either matches.
    """
    fields = expr.split()
    if len(fields) not in (5, 6):
        raise ValueError(f"expected 5 fields (or 6 with seconds first), found {len(fields)}")
    second = fields.pop(0) if len(fields) == 6 else "0"
    minute, hour, day, month, weekday = fields
    weekday = _cron_days(weekday)
    common = {"second": second, "minute": minute, "hour": hour, "month": month, "timezone": tz}
    if day != "*" and weekday != "*":
        return OrTrigger(
            [CronTrigger(day=day, **common), CronTrigger(day_of_week=weekday, **common)]
        )
    return CronTrigger(day=day, day_of_week=weekday, **common)


def interval_trigger(every: timedelta, start: datetime | None) -> IntervalTrigger:
    anchor = start if start is not None else EPOCH
    return IntervalTrigger(seconds=every.total_seconds(), start_date=anchor, timezone=UTC)


def next_tick(trigger: BaseTrigger, now: datetime) -> datetime | None:
    return trigger.get_next_fire_time(None, now)


def ticks_between(
    trigger: BaseTrigger, after: datetime, until: datetime, limit: int
) -> list[datetime]:
    """The latest `limit` ticks in (after, until]: what should have fired.

    Looks back through a growing window from `until`, so a one-second job
    that was down for days costs `limit` steps, not a step per second.
    """
    window = timedelta(minutes=1)
    while True:
        since = max(after, until - window)
        ticks: list[datetime] = []
        tick = trigger.get_next_fire_time(None, since + timedelta(microseconds=1))
        while tick is not None and tick <= until:
            if tick > since:
                ticks.append(tick)
            tick = trigger.get_next_fire_time(tick, tick + timedelta(microseconds=1))
        if len(ticks) >= limit or since == after:
            return ticks[-limit:] if limit else []
        window *= 8
