"""Soak: a random fault every few seconds over thousands of ticks.

Not part of the default run (it takes minutes). Run it with

    .venv/bin/pytest -m soak -s -n 0

SOAK_TICKS (default 2000) sets how many ticks the chaos window holds at least
(8 jobs every second: 5000 ticks is about 11 minutes); SOAK_SEED replays the
faults' choices; SOAK_REPORT names a JSON file to write the figures to.

Besides eight jobs every second, `retrying` (every 2 s) fails its first attempt of a
tick half the time and has two retries, and `catching` (every second) has
`catch_up: all`: retries and catch-up passes cross every fault too.

Replica faults, one at a time and on one replica at a time (so at least one
replica is healthy): SIGKILL and restart, SIGSTOP for 1-10 s (beyond
holder_timeout too), every replica session killed, SIGTERM and restart,
restart with a clock skewed by up to ±0.45 s. Meanwhile, and overlapping with
them, an outside session holds ledger rows FOR UPDATE, as a report query or
an operator's open transaction would: a few jobs' `scheduler_jobs` rows (in
random order) or all of them for 1-8 s, longer than a lock-session statement
may wait, and now and then a `running` row of `scheduler_ticks` for a few
seconds; a pending retry's attempt row in `scheduler_attempts` (inserted, not
committed: the retry look that copies the attempt waits on it, then fails); and
the rows of `catching`'s next few ticks (inserted, not committed: those claims
fail the same way). That session takes its row locks with SKIP LOCKED or a
200 ms lock_timeout, so it never waits for long itself and can never be part of
a deadlock: any deadlock counted is one between the fleet's own sessions.

Afterwards, every tick in the window must have run exactly once (each attempt
of a retried tick once), or be explained by the ledger: `skipped` (its job's
previous run held the lock), `missed`, `crashed` or `interrupted` (a run or
claim cut down by a fault), or
`paused`. No retry may be left pending, and no replica may have found a stray
lock (a lock held with no run of its job: every failed claim gives its locks
back at once; the heartbeat's check logs and counts any it finds). No deadlock
may have happened in the test database, counted both
by `pg_stat_database.deadlocks` and by `deadlock detected` lines appended to
the server's log during the soak (when that log is readable here).
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from tests.fleet.soaking import (
    HOLDER,
    RowLocks,
    ServerLog,
    account,
    deadlocks,
    every,
    log_lines,
    restart,
    sessions_lost,
    summary,
    wait_sessions_gone,
)
from tests.support import Fleet

pytestmark = [pytest.mark.soak, pytest.mark.fleet]

QUICK_JOBS = 6  # quick_0 .. quick_5 in jobs/soak.py, keys 500 .. 505
NAMES = [f"quick_{i}" for i in range(QUICK_JOBS)] + ["wobbly_a", "wobbly_b", "retrying", "catching"]
KEYS = [500 + i for i in range(QUICK_JOBS)] + [520, 521, 530, 531]
SCHEDULES: dict[str, dict[str, Any]] = {
    **{name: {"interval": "1s"} for name in NAMES},
    "retrying": {"interval": "2s", "retries": 2, "retry_delay": "1s"},
    "catching": {
        "interval": "1s",
        "catch_up": "all",
        "catch_up_window": "20s",
        "catch_up_limit": 20,
    },
}
EVERY = {name: 2 if name == "retrying" else 1 for name in NAMES}  # seconds between ticks
REPLICAS = ("s1", "s2", "s3")
# After the chaos: sweeps record what was missed. A `catching` tick with no row is
# recorded by the sweep once it leaves its 20 s catch-up window, and sweeps run every
# 30 s fleet-wide: 20 + 30 s and a margin after the window's last tick.
CALM_S = 70


def test_soak(tmp_path, database_url):
    target = int(os.environ.get("SOAK_TICKS", "2000"))
    seed = int(os.environ.get("SOAK_SEED", str(int(time.time()))))
    # The window starts 2 s after the chaos and ends 1 s before its end.
    per_second = sum(1 / every for every in EVERY.values())
    seconds = max(30, math.ceil(target / per_second) + 4)
    rng = random.Random(seed)
    fleet = Fleet(
        tmp_path,
        database_url,
        SCHEDULES,
        settings={"holder_timeout": 6, "misfire_grace": 5, "shutdown_grace": 5},
        job_files=["soak.py"],
    )
    server_log = ServerLog.find(database_url)
    deadlocks_before = deadlocks(database_url)
    for name in REPLICAS:
        fleet.start(name)
    faults: Counter[str] = Counter()
    timeline: list[tuple[str, str, str]] = []
    rows = RowLocks(database_url, random.Random(seed + 1), KEYS, (531, "catching"))
    try:
        fleet.wait_ready()
        start = datetime.now(UTC) + timedelta(seconds=2)
        deadline = time.monotonic() + seconds
        rows.start()
        while time.monotonic() < deadline:
            time.sleep(rng.uniform(2, 5))
            at = datetime.now(UTC).isoformat()
            fault, name = _inject(fleet, rng, database_url)
            faults[fault] += 1
            timeline.append((at, fault, name))
        end = datetime.now(UTC) - timedelta(seconds=1)
        rows.finish()
        for replica in fleet.replicas.values():
            replica.signal(signal.SIGCONT)
        for name in REPLICAS:
            if fleet.replicas[name].process.poll() is not None:
                restart(fleet, name)
        time.sleep(CALM_S)
        codes = fleet.stop()
    finally:
        rows.finish()
        fleet.kill_all()
    wait_sessions_gone(database_url)
    deadlocks_after = deadlocks(database_url)
    expected = {name: every(EVERY[name], retried=name == "retrying") for name in NAMES}
    report = {"seed": seed, **account(fleet, start, end, expected)}
    report["faults"] = dict(faults + rows.faults)
    report["deadlocks"] = {
        "pg_stat_database": deadlocks_after - deadlocks_before,
        "pg_stat_database_before_after": [deadlocks_before, deadlocks_after],
        "server_log": server_log.deadlocks(),
    }
    report["running_row_not_found"] = rows.not_found
    report["row_lock_errors"] = rows.errors[:20]
    report["lock_sessions_lost"] = sessions_lost(fleet)
    report["locks_given_back"] = log_lines(fleet, "gave back lock(s) of")
    report["stray_locks_released"] = log_lines(fleet, "stray lock(s) released")
    report["exit_codes"] = codes
    print(summary(report))
    print(json.dumps(report, indent=2, default=str))
    report["timeline"] = sorted(timeline + rows.timeline)
    if os.environ.get("SOAK_REPORT"):
        with open(os.environ["SOAK_REPORT"], "w") as f:
            json.dump(report, f, indent=2, default=str)
    assert set(codes.values()) == {0}, codes
    assert report["ticks"] >= target, report["ticks"]
    assert report["duplicates"] == 0, report["duplicate_detail"]
    assert report["unexplained_gaps"] == 0, report["unexplained"]
    assert report["stray_locks_released"] == 0, report["stray_locks_released"]
    assert report["deadlocks"]["pg_stat_database"] == 0, report["deadlocks"]
    logged = report["deadlocks"]["server_log"]["lines"]
    assert logged in (0, None), report["deadlocks"]


def _inject(fleet: Fleet, rng: random.Random, database_url: str) -> tuple[str, str]:
    name = rng.choice(REPLICAS)
    replica = fleet.replicas[name]
    fault = rng.choice(["kill", "freeze", "sessions", "term", "skew"])
    if fault == "sessions":
        with psycopg.connect(database_url, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                " AND application_name <> %s",
                (HOLDER,),
            )
    elif fault == "freeze":
        replica.signal(signal.SIGSTOP)
        time.sleep(rng.uniform(1, 10))
        replica.signal(signal.SIGCONT)
    elif fault == "kill":
        replica.signal(signal.SIGKILL)
        replica.wait(10)
        time.sleep(rng.uniform(0.5, 3))
        restart(fleet, name)
        fleet.wait_ready()
    else:
        replica.signal(signal.SIGTERM)
        replica.wait(30)
        offset = f"{rng.uniform(-0.45, 0.45):+.2f}s" if fault == "skew" else None
        restart(fleet, name, clock_offset=offset)
        fleet.wait_ready()
    return fault, name
