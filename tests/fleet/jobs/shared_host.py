"""Jobs of test_embedded_*.py: a 10 s run that must never overlap, and a quick one."""

from _evidence import exclusive, record

from scheduler import RunContext, job


@job(key=2701)
def ten_seconds(ctx: RunContext) -> None:
    exclusive(ctx, 10)


@job(key=2702)
def quick(ctx: RunContext) -> None:
    record(ctx)


@job(key=2703)
def closes_descriptors(ctx: RunContext) -> None:
    """Its first run closes every descriptor it did not open, as careless code does."""
    import os
    import threading

    from _evidence import EVIDENCE, _enter

    folder = os.path.dirname(EVIDENCE)
    first = not os.path.exists(os.path.join(folder, "closed-once"))
    if first:
        open(os.path.join(folder, "closed-once"), "w").close()
    marker = os.path.join(folder, ctx.job_name + ".running")
    overlap = _enter(marker)
    record(ctx, event="start", overlap=overlap, closes=first)
    if first:
        os.closerange(3, 1000)
    threading.Event().wait(5)
    if not overlap:
        os.unlink(marker)
    record(ctx, event="end")
