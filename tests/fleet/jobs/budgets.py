"""Jobs of test_network_budgets.py."""

from pathlib import Path

from _evidence import EVIDENCE, record

from scheduler import RunContext, job

FLIP = Path(EVIDENCE).parent / "flip"  # the test creates it when notices are to begin


@job(key=181)
def flip_flop(ctx: RunContext) -> None:
    """Once FLIP exists, fails on odd seconds: with `fail_alert_after: 1`, a notice a run."""
    record(ctx, event="start")
    if FLIP.exists() and int(ctx.scheduled_at.timestamp()) % 2:
        raise RuntimeError("odd second")
