"""Run one job function with its context; sync and async jobs alike."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import traceback
from collections.abc import Awaitable

from scheduler.registry.context import Interrupted, RunContext
from scheduler.registry.jobs import JobSpec
from scheduler.statuses import Status
from scheduler.text import MAX_STORED


def execute(spec: JobSpec, ctx: RunContext) -> tuple[Status, str | None]:
    """Returns (status, error). Nothing a job raises may reach the daemon."""
    args = (ctx,) if spec.takes_context else ()
    try:
        result = spec.func(*args)
        if inspect.isawaitable(result):
            asyncio.run(_await(result, ctx))
    except Interrupted as exc:
        reason = str(exc) or None
        ctx.log.warning("run interrupted%s", f": {reason}" if reason else "")
        return Status.INTERRUPTED, reason
    except BaseException as exc:  # a job's SystemExit must not stop the daemon
        ctx.log.error("run failed: %s", describe(exc), exc_info=exc)
        return Status.FAILED, describe(exc)
    return Status.SUCCEEDED, None


CANCEL_AGAIN_EVERY = 1.0  # seconds between cancellations of a coroutine past its timeout


async def _await(awaitable: Awaitable[object], ctx: RunContext) -> None:
    """Await the job; once the run has timed out (ctx.timed_out), cancel it, and cancel it
    again every second until it ends: a coroutine may catch CancelledError and go on, and
    it holds the job's lock until it ends."""
    task = asyncio.ensure_future(awaitable)
    while not task.done():
        await asyncio.wait({task}, timeout=0.1)
        if ctx.timed_out.is_set() and not task.done():
            await _cancel(task, ctx)
            return
    task.result()


async def _cancel(task: asyncio.Future[object], ctx: RunContext) -> None:
    said = False
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=CANCEL_AGAIN_EVERY)
        if not task.done() and not said:
            ctx.log.warning(
                "cancelled after its timeout, it goes on: cancelling it again every second"
            )
            said = True
    with contextlib.suppress(asyncio.CancelledError):  # what else it raised is told
        task.result()


def describe(exc: BaseException) -> str:
    """The error in one line of the ledger: type, message, and the job's own line."""
    try:
        message = str(exc)
    except Exception:  # an exception whose __str__ raises
        message = "(its message could not be read)"
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        last = frames[-1]
        text += f" ({last.filename.rsplit('/', 1)[-1]}:{last.lineno})"
    return text[:MAX_STORED]
