"""Schedules: `interval` and `cron` from config.yaml turned into APScheduler triggers.

Every replica must compute the same ticks: interval grids are anchored at a
fixed instant (the Unix epoch, or the job's ``start``), never at the moment a
replica started, and no trigger ever gets APScheduler's random jitter.

Ticks are aware UTC instants, and every walk over them steps in UTC and only
forward: local wall-clock times repeat at DST changes, UTC instants never do.
Cron is evaluated by cronsim, which does at DST changes what Debian's cron
does: a job at a specific time (minute and hour fields both not starting with
`*`) runs a repeated local time once, at its first occurrence, and a time in
the skipped hour once, right after the gap; every other job follows the local
wall clock in real time.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import re
from abc import abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime, timedelta, tzinfo
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from apscheduler.triggers.base import BaseTrigger
from cronsim import CronSim, CronSimError

log = logging.getLogger("scheduler.schedules")

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_DURATION = re.compile(
    r"^(?:(?P<d>\d+)d)?(?:(?P<h>\d+)h)?(?:(?P<m>\d+)m)?(?:(?P<s>\d+(?:\.\d+)?)s)?$"
)
_MICROSECOND = timedelta(microseconds=1)
# Cron minutes that map to instants already passed, in a row. Legitimate only
# while a walk that starts inside a repeated hour passes its first occurrence
# (an hour or two of minutes); far more means the engine is stuck.
_STALL_LIMIT = 10_000
_EXPECTED = "expected {}, in lists a,b, ranges low-high and steps */n or low-high/n"
# Field names as cronsim reports them, with what each accepts.
_FIELDS = {
    "second": "0-59",
    "minute": "0-59",
    "hour": "0-23",
    "day-of-month": "1-31",
    "month": "1-12 or jan-dec",
    "day-of-week": "0-7 or sun-sat, 0 and 7 both Sunday",
}


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


class Schedule(BaseTrigger):  # type: ignore[misc]  # APScheduler ships no types
    """An APScheduler trigger whose ticks can also be listed, in UTC and in order."""

    __slots__ = ()

    @abstractmethod
    def ticks_after(self, instant: datetime) -> Iterator[datetime]:
        """Every tick strictly after `instant`, strictly increasing, as aware UTC datetimes."""

    def get_next_fire_time(
        self, previous_fire_time: datetime | None, now: datetime
    ) -> datetime | None:
        """APScheduler's contract: the first tick at or after min(now, previous + 1 µs).

        As APScheduler's own triggers, never the previous tick again when `now`
        is that tick (its loops would fire it forever).
        """
        start = now.astimezone(UTC)
        if previous_fire_time is not None:
            previous = previous_fire_time.astimezone(UTC)
            if previous == datetime.max.replace(tzinfo=UTC):
                return None
            start = min(start, previous + _MICROSECOND)
            if start == previous:
                start += _MICROSECOND
        return self.first_after(start - _MICROSECOND)

    def first_after(self, instant: datetime) -> datetime | None:
        return next(iter(self.ticks_after(instant)), None)


class CronSchedule(Schedule):
    """A cron expression in a time zone: five fields, or six with seconds first.

    cronsim evaluates the five fields from the minute on (a 6-field expression
    follows the DST rule its minute and hour fields decide, as a 5-field one
    would); the seconds field then fills each minute that matches.
    """

    __slots__ = ("_minutes", "_seconds", "expr", "timezone")

    def __init__(self, expr: str, tz: tzinfo) -> None:
        fields = expr.split()
        if len(fields) not in (5, 6):
            raise ValueError(f"expected 5 fields (or 6 with seconds first), found {len(fields)}")
        self.expr = " ".join(fields)
        self.timezone = tz
        self._minutes = " ".join(fields[-5:])
        _check_fields(self._minutes)
        self._seconds = _seconds(fields[0]) if len(fields) == 6 else (0,)
        if next(iter(self.ticks_after(EPOCH)), None) is None:
            raise ValueError("never fires: no date matches its day-of-month, month and day-of-week")

    def ticks_after(self, instant: datetime) -> Iterator[datetime]:
        instant = instant.astimezone(UTC)
        last, stalled = instant, 0
        try:
            # A minute whose last listed second is after `instant` may still hold a tick.
            begin = (instant - timedelta(seconds=self._seconds[-1])).astimezone(self.timezone)
            for minute in CronSim(self._minutes, begin):
                base = minute.astimezone(UTC)
                advanced = False
                for second in self._seconds:
                    tick = base + timedelta(seconds=second)
                    if tick > last:
                        yield tick
                        last, advanced = tick, True
                # Walking from inside a repeated hour, cronsim first lists that hour's
                # first occurrence, already past (a job at a specific time ran then).
                stalled = 0 if advanced else stalled + 1
                if stalled > _STALL_LIMIT:
                    log.error(
                        "cron %r (%s): no tick after %s; stopped", self.expr, self.timezone, last
                    )
                    return
        except OverflowError:  # the end (or the start) of datetime's range: no more ticks
            return

    def __str__(self) -> str:
        return f"cron[{self.expr!r}, {self.timezone}]"

    __repr__ = __str__


class IntervalGrid(Schedule):
    """Ticks at anchor + k * every (k >= 0), in exact microseconds, never past year 9999."""

    __slots__ = ("_step", "anchor", "every")

    def __init__(self, every: timedelta, anchor: datetime) -> None:
        if every < _MICROSECOND:
            raise ValueError("must be longer than zero")
        self.every = every
        self.anchor = anchor.astimezone(UTC)
        self._step = every // _MICROSECOND

    def _index_after(self, instant: datetime) -> int:
        """The first k whose tick is strictly after `instant`."""
        elapsed = (instant.astimezone(UTC) - self.anchor) // _MICROSECOND
        return max(0, elapsed // self._step + 1)

    def _tick(self, index: int) -> datetime | None:
        try:
            return self.anchor + timedelta(microseconds=index * self._step)
        except OverflowError:
            return None

    def first_after(self, instant: datetime) -> datetime | None:
        return self._tick(self._index_after(instant))

    def ticks_after(self, instant: datetime) -> Iterator[datetime]:
        for index in itertools.count(self._index_after(instant)):
            tick = self._tick(index)
            if tick is None:
                return
            yield tick

    def latest(self, after: datetime, until: datetime, limit: int) -> list[datetime]:
        """The latest `limit` ticks in (after, until], computed, not walked."""
        if until < self.anchor:
            return []
        last = ((until.astimezone(UTC) - self.anchor) // _MICROSECOND) // self._step
        first = max(self._index_after(after), last - limit + 1)
        return [t for t in (self._tick(k) for k in range(first, last + 1)) if t is not None]

    def __str__(self) -> str:
        return f"interval[{format_duration(self.every)}, from {self.anchor.isoformat()}]"

    __repr__ = __str__


class Shifted(Schedule):
    """Another schedule's ticks, each moved later by one fixed offset (`spread`).

    The offset is added to the instants the schedule computes, DST rules
    applied: each tick of the schedule gives exactly one tick here, in the
    same order, so a spread can neither double nor drop a tick.
    """

    __slots__ = ("base", "offset")

    def __init__(self, base: Schedule, offset: timedelta) -> None:
        self.base = base
        self.offset = offset

    def ticks_after(self, instant: datetime) -> Iterator[datetime]:
        for tick in self.base.ticks_after(instant - self.offset):
            try:
                yield tick + self.offset
            except OverflowError:
                return

    def latest(self, after: datetime, until: datetime, limit: int) -> list[datetime] | None:
        if not isinstance(self.base, IntervalGrid):
            return None
        found = self.base.latest(after - self.offset, until - self.offset, limit)
        return [tick + self.offset for tick in found]

    def __str__(self) -> str:
        return f"{self.base} +{format_duration(self.offset) if self.offset else '0s'}"

    __repr__ = __str__


def spread_offset(key: int, spread: timedelta) -> timedelta:
    """Where in [0, spread) a job's ticks fall: whole seconds from the job's key alone.

    The same on every replica and in every version (a SHA-256 of the key, not
    Python's per-process hash), so every replica fires the same instants.
    """
    seconds = int(spread.total_seconds())
    if seconds < 1:
        return timedelta(0)
    digest = hashlib.sha256(f"scheduler-spread:{key}".encode()).digest()
    return timedelta(seconds=int.from_bytes(digest[:8], "big") % seconds)


def _check_fields(expr: str) -> None:
    """A ValueError naming the field at fault, or nothing."""
    try:
        CronSim(expr, EPOCH)
    except CronSimError as exc:
        values = dict(zip(list(_FIELDS)[1:], expr.split(), strict=True))
        name = str(exc).removeprefix("Bad ")
        if name not in values:
            raise ValueError(f"not a cron expression ({exc})") from None
        if name == "day-of-month" and _parses(" ".join({**values, "month": "*"}.values())):
            raise ValueError(
                f"never fires: day-of-month {values['day-of-month']!r} does not occur"
                f" in month {values['month']!r}"
            ) from None
        raise ValueError(
            f"bad {name} field {values[name]!r}: {_EXPECTED.format(_FIELDS[name])}"
        ) from None


def _parses(expr: str) -> bool:
    try:
        CronSim(expr, EPOCH)
    except CronSimError:
        return False
    return True


def _seconds(field: str) -> tuple[int, ...]:
    """The seconds a 6-field expression's first field lists, read by cronsim itself."""
    minute_start = datetime(2001, 1, 1, tzinfo=UTC)
    try:
        ticks = CronSim(f"{field} 0 0 1 1 *", minute_start - timedelta(seconds=1))
    except CronSimError:
        raise ValueError(
            f"bad second field {field!r}: {_EXPECTED.format(_FIELDS['second'])}"
        ) from None
    end = minute_start + timedelta(minutes=1)
    return tuple(t.second for t in itertools.takewhile(lambda t: t < end, ticks))


def cron_trigger(expr: str, tz: tzinfo) -> CronSchedule:
    """Five fields (minute first) or six (seconds first), as Debian's cron reads them.

    Day-of-month and day-of-week are ORed when neither starts with `*`, else
    ANDed; weekday 0 or 7 is Sunday; names (sun-sat, jan-dec) in any case.
    """
    return CronSchedule(expr, tz)


def interval_trigger(every: timedelta, start: datetime | None) -> IntervalGrid:
    return IntervalGrid(every, start if start is not None else EPOCH)


def _ticks(trigger: BaseTrigger, instant: datetime) -> Iterator[datetime]:
    """Ticks strictly after `instant`, in UTC; each must be later than the one before."""
    instant = instant.astimezone(UTC)
    if isinstance(trigger, Schedule):
        found: Iterable[datetime] = trigger.ticks_after(instant)
    else:
        found = _stepped(trigger, instant)
    previous = instant
    for tick in found:
        if tick <= previous:
            log.error("schedule %s: tick %s is not after %s; stopped", trigger, tick, previous)
            return
        yield tick
        previous = tick


def _stepped(trigger: BaseTrigger, instant: datetime) -> Iterator[datetime]:
    """Any other APScheduler trigger, asked for each next tick from a UTC instant."""
    tick = trigger.get_next_fire_time(None, instant + _MICROSECOND)
    while tick is not None:
        tick = tick.astimezone(UTC)
        yield tick
        tick = trigger.get_next_fire_time(None, tick + _MICROSECOND)


def next_tick(trigger: BaseTrigger, now: datetime) -> datetime | None:
    """The first tick at or after `now` (what APScheduler fires next)."""
    tick = trigger.get_next_fire_time(None, now)
    return tick.astimezone(UTC) if tick is not None else None


def tick_after(trigger: BaseTrigger, instant: datetime) -> datetime | None:
    """The first tick strictly after `instant`."""
    return next(_ticks(trigger, instant), None)


def next_ticks(trigger: BaseTrigger, after: datetime, n: int) -> list[datetime]:
    """The next `n` ticks strictly after `after`, in UTC."""
    return list(itertools.islice(_ticks(trigger, after), max(n, 0)))


def ticks_between(
    trigger: BaseTrigger, after: datetime, until: datetime, limit: int
) -> list[datetime]:
    """The latest `limit` ticks in (after, until]: what should have fired.

    Looks back through a growing window from `until`, so a one-second job
    that was down for days costs about `limit` steps, not a step per second;
    an interval grid computes them directly.
    """
    after, until = after.astimezone(UTC), until.astimezone(UTC)
    if limit < 1 or until <= after:
        return []
    if isinstance(trigger, IntervalGrid):
        return trigger.latest(after, until, limit)
    if (
        isinstance(trigger, Shifted)
        and (computed := trigger.latest(after, until, limit)) is not None
    ):
        return computed
    window = timedelta(minutes=1)
    while True:
        since = after if window >= until - after else until - window
        latest: deque[datetime] = deque(maxlen=limit)
        for tick in itertools.takewhile(lambda t: t <= until, _ticks(trigger, since)):
            latest.append(tick)
        if len(latest) >= limit or since == after:
            return list(latest)
        window *= 8
