"""Text the commands print: aligned columns, times in one zone, durations people read."""

from __future__ import annotations

from datetime import datetime, tzinfo
from typing import Any

from scheduler.statuses import Status
from scheduler.text import printable

MAX_CELL = 120  # characters of one cell (an error) in a text table; JSON has it whole


def table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> None:
    """Aligned columns (None: the first row's keys, in order; no rows, no table); what a
    job or a name said is shown escaped (one row, one line)."""
    if columns is None:
        if not rows:
            return
        columns = list(rows[0])
    cells = [[_cell(row[c]) for c in columns] for row in rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    print("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip())
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())


def _cell(value: object) -> str:
    text = "" if value is None else printable(str(value))
    return text if len(text) <= MAX_CELL else text[: MAX_CELL - 1] + "…"


def instant(value: str | datetime | None, zone: tzinfo) -> str:
    """An ISO-8601 instant in `zone`, to the millisecond, with its offset."""
    if value is None:
        return ""
    moment = datetime.fromisoformat(value) if isinstance(value, str) else value
    return moment.astimezone(zone).isoformat(timespec="milliseconds")


def duration(seconds: float | None) -> str:
    """0.004s, 1.21s, 42.5s, 3m05s, 2h01m: three significant figures at most."""
    if seconds is None:
        return ""
    if seconds < 60:
        return f"{seconds:.3g}s" if seconds >= 0.001 else "0s"
    minutes, rest = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{rest:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def lasted(status: str, seconds: float | None) -> str:
    """A row's duration; a crashed run's is what is known of it, so at least that."""
    said = duration(seconds)
    return f"at least {said}" if said and status == Status.CRASHED else said
