"""Jobs of test_fleet_exactly_once.py: instant runs on a 1 s grid and a per-second cron."""

from _evidence import exclusive

from scheduler import RunContext, job


@job(key=11)
def every_second(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)


@job(key=12)
def cron_second(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)
