"""A job of test_fleets_apart.py: key 2001, named `report_mail`."""

from _evidence import exclusive

from scheduler import RunContext, job


@job(key=2001, name="report_mail")
def work(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)
