"""A job's duration and lateness over its last runs, as a small SVG drawn on the server.

Lateness is a run's start minus its scheduled time (as the metric
`scheduler_job_lateness_seconds`). Both series share one axis in seconds;
each point can take focus and says its run.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from html import escape

from scheduler.web.timeline import seconds_text

WIDTH = 1000
HEIGHT = 180
LEFT = 60
PAD = 14


@dataclass(frozen=True)
class Point:
    scheduled_at: datetime
    run_id: int | None
    duration_s: float
    lateness_s: float


def points(rows: list[dict[str, object]]) -> list[Point]:
    """Finished runs of `history --json` rows (newest first), oldest first."""
    out = []
    for row in reversed(rows):
        started, duration = row.get("started_at"), row.get("duration_s")
        if not isinstance(started, str) or not isinstance(duration, int | float):
            continue
        scheduled = datetime.fromisoformat(str(row["scheduled_at"]))
        late = (datetime.fromisoformat(started) - scheduled).total_seconds()
        run_id = row.get("run_id")
        out.append(
            Point(scheduled, run_id if isinstance(run_id, int) else None, float(duration), late)
        )
    return out


def render(found: list[Point]) -> str:
    if not found:
        return '<p class="empty">No finished run yet.</p>'
    top = max(max(p.duration_s for p in found), max(p.lateness_s for p in found), 0.001)
    step = (WIDTH - LEFT - PAD) / max(len(found) - 1, 1)

    def y(value: float) -> float:
        return HEIGHT - PAD - max(value, 0.0) / top * (HEIGHT - 2 * PAD)

    parts = [
        f'<svg class="plot" viewBox="0 0 {WIDTH} {HEIGHT}" role="img"'
        f' aria-label="duration and lateness of the last {len(found)} runs"'
        ' xmlns="http://www.w3.org/2000/svg">',
        f'<line class="grid" x1="{LEFT}" y1="{y(0):.1f}" x2="{WIDTH - PAD}" y2="{y(0):.1f}"/>',
        f'<text class="axis" x="{LEFT - 6}" y="{y(top) + 4:.1f}">{seconds_text(top)}</text>',
        f'<text class="axis" x="{LEFT - 6}" y="{y(0) + 4:.1f}">0</text>',
    ]
    for series, attr in (("duration", "duration_s"), ("lateness", "lateness_s")):
        coords = [(LEFT + i * step, y(getattr(p, attr))) for i, p in enumerate(found)]
        line = " ".join(f"{x:.1f},{v:.1f}" for x, v in coords)
        parts.append(f'<polyline class="series {series}" points="{line}"/>')
        for (x, v), p in zip(coords, found, strict=True):
            said = (
                f"run {p.run_id}, tick {p.scheduled_at.isoformat(timespec='seconds')}: "
                f"{series} {seconds_text(getattr(p, attr))}"
            )
            parts.append(
                f'<circle class="point {series}" tabindex="0" cx="{x:.1f}" cy="{v:.1f}" r="3">'
                f"<title>{escape(said)}</title></circle>"
            )
    parts.append("</svg>")
    return "".join(parts)
