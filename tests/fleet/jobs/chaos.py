"""Jobs of test_chaos.py: runs that last through a fault, and instant ones."""

from _evidence import exclusive

from scheduler import RunContext, job


@job(key=41)
def long_job(ctx: RunContext) -> None:
    exclusive(ctx, 20, until_stopping=False)


@job(key=42)
def quick(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)


@job(key=43)
def three_seconds(ctx: RunContext) -> None:
    exclusive(ctx, 3, until_stopping=False)
