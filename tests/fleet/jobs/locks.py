"""Jobs of test_fleet_locks.py: the lock invariant under row locks held from outside."""

from _evidence import exclusive, record

from scheduler import RunContext, job


@job(key=171)
def retried(ctx: RunContext) -> None:
    """Fails its first attempt of every tick; the retry succeeds."""
    record(ctx, event="attempt", attempt=ctx.attempt)
    if ctx.attempt == 1:
        raise RuntimeError("the first attempt fails")


@job(key=172)
def caught(ctx: RunContext) -> None:
    exclusive(ctx, 0.3)


@job(key=173)
def doomed(ctx: RunContext) -> None:
    """Its replica dies during every run (as if OOM-killed)."""
    import os
    import signal

    record(ctx)
    os.kill(os.getpid(), signal.SIGKILL)
