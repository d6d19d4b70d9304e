"""Jobs of test_fleet_policies.py: retries and catch-up on real replicas."""

from _evidence import exclusive, record

from scheduler import RunContext, job


@job(key=161)
def flaky(ctx: RunContext) -> None:
    """Fails on its first two attempts of every tick, succeeds on the third."""
    record(ctx, event="attempt", attempt=ctx.attempt)
    if ctx.attempt <= 2:
        raise RuntimeError(f"attempt {ctx.attempt} fails")


@job(key=162)
def stubborn(ctx: RunContext) -> None:
    """Fails on every attempt."""
    record(ctx, event="attempt", attempt=ctx.attempt)
    raise RuntimeError(f"attempt {ctx.attempt} fails too")


@job(key=163)
def backlog(ctx: RunContext) -> None:
    exclusive(ctx, 0.3)
