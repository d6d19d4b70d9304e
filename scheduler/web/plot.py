"""A job's duration and lateness over its last runs, as a small SVG drawn on the server.

Lateness is a run's start minus its scheduled time (as the metric
`scheduler_job_lateness_seconds`), for the tick's first attempt: a retry
starts late on purpose (its backoff), and is no lateness of the schedule.
Both series share one axis in seconds; the other axis is the ticks' time,
so gaps between runs show as gaps. Each point can take focus and says its run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from html import escape

from scheduler.web.timeline import seconds_text, when

WIDTH = 1000
HEIGHT = 200
LEFT = 60
PAD = 14
BOTTOM = 34  # room for the time axis under the plot
LABELS = 4  # times along the axis, both ends included


@dataclass(frozen=True)
class Point:
    scheduled_at: datetime
    run_id: int | None
    duration_s: float
    lateness_s: float | None  # None: the first attempt's start is not known


def points(rows: list[dict[str, object]]) -> list[Point]:
    """Finished runs of `history --json` rows (newest first), oldest first."""
    out = []
    for row in reversed(rows):
        started, duration = row.get("started_at"), row.get("duration_s")
        if not isinstance(started, str) or not isinstance(duration, int | float):
            continue
        scheduled = datetime.fromisoformat(str(row["scheduled_at"]))
        first = _first_start(row, started)
        late = None if first is None else (datetime.fromisoformat(first) - scheduled)
        run_id = row.get("run_id")
        out.append(
            Point(
                scheduled,
                run_id if isinstance(run_id, int) else None,
                float(duration),
                None if late is None else late.total_seconds(),
            )
        )
    return out


def _first_start(row: dict[str, object], started: str) -> str | None:
    """When the tick's first attempt started (its earlier attempts are oldest first)."""
    attempt = row.get("attempt")
    if not isinstance(attempt, int) or attempt <= 1:
        return started
    earlier = row.get("attempts")
    if isinstance(earlier, list) and earlier and isinstance(earlier[0], dict):
        first = earlier[0].get("started_at")
        return first if isinstance(first, str) else None
    return None


def render(found: list[Point]) -> str:
    if not found:
        return '<p class="empty">No finished run yet.</p>'
    late = [p.lateness_s for p in found if p.lateness_s is not None]
    top = max(max(p.duration_s for p in found), max(late, default=0.0), 0.001)
    start, end = found[0].scheduled_at, found[-1].scheduled_at
    span = max((end - start).total_seconds(), 0.001)
    floor = HEIGHT - BOTTOM

    def x(instant: datetime) -> float:
        if len(found) == 1:
            return (LEFT + WIDTH - PAD) / 2
        return LEFT + (instant - start).total_seconds() / span * (WIDTH - LEFT - PAD)

    def y(value: float) -> float:
        return floor - max(value, 0.0) / top * (floor - PAD)

    parts = [
        f'<svg class="plot" viewBox="0 0 {WIDTH} {HEIGHT}" role="img"'
        f' aria-label="duration and lateness of the last {len(found)} runs, by tick time"'
        ' xmlns="http://www.w3.org/2000/svg">',
        f'<line class="grid" x1="{LEFT}" y1="{y(0):.1f}" x2="{WIDTH - PAD}" y2="{y(0):.1f}"/>',
        f'<text class="axis" x="{LEFT - 6}" y="{y(top) + 4:.1f}">{seconds_text(top)}</text>',
        f'<text class="axis" x="{LEFT - 6}" y="{y(0) + 4:.1f}">0</text>',
        *_time_axis(found, x, floor),
    ]
    for series in ("duration", "lateness"):
        shown = [(p, _value(p, series)) for p in found]
        coords = [(x(p.scheduled_at), y(v), p, v) for p, v in shown if v is not None]
        line = " ".join(f"{cx:.1f},{cy:.1f}" for cx, cy, _, _ in coords)
        parts.append(f'<polyline class="series {series}" points="{line}"/>')
        for cx, cy, p, v in coords:
            said = f"run {p.run_id}, tick {when(p.scheduled_at)}: {series} {seconds_text(v)}"
            parts.append(
                f'<circle class="point {series}" tabindex="0" cx="{cx:.1f}" cy="{cy:.1f}" r="3">'
                f"<title>{escape(said)}</title></circle>"
            )
    parts.append("</svg>")
    return "".join(parts)


def _value(p: Point, series: str) -> float | None:
    return p.duration_s if series == "duration" else p.lateness_s


def _time_axis(found: list[Point], x: Callable[[datetime], float], floor: float) -> list[str]:
    """The ticks' time under the plot: a few instants, both ends included."""
    start, end = found[0].scheduled_at, found[-1].scheduled_at
    count = 1 if start == end else LABELS
    out = []
    anchors = ["start", *["middle"] * (count - 2), "end"] if count > 1 else ["middle"]
    for i, anchor in enumerate(anchors):
        at = start + (end - start) * (i / max(count - 1, 1))
        cx = x(at)
        out.append(
            f'<line class="grid" x1="{cx:.1f}" y1="{floor:.1f}" x2="{cx:.1f}"'
            f' y2="{floor + 4:.1f}"/><text class="axis time" text-anchor="{anchor}"'
            f' x="{cx:.1f}" y="{floor + 18:.1f}">{escape(when(at))}</text>'
        )
    return out
