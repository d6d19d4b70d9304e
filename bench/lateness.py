"""Fire lateness and sessions per replica for a small fleet.

    python bench/lateness.py [--replicas 3] [--jobs 10] [--seconds 30] [--max-workers 10]

Starts real `scheduler run` replicas against a fresh database on the local
PostgreSQL (SCHEDULER_BENCH_DATABASE_URL, default postgresql://postgres@127.0.0.1:5432/postgres),
all jobs on 1 s intervals, then reports, from the ledger and the server:
lateness (start minus scheduled time, database clock) p50/p99/max, ticks
run more than once, and the most sessions each replica held at any sample.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psycopg
from fleet import SERVER


def database(name: str) -> str:
    return SERVER.rsplit("/", 1)[0] + "/" + name


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--job-seconds", type=float, default=0.001, help="how long each run takes")
    parser.add_argument("--max-workers", type=int, default=10, help="SCHEDULER_MAX_WORKERS")
    args = parser.parse_args()

    name = f"scheduler_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(SERVER, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = database(name)
    root = Path(tempfile.mkdtemp(prefix="scheduler-bench-"))
    (root / "jobs").mkdir()
    code = ["import threading", "from scheduler import job", ""]
    lines = ["jobs:"]
    for i in range(args.jobs):
        code += [
            f"@job(key={10_000 + i})",
            f"def job_{i}(ctx):",
            f"    threading.Event().wait({args.job_seconds})",
            "",
        ]
        lines.append(f"  job_{i}: {{interval: 1s}}")
    (root / "jobs" / "bench_jobs.py").write_text("\n".join(code))
    (root / "config.yaml").write_text("\n".join(lines) + "\n")

    replicas = []
    for r in range(args.replicas):
        env = dict(
            os.environ,
            SCHEDULER_DATABASE_URL=url,
            SCHEDULER_INSTANCE_NAME=f"bench-{r}",
            SCHEDULER_CONFIG=str(root / "config.yaml"),
            SCHEDULER_MAX_WORKERS=str(args.max_workers),
        )
        replicas.append(
            subprocess.Popen(
                [sys.executable, "-m", "scheduler", "run"],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    sessions: dict[str, int] = {}
    try:
        time.sleep(3)  # start-up
        start = time.time()
        with psycopg.connect(url, autocommit=True) as conn:
            while time.time() - start < args.seconds:
                rows = conn.execute(
                    "SELECT application_name, count(*) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND application_name LIKE 'bench-%'"
                    " GROUP BY 1"
                ).fetchall()
                for app, count in rows:
                    sessions[app] = max(sessions.get(app, 0), count)
                time.sleep(0.5)
    finally:
        for p in replicas:
            p.send_signal(signal.SIGTERM)
        codes = [p.wait(60) for p in replicas]

    with psycopg.connect(url) as conn:
        late = [
            row[0]
            for row in conn.execute(
                "SELECT extract(epoch FROM started_at - scheduled_at)::float8 FROM scheduler_ticks"
                " WHERE status = 'succeeded'"
            )
        ]
        statuses = dict(
            conn.execute("SELECT status, count(*) FROM scheduler_ticks GROUP BY 1").fetchall()
        )
    with psycopg.connect(SERVER, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')

    print(f"replicas {args.replicas}, jobs {args.jobs} on 1 s intervals, {args.seconds:g} s")
    print(f"runs: {statuses}")
    if late:
        p50, p99 = statistics.median(late) * 1000, quantile(late, 0.99) * 1000
        print(
            f"lateness (start - scheduled, database clock): p50 {p50:.1f} ms, "
            f"p99 {p99:.1f} ms, max {max(late) * 1000:.1f} ms"
        )
    print(
        "sessions per replica (most seen at once): "
        + ", ".join(f"{k}={v}" for k, v in sorted(sessions.items()))
    )
    print(f"exit codes: {codes}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
