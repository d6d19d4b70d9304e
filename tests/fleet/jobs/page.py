"""Jobs of test_page.py: one that runs, one that fails with HTML in its error, two to pause."""

import time

from _evidence import record

from scheduler import RunContext, job


@job(key=171)
def page_steady(ctx: RunContext) -> None:
    record(ctx)
    time.sleep(0.05)


@job(key=172)
def page_fails(ctx: RunContext) -> None:
    record(ctx)
    raise RuntimeError("<script>window.injected = 1</script><b>not bold</b> & broken")


@job(key=173)
def page_paused(ctx: RunContext) -> None:
    record(ctx)


@job(key=174)
def page_toggle(ctx: RunContext) -> None:
    record(ctx)
