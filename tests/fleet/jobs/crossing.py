"""Jobs of test_soak_crossing.py: eighteen instant jobs, one whose runs last 0 to 1.5 s,
one that fails its first attempt half the time (it has retries), one that catches up,
one that overruns its timeout now and then (and is retried), two cron jobs read in
Europe/Berlin, one whose schedule a reload changes, and one that is paused for a while."""

import random
import threading
import time

from _evidence import exclusive, record

from scheduler import RunContext, job


@job(key=600)
def quick_0(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)


@job(key=601)
def quick_1(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)


@job(key=602)
def quick_2(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)


@job(key=603)
def quick_3(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)


@job(key=604)
def quick_4(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)


@job(key=605)
def quick_5(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)


@job(key=606)
def quick_6(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)


@job(key=607)
def quick_7(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)


@job(key=608)
def quick_8(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)


@job(key=609)
def quick_9(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)


@job(key=610)
def quick_10(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)


@job(key=611)
def quick_11(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)


@job(key=612)
def quick_12(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)


@job(key=613)
def quick_13(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)


@job(key=614)
def quick_14(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)


@job(key=615)
def quick_15(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)


@job(key=616)
def quick_16(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)


@job(key=617)
def quick_17(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)


@job(key=620)
def wobbly(ctx: RunContext) -> None:
    exclusive(ctx, random.uniform(0, 1.5), until_stopping=False)


@job(key=630)
def retrying(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)
    if ctx.attempt == 1 and random.random() < 0.5:
        raise RuntimeError("the first attempt fails")


@job(key=631)
def catching(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)


@job(key=632)
def timing(ctx: RunContext) -> None:
    """0 to 1.6 s against a timeout of 1 s: told `timed_out`, it stops."""
    record(ctx, event="start", overlap=False, attempt=ctx.attempt)
    deadline = time.monotonic() + random.uniform(0, 1.6)
    while time.monotonic() < deadline and not ctx.timed_out.is_set():
        # Event.wait, not time.sleep: libfaketime breaks clock_nanosleep.
        threading.Event().wait(0.05)


@job(key=640)
def wall(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)


@job(key=641)
def fixed(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)


@job(key=650)
def reshaped(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)


@job(key=651)
def pausable(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)
