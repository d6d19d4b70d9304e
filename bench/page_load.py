"""The page's server time with 100 jobs, 10 replicas and 100,000 ledger rows in its window.

    .venv/bin/python bench/page_load.py [--jobs 100] [--replicas 10] [--rows 100000] [--rounds 20]

A fresh database on the local server (`SCHEDULER_BENCH_DATABASE_URL`, as
bench/run.py): the jobs' ledger rows spread over the last hour (mostly
succeeded, some failed, skipped and missed) and their registrations; the
replicas are sessions that hold the shared lock a live replica holds, under
their names. Each round renders `/` (and `/jobs/NAME`, `/api/status`) the way
a replica's HTTP server does, and times it; then one GET goes through a real
HTTP server, to show what the socket adds.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg
from fleet import SERVER, Server

from scheduler.backends import open_backend
from scheduler.config.settings import load_config
from scheduler.ledger import tables
from scheduler.ledger.job_states import track_jobs
from scheduler.registry.catalog import load_catalog, schedule_text
from scheduler.web.routes import Page
from scheduler.web.server import HealthServer, Request, find_route

STATUSES = ["succeeded"] * 95 + ["failed"] * 3 + ["skipped", "missed"]


def project(folder: Path, jobs: int) -> Path:
    (folder / "jobs").mkdir()
    code = ["from scheduler import job\n"]
    code += [f"@job(key={5000 + i})\ndef page_{i}(ctx):\n    pass\n" for i in range(jobs)]
    (folder / "jobs" / "many.py").write_text("\n".join(code))
    lines = ["jobs:"] + [f"  page_{i}:\n    interval: {30 + i % 5 * 30}s" for i in range(jobs)]
    (folder / "config.yaml").write_text("\n".join(lines) + "\n")
    return folder / "config.yaml"


def fill(url: str, jobs: int, replicas: int, rows: int, now: datetime) -> None:
    """`rows` ticks over the last hour, spread over the jobs and the replicas."""
    rng = random.Random(7)
    step = 3600.0 / rows
    start = now - timedelta(hours=1)
    columns = "job_key, scheduled_at, job_name, status, instance, run_id, started_at,"
    columns += " finished_at, error, duration_s"
    with psycopg.connect(url) as conn, conn.cursor() as cur:
        with cur.copy(f"COPY scheduler_ticks ({columns}) FROM STDIN") as copy:
            for i in range(rows):
                job = i % jobs
                at = start + timedelta(seconds=i * step)
                status = rng.choice(STATUSES)
                ran = status in ("succeeded", "failed")
                took = rng.uniform(0.01, 3.0)
                copy.write_row(
                    (
                        5000 + job,
                        at,
                        f"page_{job}",
                        status,
                        f"replica-{(i // 7) % replicas}",
                        i + 1 if ran else None,
                        at + timedelta(milliseconds=5) if ran else None,
                        at + timedelta(seconds=took) if ran else None,
                        "RuntimeError: <upstream> said no" if status == "failed" else None,
                        took if ran else None,
                    )
                )
        conn.execute("ANALYZE scheduler_ticks")


def register(backend, catalog, replicas: int, now: datetime) -> None:
    entries = [(job.key, job.name, schedule_text(job)) for job in catalog]
    track_jobs(backend.ledger_engine, entries, now)
    with backend.ledger_engine.begin() as conn:
        conn.execute(
            tables.registrations.insert(),
            [
                {
                    "instance": f"replica-{r}",
                    "job_key": key,
                    "job_name": name,
                    "schedule": text,
                    "since": now - timedelta(hours=2),
                }
                for r in range(replicas)
                for key, name, text in entries
            ],
        )


def live_sessions(url: str, replicas: int, namespace: int) -> list[psycopg.Connection]:
    """Sessions that look like live replicas: each holds (namespace, 0) in share mode."""
    sessions = []
    for r in range(replicas):
        conn = psycopg.connect(url, autocommit=True, application_name=f"replica-{r}")
        conn.execute("SELECT pg_advisory_lock_shared(%s, 0)", (namespace,))
        sessions.append(conn)
    return sessions


def timed(route, request: Request, rounds: int) -> list[float]:
    route(request)  # warm: templates compiled, connections pooled
    out = []
    for _ in range(rounds):
        began = time.perf_counter()
        reply = route(request)
        out.append((time.perf_counter() - began) * 1000)
        assert reply.status == 200, reply.body[:200]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--replicas", type=int, default=10)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    server = Server(SERVER)
    database = server.create("page")
    url = server.database_url(database)
    sessions: list[psycopg.Connection] = []
    with tempfile.TemporaryDirectory() as folder:
        os.environ.update(SCHEDULER_DATABASE_URL=url, SCHEDULER_INSTANCE_NAME="bench-page")
        config = load_config(project(Path(folder), args.jobs))
        catalog = load_catalog(config)
        backend = open_backend(config.settings)
        try:
            backend.migrate()
            now = datetime.now(UTC)
            began = time.perf_counter()
            fill(url, args.jobs, args.replicas, args.rows, now)
            register(backend, catalog, args.replicas, now)
            print(f"ledger filled in {time.perf_counter() - began:.1f} s")
            sessions = live_sessions(url, args.replicas, config.settings.namespace)
            page = Page(backend, lambda: catalog, config.settings)
            routes = page.routes()
            results = {}
            for target in ("/", "/?window=24h", "/jobs/page_0", "/api/status"):
                path, _, query = target.partition("?")
                route = find_route(routes, "GET", path)
                results[target] = timed(route, Request("GET", path, query), args.rounds)
            http = HealthServer(
                "127.0.0.1", 0, live=lambda: True, ready=lambda: True, metrics=bytes
            )
            http.routes.update(routes)
            http.start()
            began = time.perf_counter()
            with urllib.request.urlopen(f"http://127.0.0.1:{http.port}/", timeout=30) as answer:
                size = len(answer.read())
            over_http = (time.perf_counter() - began) * 1000
            http.stop()
        finally:
            for conn in sessions:
                conn.close()
            backend.ledger_engine.dispose()
            server.drop(database)
    print(f"{args.jobs} jobs, {args.replicas} replicas, {args.rows} rows in the last hour:")
    for target, times in results.items():
        times.sort()
        p90 = times[int(len(times) * 0.9) - 1]
        print(
            f"  GET {target:<14} server time median {statistics.median(times):.0f} ms,"
            f" p90 {p90:.0f} ms, min {times[0]:.0f} ms, max {times[-1]:.0f} ms"
        )
    print(f"  GET / over HTTP once: {over_http:.0f} ms, {size / 1024:.0f} KiB")
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    print(f"  (load average {load} on {os.cpu_count()} cores: the server shares them)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
