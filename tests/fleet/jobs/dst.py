"""Jobs of test_fleet_dst.py: each run only leaves its evidence."""

from _evidence import record

from scheduler import RunContext, job


@job(key=21)
def tick(ctx: RunContext) -> None:
    record(ctx)


@job(key=22)
def wall(ctx: RunContext) -> None:
    record(ctx)


@job(key=23)
def nightly(ctx: RunContext) -> None:
    record(ctx)
