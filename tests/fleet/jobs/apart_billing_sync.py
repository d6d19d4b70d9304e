"""A job of test_fleets_apart.py: key 2001, named `billing_sync`."""

from _evidence import exclusive

from scheduler import RunContext, job


@job(key=2001, name="billing_sync")
def work(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)
