"""A replica on APScheduler 4: shared SQLAlchemy data store, psycopg event broker.

    python bench/alternatives/apscheduler4.py --database-url URL --jobs N --instance NAME
        --evidence PATH [--job-ms MS] [--key-base K]

Runs in its own virtual environment (APScheduler 4 cannot share one with the
project, which needs APScheduler 3):

    python3 -m venv bench/.venv-aps4 && bench/.venv-aps4/bin/pip install -q \
        'apscheduler==4.0.0a6' 'sqlalchemy>=2,<2.2' 'psycopg[binary]>=3.1'

APScheduler 4 coordinates a fleet itself, as its documentation describes for
several schedulers sharing one data store: the schedules live in PostgreSQL,
a scheduler leases due schedules to turn their ticks into job rows, any
scheduler leases job rows to run them, and events (new schedules, released
jobs) travel by LISTEN/NOTIFY. Every process adds the same schedules job_0 ..
job_{N-1} under fixed ids with ConflictPolicy.do_nothing: the first process
to insert a schedule wins and the others keep it untouched (`replace` would
overwrite a schedule another process may be firing, rewinding its next fire
time). Each task keeps APScheduler's default of one running job at a time
across the fleet; misfire_grace_time is 1 s, coalescing `latest`.

Ticks are every whole second, the grid of an interval anchored at the Unix
epoch; the trigger starts at the next whole second rather than at the epoch
itself, because APScheduler 4 walks a schedule's trigger one tick at a time
up to now, which from 1970 on a 1 s interval would take hours.

Every connection (SQLAlchemy pool and both broker connections) carries
application_name NAME, which is also the scheduler's identity (so NAMEs must
be unique). The tables are APScheduler's own, in the database's default
schema. --key-base is accepted for a common command line and not used.
SIGTERM or SIGINT ends the process with status 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import signal
import threading
import time
from datetime import UTC, datetime

from apscheduler import AsyncScheduler, CoalescePolicy, ConflictPolicy, current_job
from apscheduler.datastores.sqlalchemy import SQLAlchemyDataStore
from apscheduler.eventbrokers.psycopg import PsycopgEventBroker
from apscheduler.triggers.interval import IntervalTrigger
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine


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
    scheduled = scheduled.astimezone(UTC)
    line = json.dumps(
        {
            "job": job.schedule_id,
            "tick": scheduled.isoformat(),
            "instance": Replica.instance,
            "start": start,
            "scheduled": scheduled.timestamp(),
        }
    )
    # One short line per open/write/close, so appends from several processes never interleave.
    with open(Replica.evidence, "a", encoding="utf-8") as evidence:
        evidence.write(line + "\n")
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


async def serve(args: argparse.Namespace) -> None:
    engine_url, broker_url = urls(args.database_url)
    engine = create_async_engine(engine_url, connect_args={"application_name": args.instance})
    data_store = SQLAlchemyDataStore(engine)
    event_broker = PsycopgEventBroker(broker_url, {"application_name": args.instance})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        async with AsyncScheduler(data_store, event_broker, identity=args.instance) as scheduler:
            await scheduler.configure_task(
                run_job, job_executor="threadpool", misfire_grace_time=1
            )
            first_tick = datetime.fromtimestamp(math.ceil(time.time()), UTC)
            for i in range(args.jobs):
                await scheduler.add_schedule(
                    run_job,
                    IntervalTrigger(seconds=1, start_time=first_tick),
                    id=f"job_{i}",
                    coalesce=CoalescePolicy.latest,
                    misfire_grace_time=1,
                    conflict_policy=ConflictPolicy.do_nothing,
                )
            await scheduler.start_in_background()
            await stop.wait()
            Replica.stopping.set()
    finally:
        await engine.dispose()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--jobs", type=int, required=True)
    parser.add_argument("--instance", required=True)
    parser.add_argument("--evidence", required=True)
    parser.add_argument("--job-ms", type=float, default=1.0)
    parser.add_argument("--key-base", type=int, default=10_000)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.ERROR, format="%(asctime)s %(name)s %(message)s")
    Replica.instance = args.instance
    Replica.evidence = args.evidence
    Replica.job_seconds = args.job_ms / 1000
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
