"""Jobs of test_failover.py: two jobs every second, and a run lasting through the failover."""

from _evidence import exclusive

from scheduler import RunContext, job


@job(key=61)
def every_second(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)


@job(key=62)
def long_run(ctx: RunContext) -> None:
    exclusive(ctx, 6)


@job(key=63)
def each_second(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)
