"""What the fleet tests' jobs share: each run appends one JSON line of evidence.

The evidence is written by the job itself, independent of the ledger under
test. A helper module (its name starts with `_`): the daemon finds no jobs in
it, and job modules import it by plain name (`from _evidence import record`).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time

from scheduler import RunContext

EVIDENCE = os.environ["SCHEDULER_TEST_EVIDENCE"]


def record(ctx: RunContext, **extra: object) -> None:
    line = json.dumps(
        {
            "job": ctx.job_name,
            "tick": ctx.scheduled_at.isoformat(),
            "instance": ctx.instance,
            "run_id": ctx.run_id,
            "pid": os.getpid(),
            "at": time.time(),
            **extra,
        }
    )
    with open(EVIDENCE, "a") as f:
        f.write(line + "\n")


def _alive(pid: int) -> bool:
    """Whether `pid` runs: a zombie does not (a killed worker that its web server's master
    has not reaped yet runs nothing), unless its main thread alone has ended."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X") or len(os.listdir(f"/proc/{pid}/task")) > 1
    except (FileNotFoundError, ProcessLookupError):
        return False


def _enter(marker: str) -> bool:
    """Create the job's marker atomically; True if a live run of the job already holds it."""
    for _ in range(5):
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                with open(marker) as f:
                    other = int(f.read() or 0)
            except (FileNotFoundError, ValueError):
                other = 0
            if other and _alive(other):
                return True
            with contextlib.suppress(FileNotFoundError):
                os.unlink(marker)  # left by a killed replica
            continue
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        return False
    return True


def exclusive(ctx: RunContext, seconds: float, until_stopping: bool = True) -> None:
    """Run for `seconds`, recording whether another live run of the job was going meanwhile."""
    marker = os.path.join(os.path.dirname(EVIDENCE), ctx.job_name + ".running")
    overlap = _enter(marker)
    record(ctx, event="start", overlap=overlap, attempt=ctx.attempt)
    deadline = time.monotonic() + seconds
    lost_at = None
    while time.monotonic() < deadline:
        if until_stopping and ctx.stopping.is_set():
            break
        if ctx.lock_lost.is_set() and lost_at is None:
            lost_at = time.time()
        # Event.wait, not time.sleep: libfaketime breaks clock_nanosleep.
        threading.Event().wait(min(0.05, max(0.0, deadline - time.monotonic())))
    if not overlap:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(marker)
    record(ctx, event="end", lock_lost=ctx.lock_lost.is_set(), lock_lost_at=lost_at)
