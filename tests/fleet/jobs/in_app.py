"""Jobs of test_in_app_hosts.py: a job every second and one every 3 s that runs 1.5 s, and
one run by hand that runs until it is told to stop; each records whether another run of
the job was going meanwhile."""

from _evidence import exclusive

from scheduler import RunContext, job


@job(key=3101)
def every_second(ctx: RunContext) -> None:
    exclusive(ctx, 0.3)


@job(key=3102)
def every_three_seconds(ctx: RunContext) -> None:
    exclusive(ctx, 1.5)


@job(key=3103)
def until_stopped(ctx: RunContext) -> None:
    """Unscheduled: run by hand, it runs until its replica stops (a minute at most)."""
    exclusive(ctx, 60)
