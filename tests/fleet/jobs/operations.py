"""Jobs of the operations tests: health and metrics, pings, logs, PgBouncer."""

from _evidence import exclusive, record

from scheduler import RunContext, job


@job(key=61)
def every_second(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)


@job(key=62)
def always_fails(ctx: RunContext) -> None:
    record(ctx, event="start")
    raise RuntimeError("disk full")
