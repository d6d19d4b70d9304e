"""The job page's duration and lateness plot: a time axis, and retries drawn as no lateness."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import pytest

from scheduler.web import plot

T0 = datetime(2026, 11, 30, 22, 10, tzinfo=UTC)


def row(tick: datetime, started: float, duration: float = 1.0, **extra: object) -> dict:
    return {
        "scheduled_at": tick.isoformat(),
        "started_at": (tick + timedelta(seconds=started)).isoformat(),
        "duration_s": duration,
        "run_id": 7,
        **extra,
    }


def test_a_retried_tick_is_late_by_its_first_attempt_not_by_its_backoff():
    first = {"attempt": 1, "started_at": (T0 + timedelta(seconds=0.25)).isoformat()}
    retried = row(T0, started=60.0, attempt=2, attempts=[first])
    unknown = row(T0 + timedelta(minutes=1), started=90.0, attempt=3, attempts=[])
    found = plot.points([unknown, retried])  # newest first, as history answers
    assert [p.lateness_s for p in found] == [0.25, None]
    svg = plot.render(found)
    assert svg.count('class="point lateness"') == 1  # the unknown one is not drawn
    assert svg.count('class="point duration"') == 2


def test_points_stand_by_their_tick_time_with_times_under_the_axis():
    ticks = [T0, T0 + timedelta(seconds=10), T0 + timedelta(seconds=100)]
    svg = plot.render(plot.points([row(t, 0.1) for t in reversed(ticks)]))
    xs = [float(x) for x in re.findall(r'class="point duration"[^>]*cx="([\d.]+)"', svg)]
    assert (xs[1] - xs[0]) * 9 == pytest.approx(xs[2] - xs[1])  # 10 s, then 90 s
    labels = re.findall(r'class="axis time"[^>]*>([^<]+)<', svg)
    assert labels[0] == "2026-11-30 22:10:00 UTC" and labels[-1] == "2026-11-30 22:11:40 UTC"


def test_one_run_is_drawn_in_the_middle_with_its_time():
    svg = plot.render(plot.points([row(T0, 0.5)]))
    assert re.findall(r'class="axis time"[^>]*>([^<]+)<', svg) == ["2026-11-30 22:10:00 UTC"]
    assert "run 7, tick 2026-11-30 22:10:00 UTC: lateness" in svg
