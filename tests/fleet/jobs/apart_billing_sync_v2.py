"""A job of test_fleets_apart.py: key 2001, named `billing_sync_v2`."""

from _evidence import exclusive

from scheduler import RunContext, job


@job(key=2001, name="billing_sync_v2")
def work(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)
