"""Jobs of test_fleet_control.py: an instant run every second, to pause and resume."""

from _evidence import exclusive

from scheduler import RunContext, job


@job(key=141)
def steady(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)


@job(key=142)
def overstays(ctx: RunContext) -> None:
    """Runs until told its time is up (at most 10 s)."""
    exclusive(ctx, 0.001)
    ctx.timed_out.wait(10)
