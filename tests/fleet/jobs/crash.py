"""Jobs of test_fleet_crash.py: a run long enough to be killed in the middle of."""

from _evidence import exclusive

from scheduler import RunContext, job


@job(key=21)
def long_job(ctx: RunContext) -> None:
    exclusive(ctx, 30)
