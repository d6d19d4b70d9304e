"""Waiting a while: `sleep(seconds)`, the one way the package sleeps.

Not `time.sleep`: since Python 3.11 it waits for an absolute deadline on the
monotonic clock (clock_nanosleep with TIMER_ABSTIME), and under libfaketime
with a shifted wall clock (how the fleet tests stand for a host whose clock is
off, and how an operator may try a replica) that call fails with EINVAL: the
thread that slept would die of it. A timed wait on an event (a relative
timeout) waits the same, whatever the wall clock says.
"""

from __future__ import annotations

import threading


def sleep(seconds: float) -> None:
    threading.Event().wait(max(0.0, seconds))
