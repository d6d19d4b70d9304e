"""Run one job function with its context; sync and async jobs alike."""

from __future__ import annotations

import asyncio
import inspect
import traceback

from scheduler.context import RunContext
from scheduler.registry import JobSpec

MAX_ERROR = 2000


def execute(spec: JobSpec, ctx: RunContext) -> tuple[str, str | None]:
    """Returns (status, error). Nothing a job raises may reach the daemon."""
    args = (ctx,) if spec.takes_context else ()
    try:
        result = spec.func(*args)
        if inspect.isawaitable(result):
            asyncio.run(_await(result))
    except BaseException as exc:  # a job's SystemExit must not stop the daemon
        ctx.log.error("run failed: %s", describe(exc), exc_info=exc)
        return "failed", describe(exc)
    return "succeeded", None


async def _await(awaitable: object) -> None:
    await awaitable  # type: ignore[misc]


def describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        last = frames[-1]
        text += f" ({last.filename.rsplit('/', 1)[-1]}:{last.lineno})"
    return text[:MAX_ERROR]
