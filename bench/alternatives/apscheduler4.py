"""A replica on APScheduler 4: shared SQLAlchemy data store, psycopg event broker.

    python bench/alternatives/apscheduler4.py --database-url URL --jobs N --instance NAME
        --evidence PATH [--job-ms MS] [--key-base K]

Runs in its own virtual environment (APScheduler 4 cannot share one with the
project, which needs APScheduler 3):

    python3 -m venv bench/.venv-aps4 && bench/.venv-aps4/bin/pip install -q \
        'apscheduler==4.0.0a6' 'sqlalchemy[asyncio]>=2,<2.2' 'psycopg[binary]>=3.1' sniffio

(sqlalchemy[asyncio] brings greenlet, which the async engine needs; sniffio
is imported by the SQLAlchemy data store but no longer comes with anyio.)

APScheduler 4 coordinates the fleet itself, as documented for several
schedulers sharing one data store: schedules and jobs are rows in
PostgreSQL, leased by whichever scheduler processes them, and events travel
by LISTEN/NOTIFY. Every process adds the same schedules job_0 .. job_{N-1}
with ConflictPolicy.do_nothing: the first insert wins and later processes
leave it alone (`replace` would rewrite a live schedule's trigger state at
every start). Each job is its own task, since max_running_jobs (1, the
default) counts per task: a shared task would let only one of the N jobs run
at a time. Schedules are added by task id because add_schedule() given a
callable resets its task to the defaults (async executor, no grace). Jobs
run in the thread pool; misfire_grace_time 1 s, coalescing `latest`.

Ticks are the whole seconds, as with an interval anchored at the Unix epoch,
but the trigger starts at the next whole second: APScheduler 4 steps a
trigger one tick at a time up to now, which from 1970 would take hours.

The only addition to APScheduler is an advisory lock that serializes
start-ups (see startup_lock). Every connection carries application_name
NAME, which is also the scheduler identity, so NAMEs must be unique. Tables
are APScheduler's own, in the default schema. --key-base is accepted and
unused.

SIGTERM or SIGINT ends the process with status 0. APScheduler 4.0.0a6 does
not give its leases back when it stops (or is killed): schedules it was
processing stay leased for 30 s, fired by no one; a job still running
completes but its release is cancelled, so its task's running-job count
stays at 1 and the job runs nowhere until the lease expires and a clean-up
runs (at a scheduler's start, then every 15 minutes). A restart under the
same NAME reclaims both at once.
"""

# ruff: noqa: E402
from __future__ import annotations

import signal
import sys

# A signal during the slow imports below must end the process cleanly too.
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
signal.signal(signal.SIGINT, lambda *_: sys.exit(0))

import argparse
import asyncio
import logging
import math
import threading
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager, suppress
from datetime import UTC, datetime

import psycopg
from apscheduler import AsyncScheduler, CoalescePolicy, ConflictPolicy, current_job
from apscheduler.datastores.sqlalchemy import SQLAlchemyDataStore
from apscheduler.eventbrokers.psycopg import PsycopgEventBroker
from apscheduler.triggers.interval import IntervalTrigger
from contract import append_evidence, parse_args
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine

# Single-bigint advisory lock key held while a process starts ("APS4").
STARTUP_LOCK = 0x41505334


class Replica:
    """What the job needs to know about this process; set once in main()."""

    instance = ""
    evidence = ""
    job_seconds = 0.001
    # Set on SIGTERM/SIGINT; a run waits on it so shutdown never waits out a long job.
    stopping = threading.Event()


def run_job() -> None:
    """The job of every schedule: the job name and tick come from APScheduler's job context.

    Module-level, so that any process can resolve the task's stored reference.
    """
    start = time.time()
    job = current_job.get()
    scheduled = job.scheduled_fire_time
    if scheduled is None or job.schedule_id is None:
        return
    append_evidence(Replica.evidence, job.schedule_id, scheduled, Replica.instance, start)
    Replica.stopping.wait(Replica.job_seconds)


def urls(database_url: str) -> tuple[str, str]:
    """The SQLAlchemy URL (psycopg 3 driver, async) and the libpq URL for the event broker."""
    url = make_url(database_url)
    engine_url = url.set(drivername="postgresql+psycopg")
    broker_url = url.set(drivername="postgresql")
    return (
        engine_url.render_as_string(hide_password=False),
        broker_url.render_as_string(hide_password=False),
    )


@asynccontextmanager
async def startup_lock(url: str, instance: str) -> AsyncIterator[None]:
    """Serialize start-ups: APScheduler 4.0.0a6 creates its tables and enum types unguarded.

    Two processes starting together on an empty database both run CREATE TYPE,
    and the loser dies with UniqueViolation (the store retries only
    connection errors). Holding a session advisory lock while the scheduler
    initializes its store and adds the schedules lets them start one by one.
    """
    async with await psycopg.AsyncConnection.connect(
        url, application_name=instance, autocommit=True
    ) as conn:
        await conn.execute("SELECT pg_advisory_lock(%s::bigint)", (STARTUP_LOCK,))
        yield


async def serve(args: argparse.Namespace) -> None:
    """Start, add the schedules, run until a signal; a signal during start-up cancels it."""
    engine_url, broker_url = urls(args.database_url)
    running = False
    stop = asyncio.Event()
    main_task = asyncio.current_task()
    assert main_task is not None

    def on_signal() -> None:
        stop.set()
        Replica.stopping.set()
        if not running:
            main_task.cancel()

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal)

    engine = create_async_engine(engine_url, connect_args={"application_name": args.instance})
    async with AsyncExitStack() as stack:
        stack.push_async_callback(engine.dispose)
        async with startup_lock(broker_url, args.instance):
            scheduler = await stack.enter_async_context(
                AsyncScheduler(
                    SQLAlchemyDataStore(engine),
                    PsycopgEventBroker(broker_url, {"application_name": args.instance}),
                    identity=args.instance,
                )
            )
            first_tick = datetime.fromtimestamp(math.ceil(time.time()), UTC)
            for i in range(args.jobs):
                await scheduler.configure_task(
                    f"job_{i}",
                    func=run_job,
                    job_executor="threadpool",
                    max_running_jobs=1,
                    misfire_grace_time=1,
                )
                await scheduler.add_schedule(
                    f"job_{i}",
                    IntervalTrigger(seconds=args.interval_s, start_time=first_tick),
                    id=f"job_{i}",
                    coalesce=CoalescePolicy.latest,
                    misfire_grace_time=1,
                    conflict_policy=ConflictPolicy.do_nothing,
                )
        await scheduler.start_in_background()
        running = True
        await stop.wait()


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    logging.basicConfig(level=logging.ERROR, format="%(asctime)s %(name)s %(message)s")
    Replica.instance = args.instance
    Replica.evidence = args.evidence
    Replica.job_seconds = args.job_ms / 1000
    with suppress(asyncio.CancelledError):
        asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
