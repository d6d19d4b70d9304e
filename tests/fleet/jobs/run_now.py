"""Jobs of test_run_now_answers.py: runs long enough to kill, cut off or meet their replica."""

from _evidence import exclusive

from scheduler import RunContext, job


@job(key=181)
def lingers(ctx: RunContext) -> None:
    """15 s, whatever it is told (a lost lock does not stop it)."""
    exclusive(ctx, 15, until_stopping=False)
