"""Jobs of test_fleet_hardening.py."""

import threading

from _evidence import exclusive, record

from scheduler import RunContext, job


@job(key=61)
def stubborn(ctx: RunContext) -> None:
    # Ignores `stopping`: only a lost lock ends it. Every beat says whether the
    # run still believed it held the lock when it wrote it.
    record(ctx, event="start")
    while not ctx.lock_lost.is_set():
        record(ctx, event="beat")
        threading.Event().wait(0.02)
    record(ctx, event="told")


@job(key=62)
def slow(ctx: RunContext) -> None:
    exclusive(ctx, 24, until_stopping=False)


@job(key=63)
def overrun(ctx: RunContext) -> None:
    exclusive(ctx, 30, until_stopping=False)
