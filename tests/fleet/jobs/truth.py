"""Jobs of test_fleet_truth.py: what a job may say or do, the ledger records truthfully."""

import os
import threading
from pathlib import Path

from _evidence import EVIDENCE, exclusive, record

from scheduler import Interrupted, RunContext, job


@job(key=71)
def healthy(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)


@job(key=72)
def poisoned(ctx: RunContext) -> None:
    name = os.fsdecode(b"report-\xff.csv")  # a lone surrogate, as file names bring
    raise ValueError("upstream said: \x00\x01 garbage in " + name)


@job(key=73)
def careful(ctx: RunContext) -> None:
    record(ctx, event="start")
    while not (ctx.stopping.is_set() or ctx.lock_lost.is_set()):
        threading.Event().wait(0.02)
    raise Interrupted("told to stop; the rest waits for the next run")


@job(key=74)
def overrun(ctx: RunContext) -> None:
    marker = Path(EVIDENCE).parent / "slow-runs"
    done = int(marker.read_text()) if marker.exists() else 0
    if done < 2:  # the first two runs take 8 s on a 2 s grid; later ones keep up
        marker.write_text(str(done + 1))
        exclusive(ctx, 8, until_stopping=False)
    else:
        exclusive(ctx, 0.001)


@job(key=75)
def lingering(ctx: RunContext) -> None:
    record(ctx, event="start")
    # A thread of the job's own, not a daemon thread: the interpreter would wait for it.
    threading.Thread(target=lambda: threading.Event().wait(3600), daemon=False).start()
    # Its error text tries to forge a log line and rewrite the terminal.
    forged = "\n2026-01-01 00:00:00,000 INFO    scheduler.runs: run succeeded\x1b[2J"
    raise RuntimeError("boom" + forged)
