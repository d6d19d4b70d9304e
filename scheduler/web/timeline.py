"""The timeline as SVG, drawn on the server: a pure function of (lanes, window, now).

One lane per replica; each run a bar from its start to its finish (or now),
coloured by outcome; skipped ticks and ticks nobody ran as marks; the current
time as a line. A lane too dense to draw run by run (see `scheduler.web.window`)
is drawn as buckets whose height says how many ticks each holds, coloured by
the share of each outcome, so the output stays bounded however many runs the
window holds. Every bar and bucket can take focus and says what it is in its
<title> (the browser's tooltip; the page's script shows it on focus as well).
Everything from the ledger is escaped.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from html import escape

from scheduler.statuses import Status
from scheduler.web.window import BUCKETS, Lane, Tick, Window

WIDTH = 1000
LABEL_W = 170  # the lanes' names, left of the plot
RIGHT = 10
AXIS_H = 22
LANE_H = 24
GAP = 6
MIN_BAR = 2.0  # a run of a millisecond still shows
MARKS = (Status.SKIPPED, Status.MISSED, Status.PAUSED)
STACK = (
    Status.FAILED,
    Status.CRASHED,
    Status.INTERRUPTED,
    Status.RUNNING,
    Status.SUCCEEDED,
    Status.SKIPPED,
    Status.MISSED,
    Status.PAUSED,
)


def render(lanes: list[Lane], window: Window, now: datetime) -> str:
    """The whole <svg> element, as text safe to put in a page."""
    height = AXIS_H + len(lanes) * (LANE_H + GAP) + GAP
    parts = [
        f'<svg class="timeline" viewBox="0 0 {WIDTH} {height}" role="img"'
        f' aria-label="runs per replica from {_hm(window.start)} to {_hm(window.end)} UTC"'
        ' xmlns="http://www.w3.org/2000/svg">',
        *_axis(window, height),
    ]
    for index, lane in enumerate(lanes):
        top = AXIS_H + GAP + index * (LANE_H + GAP)
        parts.append(_lane(lane, window, now, top))
    now_x = _x(window, now)
    parts.append(
        f'<line class="now" x1="{now_x:.1f}" y1="{AXIS_H - 4}" x2="{now_x:.1f}" y2="{height}">'
        f"<title>now: {_hms(now)} UTC</title></line>"
    )
    if not lanes:
        parts.append(
            f'<text class="empty" x="{LABEL_W}" y="{AXIS_H + 16}">no live replica and no runs'
            " in this window</text>"
        )
    parts.append("</svg>")
    return "".join(parts)


def _plot_w() -> float:
    return WIDTH - LABEL_W - RIGHT


def _x(window: Window, instant: datetime) -> float:
    share = (instant - window.start).total_seconds() / window.seconds
    return LABEL_W + min(max(share, 0.0), 1.0) * _plot_w()


def when(value: str | datetime | None) -> str:
    """An instant as people read it everywhere on the page: 2026-11-30 22:10:03 UTC."""
    if value is None:
        return ""
    instant = datetime.fromisoformat(value) if isinstance(value, str) else value
    return instant.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _hm(instant: datetime) -> str:
    return instant.astimezone(UTC).strftime("%H:%M")


def _hms(instant: datetime) -> str:
    return instant.astimezone(UTC).strftime("%H:%M:%S")


def _axis(window: Window, height: int) -> list[str]:
    """A vertical rule and a time at round steps, about six across."""
    steps = [60, 300, 600, 900, 1800, 3600, 7200, 10800, 21600]
    step = next((s for s in steps if window.seconds / s <= 8), steps[-1])
    first = datetime.fromtimestamp((window.start.timestamp() // step + 1) * step, UTC)
    out = []
    at = first
    while at < window.end:
        x = _x(window, at)
        out.append(
            f'<line class="grid" x1="{x:.1f}" y1="{AXIS_H - 4}" x2="{x:.1f}" y2="{height}"/>'
            f'<text class="axis" x="{x:.1f}" y="{AXIS_H - 8}">{_hm(at)}</text>'
        )
        at += timedelta(seconds=step)
    return out


def _lane(lane: Lane, window: Window, now: datetime, top: float) -> str:
    label = escape(lane.label)
    shown = label if len(label) <= 24 else label[:23] + "…"
    parts = [
        f'<g class="lane {lane.kind}" data-lane="{escape(lane.label)}">',
        f'<rect class="track" x="{LABEL_W}" y="{top}" width="{_plot_w()}" height="{LANE_H}"/>',
        f'<text class="label" x="{LABEL_W - 6}" y="{top + LANE_H / 2 + 4}"><title>{label}'
        f" ({lane.total} tick(s) in the window)</title>{shown}</text>",
    ]
    if lane.buckets is not None:
        parts.extend(_buckets(lane.buckets, window, top))
    else:
        for tick in sorted(lane.ticks, key=lambda t: t.started_at or t.scheduled_at):
            parts.append(
                _mark(tick, window, top) if tick.status in MARKS else _bar(tick, window, now, top)
            )
    parts.append("</g>")
    return "".join(parts)


def describe(tick: Tick, now: datetime) -> str:
    """What a bar's tooltip says: job, tick, run_id, duration, error."""
    lines = [f"{tick.job} ({tick.status}{', run now' if tick.manual else ''})"]
    lines.append(f"tick {when(tick.scheduled_at)}")
    if tick.instance and tick.status not in (Status.MISSED, Status.PAUSED):
        lines.append(f"on {tick.instance}")
    if tick.run_id is not None:
        lines.append(f"run_id {tick.run_id}")
    duration = tick.duration_s
    if duration is None and tick.status == Status.RUNNING and tick.started_at:
        duration = (now - tick.started_at).total_seconds()
    if duration is not None:
        known = "at least " if tick.status == Status.CRASHED else ""
        lines.append(f"duration {known}{seconds_text(duration)}")
    if tick.error:
        error = tick.error if len(tick.error) <= 300 else tick.error[:299] + "…"
        lines.append(f"error: {error}")
    return "\n".join(lines)


def seconds_text(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.2f} s"
    return f"{seconds / 60:.1f} min"


def _bar(tick: Tick, window: Window, now: datetime, top: float) -> str:
    start = tick.started_at or tick.scheduled_at
    end = tick.finished_at or (now if tick.status == Status.RUNNING else start)
    x1, x2 = _x(window, start), _x(window, end)
    width = max(x2 - x1, MIN_BAR)
    return (
        f'<g class="run s-{escape(tick.status)}" tabindex="0" data-run="{tick.run_id or ""}"'
        f' data-job="{escape(tick.job)}"><title>{escape(describe(tick, now))}</title>'
        f'<rect x="{x1:.1f}" y="{top + 3}" width="{width:.1f}" height="{LANE_H - 6}"/></g>'
    )


def _mark(tick: Tick, window: Window, top: float) -> str:
    x = _x(window, tick.scheduled_at)
    points = f"{x - 4:.1f},{top:.1f} {x + 4:.1f},{top:.1f} {x:.1f},{top + 7:.1f}"
    return (
        f'<g class="mark s-{escape(tick.status)}" tabindex="0" data-job="{escape(tick.job)}">'
        f"<title>{escape(describe(tick, tick.scheduled_at))}</title>"
        f'<polygon points="{points}"/></g>'
    )


def _buckets(buckets: dict[int, dict[str, int]], window: Window, top: float) -> list[str]:
    """A dense lane: per bucket, a stack whose height grows with its number of ticks."""
    most = max((sum(c.values()) for c in buckets.values()), default=1)
    width = _plot_w() / BUCKETS
    out = []
    for index in sorted(buckets):
        counts = buckets[index]
        total = sum(counts.values())
        height = max(3.0, (LANE_H - 4) * total / most)
        x = LABEL_W + index * width
        begin = window.start + timedelta(seconds=index * window.bucket_s)
        order = [*STACK, *sorted(set(counts) - set(STACK))]  # a status of a newer version last
        said = ", ".join(f"{counts[s]} {s}" for s in order if counts.get(s))
        title = f"{_hms(begin)} to {_hms(begin + timedelta(seconds=window.bucket_s))} UTC: {said}"
        out.append(f'<g class="bucket" tabindex="0"><title>{escape(title)}</title>')
        y = top + LANE_H - 2
        for status in order:
            if counts.get(status):
                part = height * counts[status] / total
                y -= part
                out.append(
                    f'<rect class="s-{escape(status)}" x="{x:.1f}" y="{y:.1f}"'
                    f' width="{max(width - 0.4, 0.8):.1f}" height="{part:.1f}"/>'
                )
        out.append("</g>")
    return out
