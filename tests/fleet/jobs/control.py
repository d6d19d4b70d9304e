"""Jobs of test_fleet_control.py: an instant run every second, to pause and resume."""

from _evidence import exclusive

from scheduler import RunContext, job


@job(key=141)
def steady(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)
