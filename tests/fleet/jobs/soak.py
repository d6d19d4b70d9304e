"""Jobs of test_soak.py: six instant jobs and two whose runs last 0 to 1.5 s."""

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
