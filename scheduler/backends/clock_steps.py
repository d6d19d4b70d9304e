"""Steps of the wall clock (NTP fixing a wrong clock, a host that slept), told in the log.

Ticks are due by the wall clock, so a step changes which ones are: said once,
when it is seen, with what it does to them. A step is the wall clock moving
more or less than the monotonic clock over the same stretch, beyond a
tolerance no slew reaches.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime

log = logging.getLogger("scheduler.clock")

TOLERANCE_S = 2.0  # NTP slews at most 0.5 ms per second: far below this between looks


class ClockWatch:
    """Compares the wall clock with the monotonic one at each `look`."""

    def __init__(
        self,
        wall: Callable[[], float],
        monotonic: Callable[[], float],
        tolerance: float = TOLERANCE_S,
    ) -> None:
        self.wall, self.monotonic, self.tolerance = wall, monotonic, tolerance
        self._last: tuple[float, float] | None = None

    def look(self) -> float | None:
        """The step since the last look in seconds (negative: back), logged; None if none."""
        now = (self.wall(), self.monotonic())
        last, self._last = self._last, now
        if last is None:
            return None
        step = (now[0] - last[0]) - (now[1] - last[1])
        if abs(step) <= self.tolerance:
            return None
        log.warning(say(step, last[0] + (now[1] - last[1]), now[0]))
        return step


def say(step: float, expected: float, found: float) -> str:
    """One line: the step, and what it does to ticks."""
    was, now = _at(expected), _at(found)
    if step < 0:
        return (
            f"the system clock stepped back by {-step:.0f} s (it should read {was}, it reads "
            f"{now}): ticks are due by the wall clock, so those planned before the step wait "
            f"until it reads {was} again: up to {-step:.0f} s with no run, and the fleet's "
            "chores (the crash and missed-tick sweeps) wait as long; ticks recorded while it "
            "was ahead keep their rows"
        )
    return (
        f"the system clock stepped forward by {step:.0f} s (it should read {was}, it reads "
        f"{now}; or the host slept): each job runs its latest due tick, and the ticks in "
        "between are recorded missed once past their grace (or run, with catch_up: all)"
    )


def _at(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds")
