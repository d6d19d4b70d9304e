"""Example jobs. Each has a numeric key that must never change once deployed."""

import asyncio
import time

from scheduler import Interrupted, RunContext, job


@job(key=1001)
def heartbeat(ctx: RunContext) -> None:
    ctx.log.info("tick %s on %s (run %d)", ctx.scheduled_at.isoformat(), ctx.instance, ctx.run_id)


@job(key=1002, name="nightly-report")
async def report(ctx: RunContext) -> None:
    await asyncio.sleep(0.1)
    ctx.log.info("report for %s written", ctx.scheduled_at.date())


@job(key=1003)
def slow_cleanup(ctx: RunContext) -> None:
    """Takes longer than its interval now and then: the next tick is skipped, not overlapped.
    Told to stop, it stops between two steps, and says so: its run is `interrupted`."""
    for _ in range(30):
        if ctx.lock_lost.is_set() or ctx.stopping.is_set():
            raise Interrupted("the rest waits for the next run")
        time.sleep(0.5)
