"""Jobs of test_fleet_policies.py's spread test: 100 jobs on one one-minute grid."""

from collections.abc import Callable

from _evidence import record

from scheduler import RunContext, job


def _run() -> Callable[[RunContext], None]:
    def run(ctx: RunContext) -> None:
        record(ctx)

    return run


for n in range(100):
    job(key=3001 + n, name=f"minutely_{n:03d}")(_run())
