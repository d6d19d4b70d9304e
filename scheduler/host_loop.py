"""Coroutine jobs on the host application's event loop (`Replica` started inside it).

Elsewhere a coroutine job runs on a loop of its own in its worker thread
(`scheduler.gate.runner`). Inside an async application its coroutines belong
on the application's loop, beside the clients and pools they share: the
worker thread hands the coroutine to that loop and waits for it there, under
the same timeout handling (`ctx.timed_out` cancels it).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from scheduler.gate.runner import _await
from scheduler.registry.catalog import Catalog
from scheduler.registry.context import RunContext
from scheduler.registry.jobs import JobSpec

WAKE_EVERY = 1.0  # seconds between looks at whether the loop was closed under a run


def on_loop(catalog: Catalog, loop: asyncio.AbstractEventLoop) -> Catalog:
    """The catalog with each coroutine job run on `loop`; other jobs as they were."""
    return Catalog(
        tuple(
            replace(job, spec=_on(job.spec, loop)) if job.spec.is_async else job for job in catalog
        )
    )


def _on(spec: JobSpec, loop: asyncio.AbstractEventLoop) -> JobSpec:
    def run(ctx: RunContext) -> None:
        coroutine = spec.func(*((ctx,) if spec.takes_context else ()))
        try:
            future = asyncio.run_coroutine_threadsafe(_await(coroutine, ctx), loop)
        except RuntimeError:  # the loop is closed: the application is going away
            coroutine.close()
            raise RuntimeError("the application's event loop is closed") from None
        while True:
            try:
                future.result(WAKE_EVERY)
                return
            except TimeoutError:
                if loop.is_closed():
                    raise RuntimeError(
                        "the application's event loop closed during the run"
                    ) from None

    return replace(spec, func=run, takes_context=True, is_async=False)
