"""Jobs of test_soak.py: six instant jobs, two whose runs last 0 to 1.5 s, one whose first
attempt of a tick fails half the time (it has retries), and one that catches up."""

import random

from _evidence import exclusive

from scheduler import RunContext, job


@job(key=500)
def quick_0(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)


@job(key=501)
def quick_1(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)


@job(key=502)
def quick_2(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)


@job(key=503)
def quick_3(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)


@job(key=504)
def quick_4(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)


@job(key=505)
def quick_5(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)


@job(key=520)
def wobbly_a(ctx: RunContext) -> None:
    exclusive(ctx, random.uniform(0, 1.5), until_stopping=False)


@job(key=521)
def wobbly_b(ctx: RunContext) -> None:
    exclusive(ctx, random.uniform(0, 1.5), until_stopping=False)


@job(key=530)
def retrying(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)
    if ctx.attempt == 1 and random.random() < 0.5:
        raise RuntimeError("the first attempt fails")


@job(key=531)
def catching(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)
