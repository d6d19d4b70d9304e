"""A replica done the usual way: APScheduler 3 plus pg_try_advisory_lock around each run.

    python bench/alternatives/naive_lock.py --database-url URL --jobs N --instance NAME
        --evidence PATH [--job-ms MS] [--key-base K]

The baseline the benchmark compares against. Every replica fires every tick
of jobs job_0 .. job_{N-1} (1 s interval, ticks on whole seconds anchored at
the Unix epoch); each firing opens its own connection and runs the job only
if `pg_try_advisory_lock(K + i)` (single-bigint form) returns true, then
unlocks and disconnects. Nothing records that a tick was already run, so a
replica whose clock is late, or that fires after a short run has released
the lock, runs the same tick again: that is what the benchmark measures, so
it is deliberately left as is.

Each run appends one JSON line to the evidence file ("start" is taken once
the lock is held, when the job body begins), then waits --job-ms on a
threading.Event (time.sleep misbehaves under libfaketime). Every connection
carries application_name NAME. SIGTERM or SIGINT ends the process with
status 0; a run in progress stops waiting at once.
"""

# ruff: noqa: E402
from __future__ import annotations

import signal
import sys

# A signal during the slow imports below must end the process cleanly too.
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
signal.signal(signal.SIGINT, lambda *_: sys.exit(0))

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from datetime import UTC, datetime
from types import FrameType
from typing import Any

import psycopg
from apscheduler.executors.pool import BasePoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.interval import IntervalTrigger
from contract import append_evidence, parse_args

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

# Set on SIGTERM/SIGINT; a run waits on it so shutdown never waits out a long job.
stopping = threading.Event()
# The tick the current worker thread is running (see TickPool).
current = threading.local()


def plain_url(url: str) -> str:
    """psycopg wants a libpq URL; accept the SQLAlchemy spelling the project also accepts."""
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


class TickPool(concurrent.futures.ThreadPoolExecutor):
    """Tells the worker thread which tick it runs: APScheduler 3 does not pass it to the job.

    The executor submits `run_job(job, jobstore_alias, run_times, logger_name)`;
    with coalescing on, run_times holds the one tick being fired.
    """

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        run_times: list[datetime] = args[2]
        return super().submit(with_tick, run_times[-1], fn, *args, **kwargs)


def with_tick(tick: datetime, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    current.tick = tick
    return fn(*args, **kwargs)


class TickExecutor(BasePoolExecutor):
    """APScheduler's thread pool executor, on a TickPool."""

    def __init__(self, max_workers: int) -> None:
        super().__init__(TickPool(max_workers))


def run_once(
    index: int, url: str, instance: str, evidence: str, job_seconds: float, key_base: int
) -> None:
    """One firing on this replica: lock, run, unlock, on a connection of its own."""
    scheduled: datetime = current.tick
    key = key_base + index
    with psycopg.connect(url, application_name=instance, autocommit=True) as conn:
        got = conn.execute("SELECT pg_try_advisory_lock(%s::bigint)", (key,)).fetchone()
        if not (got and got[0]):
            return
        try:
            append_evidence(evidence, f"job_{index}", scheduled, instance, time.time())
            stopping.wait(job_seconds)
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s::bigint)", (key,))


def on_signal(_signum: int, _frame: FrameType | None) -> None:
    stopping.set()


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    logging.basicConfig(level=logging.ERROR, format="%(asctime)s %(name)s %(message)s")
    url = plain_url(args.database_url)
    scheduler = BackgroundScheduler(
        executors={"default": TickExecutor(max(1, min(args.jobs, 100)))},
        job_defaults={"coalesce": True, "misfire_grace_time": 1},
        timezone=UTC,
    )
    for i in range(args.jobs):
        scheduler.add_job(
            run_once,
            IntervalTrigger(seconds=args.interval_s, start_date=EPOCH, timezone=UTC),
            args=(i, url, args.instance, args.evidence, args.job_ms / 1000, args.key_base),
            id=f"job_{i}",
            name=f"job_{i}",
        )
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    scheduler.start()
    while not stopping.wait(1):
        pass
    scheduler.shutdown(wait=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
