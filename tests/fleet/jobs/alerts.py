"""Jobs of test_fleet_alerts.py."""

from pathlib import Path

from _evidence import EVIDENCE, exclusive

from scheduler import RunContext, job


@job(key=31)
def sometimes_slow(ctx: RunContext) -> None:
    """The first run takes 7 s, every later one is instant: about 6 ticks find it going."""
    first = Path(EVIDENCE).parent / "first-run-done"
    if first.exists():
        exclusive(ctx, 0.001)
        return
    first.touch()
    longer = Path(EVIDENCE).parent / "slow-run-seconds"  # a test that reads it while it runs
    if longer.exists():
        exclusive(ctx, float(longer.read_text()))
    else:
        exclusive(ctx, 7, until_stopping=False)
