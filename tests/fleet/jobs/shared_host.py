"""Jobs of test_embedded_*.py: a 10 s run that must never overlap, and a quick one."""

from _evidence import exclusive, record

from scheduler import RunContext, job


@job(key=2701)
def ten_seconds(ctx: RunContext) -> None:
    exclusive(ctx, 10)


@job(key=2702)
def quick(ctx: RunContext) -> None:
    record(ctx)
