"""One parser for each kind of value a person or a client hands in.

The page's query, the API's and the command line's flags all read their values
here, so a kind of value is accepted, bounded and refused the same way
everywhere: `Refused`, one line that names the field and the value (the page
answers 400, a command exits 2). Only ASCII digits are digits (`str.isdigit`
takes "²" and "٣"); a number is read only up to a length `int()` handles at
once; an instant only between `EARLIEST` and `LATEST`, so no arithmetic on it
can overflow. Nothing here touches the database.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from datetime import UTC, datetime, timedelta, tzinfo
from urllib.parse import quote

from scheduler.config.schedules import format_duration, parse_duration, zone
from scheduler.config.settings import INSTANCE_NAME
from scheduler.errors import ConfigError, shorten

EARLIEST = datetime(1970, 1, 1, tzinfo=UTC)
LATEST = datetime(3000, 1, 1, tzinfo=UTC)
MAX_ID = 2**63 - 1  # a ledger id is a BIGINT
MAX_PATH = 500  # characters of a path to go to after logging in
ISO_EXAMPLE = "an ISO-8601 date and time such as 2026-10-25T01:30:00+01:00"
AGE_EXAMPLE = "an age such as 12h or 30m"
_WHOLE = re.compile(r"[0-9]{1,30}")
_AGE = re.compile(r"[0-9][0-9.dhms]*[dhms]")  # the shape of 12h, 1h30m, 2d, 1.5s
_MAX_INSTANT = 64  # characters of an ISO-8601 instant, at most
# Characters a path keeps as they are when it goes into a Location header: the rest is
# percent-encoded (as UTF-8), so the header is ASCII whatever the path was.
_PATH_SAFE = "/?=&%#:@!$'()*+,;~-._"


class Refused(ConfigError):
    """A value refused: one line naming the field and the value."""


def shown(text: str) -> str:
    """A value as a message repeats it: quoted, escaped, cut short."""
    return repr(shorten(text))


def whole(text: str, field: str, low: int, high: int) -> int:
    """A whole number from `low` to `high`, in ASCII digits."""
    value = text.strip()
    if _WHOLE.fullmatch(value) is None or not low <= int(value) <= high:
        raise Refused(f"{field}: expected a whole number from {low} to {high}, got {shown(text)}")
    return int(value)


def ledger_id(text: str, field: str) -> int:
    """The id of a ledger row (a run-now request, a run)."""
    return whole(text, field, 1, MAX_ID)


def instant(text: str, field: str, where: tzinfo = UTC, expected: str = ISO_EXAMPLE) -> datetime:
    """ISO-8601, in UTC; without an offset, a wall-clock time in `where`."""
    value = text.strip()
    try:
        if not value.isascii() or len(value) > _MAX_INSTANT:
            raise ValueError(value)
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise Refused(f"{field}: expected {expected}, got {shown(text)}") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=where)
    try:
        utc = parsed.astimezone(UTC)
    except (OverflowError, ValueError):
        utc = LATEST
    if not EARLIEST <= utc < LATEST:
        raise Refused(_out_of_range(field, text))
    return utc


def _out_of_range(field: str, text: str) -> str:
    return f"{field}: {shown(text)} is out of range ({EARLIEST.year} to {LATEST.year - 1})"


def duration(text: str, field: str, low: timedelta, high: timedelta) -> timedelta:
    """90s, 5m, 1h30m, 2d (or seconds), from `low` to `high`."""
    value = text.strip()
    try:
        if not value.isascii() or len(value) > 32:
            raise ValueError(value)
        delta = parse_duration(value)
    except ValueError:
        expected = "a duration such as 90s, 5m, 1h30m or 2d"
        raise Refused(f"{field}: expected {expected}, got {shown(text)}") from None
    except OverflowError:
        delta = high + timedelta(seconds=1)
    if not low <= delta <= high:
        bounds = f"{format_duration(low)} to {format_duration(high)}"
        raise Refused(f"{field}: {shown(text)} is out of range ({bounds})")
    return delta


def since(text: str, field: str, now: datetime, where: tzinfo = UTC) -> datetime:
    """An age before `now` (12h, 30m, 2d) or an instant, never before EARLIEST."""
    value = text.strip()
    if value.isascii() and _AGE.fullmatch(value):
        delta = duration(value, field, timedelta(seconds=1), timedelta(days=365 * 1000))
        if now - delta < EARLIEST:
            raise Refused(_out_of_range(field, text))
        return now - delta
    return instant(text, field, where, f"{AGE_EXAMPLE}, or {ISO_EXAMPLE}")


def choice(text: str, field: str, options: Collection[str]) -> str:
    """One of a fixed vocabulary, as written."""
    if text not in options:
        raise Refused(f"{field}: expected one of {', '.join(options)}, got {shown(text)}")
    return text


def some_of(text: str, field: str, options: Collection[str]) -> tuple[str, ...]:
    """A comma-separated list, each item one of a fixed vocabulary (any case)."""
    items = tuple(item.strip().lower() for item in text.split(",") if item.strip())
    if not items or any(item not in options for item in items):
        raise Refused(f"{field}: {shown(text)}: expected some of {', '.join(options)}")
    return items


def words(text: str, field: str, most: int) -> str:
    """Free text of a search box: printable, at most `most` characters."""
    if len(text) > most or not text.isprintable():
        raise Refused(f"{field}: expected at most {most} printable characters, got {shown(text)}")
    return text


def time_zone(text: str, field: str) -> tzinfo:
    """An IANA time zone name (Europe/Berlin)."""
    try:
        if not text.isascii() or len(text) > 64:
            raise ValueError("unknown time zone (expected an IANA name such as Europe/Berlin)")
        return zone(text)
    except ValueError as exc:
        raise Refused(f"{field}: {shown(text)}: {exc}") from None


def instance_name(text: str, field: str) -> str:
    """A replica's name, as SCHEDULER_INSTANCE_NAME allows it."""
    if INSTANCE_NAME.fullmatch(text) is None:
        raise Refused(
            f"{field}: expected a replica's name (letters, digits, '.', '_', '-';"
            f" at most 63), got {shown(text)}"
        )
    return text


def local_path(text: str | None) -> str:
    """Where to go after logging in: a path of this site, else "/" (never another site).

    Whatever it holds, the result is printable ASCII, so it can go into a header.
    """
    target = text or ""
    if not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    if len(target) > MAX_PATH or not target.isprintable():
        return "/"
    return quote(target, safe=_PATH_SAFE)
