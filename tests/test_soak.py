"""Soak: a random fault every few seconds over thousands of ticks.

Not part of the default run (it takes minutes). Run it with

    .venv/bin/pytest -m soak -s

SOAK_TICKS (default 2000) sets how many ticks the chaos phase covers;
SOAK_REPORT names a JSON file to write the figures to. Faults, one at a time
and on one replica at a time (so at least one replica is healthy): SIGKILL
and restart, SIGSTOP for 1-10 s (beyond holder_timeout too), every database
session killed, SIGTERM and restart, restart with a clock skewed by up to
±0.45 s. Afterwards, every tick in the window must have run exactly once, or
be explained by the ledger: `skipped` (its job's previous run held the
lock), `missed` or `crashed` (a run or claim cut down by a fault).
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections import Counter
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from tests.support import Fleet, parse_tick, whole_seconds

pytestmark = [pytest.mark.soak, pytest.mark.fleet]

QUICK_JOBS = 6
JOBS = (
    "\n".join(
        f"""
@job(key={500 + i})
def quick_{i}(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)
"""
        for i in range(QUICK_JOBS)
    )
    + """
import random as _random

@job(key=520)
def wobbly_a(ctx: RunContext) -> None:
    exclusive(ctx, _random.uniform(0, 1.5), until_stopping=False)


@job(key=521)
def wobbly_b(ctx: RunContext) -> None:
    exclusive(ctx, _random.uniform(0, 1.5), until_stopping=False)
"""
)
NAMES = [f"quick_{i}" for i in range(QUICK_JOBS)] + ["wobbly_a", "wobbly_b"]
REPLICAS = ("s1", "s2", "s3")
CALM_S = 35  # after the chaos: sweeps record what was missed


def test_soak(tmp_path, database_url):
    target = int(os.environ.get("SOAK_TICKS", "2000"))
    seconds = max(30, target // len(NAMES) + 1)
    rng = random.Random(int(os.environ.get("SOAK_SEED", str(int(time.time())))))
    schedules = {name: {"interval": "1s"} for name in NAMES}
    fleet = Fleet(
        tmp_path,
        database_url,
        schedules,
        settings={"holder_timeout": 6, "misfire_grace": 5, "shutdown_grace": 5},
        job_code=JOBS,
    )
    for name in REPLICAS:
        fleet.start(name)
    faults: Counter[str] = Counter()
    timeline: list[tuple[str, str, str]] = []
    try:
        fleet.wait_ready()
        start = datetime.now(UTC) + timedelta(seconds=2)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(rng.uniform(2, 5))
            at = datetime.now(UTC).isoformat()
            fault, name = _inject(fleet, rng, database_url)
            faults[fault] += 1
            timeline.append((at, fault, name))
        end = datetime.now(UTC) - timedelta(seconds=1)
        for replica in fleet.replicas.values():
            replica.signal(signal.SIGCONT)
        for name in REPLICAS:
            if fleet.replicas[name].process.poll() is not None:
                fleet.start(name)
        time.sleep(CALM_S)
        codes = fleet.stop()
    finally:
        fleet.kill_all()
    report = _report(fleet, start, end, faults)
    report["timeline"] = timeline
    print(json.dumps(report, indent=2))
    if os.environ.get("SOAK_REPORT"):
        with open(os.environ["SOAK_REPORT"], "w") as f:
            json.dump(report, f, indent=2)
    assert set(codes.values()) == {0}, codes
    assert report["ticks"] >= min(target, 2000) * 0.95
    assert report["duplicates"] == 0, report
    assert report["unexplained_gaps"] == 0, report


def _inject(fleet: Fleet, rng: random.Random, database_url: str) -> tuple[str, str]:
    name = rng.choice(REPLICAS)
    replica = fleet.replicas[name]
    fault = rng.choice(["kill", "freeze", "sessions", "term", "skew"])
    if fault == "sessions":
        with psycopg.connect(database_url, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
    elif fault == "freeze":
        replica.signal(signal.SIGSTOP)
        time.sleep(rng.uniform(1, 10))
        replica.signal(signal.SIGCONT)
    elif fault == "kill":
        replica.signal(signal.SIGKILL)
        replica.wait(10)
        time.sleep(rng.uniform(0.5, 3))
        fleet.start(name)
        fleet.wait_ready()
    else:
        replica.signal(signal.SIGTERM)
        replica.wait(30)
        offset = f"{rng.uniform(-0.45, 0.45):+.2f}s" if fault == "skew" else None
        fleet.start(name, clock_offset=offset)
        fleet.wait_ready()
    return fault, name


def _report(fleet: Fleet, start: datetime, end: datetime, faults: Counter[str]) -> dict:
    window = whole_seconds(start, end)
    started = Counter((e["job"], parse_tick(e["tick"])) for e in fleet.starts())
    ledger = {(r["job_name"], r["scheduled_at"]): r for r in fleet.ledger()}
    rows = {key: row["status"] for key, row in ledger.items()}
    outcome: Counter[str] = Counter()
    unexplained = []
    cut_down: list[tuple[str, ...]] = []
    for job in NAMES:
        for tick in window:
            runs = started[(job, tick)]
            status = rows.get((job, tick))
            if runs > 1:
                outcome["duplicates"] += 1
            elif runs == 1:
                outcome["ran_once"] += 1
            elif status in ("skipped", "missed", "crashed"):
                outcome[status] += 1
                if status == "crashed":
                    row = ledger[(job, tick)]
                    cut_down.append(
                        (
                            job,
                            tick.isoformat(),
                            row["instance"],
                            str(row["started_at"]),
                            str(row["finished_at"]),
                        )
                    )
            else:
                unexplained.append((job, tick.isoformat(), status))
    return {
        "window": [start.isoformat(), end.isoformat()],
        "ticks": len(window) * len(NAMES),
        "ran_once": outcome["ran_once"],
        "duplicates": outcome["duplicates"],
        "skipped": outcome["skipped"],
        "missed": outcome["missed"],
        "crashed_without_start": outcome["crashed"],
        "crashed_detail": cut_down[:20],
        "unexplained_gaps": len(unexplained),
        "unexplained": unexplained[:20],
        "faults": dict(faults),
    }
