"""The benchmark suite: what the gate costs, side by side with the alternatives.

    .venv/bin/python bench/run.py          # about 5 minutes on 2 cores

Runs against the local PostgreSQL (SCHEDULER_BENCH_DATABASE_URL, default
postgresql://postgres@127.0.0.1:5432/postgres), one fresh database per
scenario, and writes bench/RESULTS.md and bench/results.json. The
alternatives: the usual advice done literally (bench/alternatives/naive_lock.py)
and APScheduler 4.0.0a6 with its SQLAlchemy data store and psycopg event
broker (bench/alternatives/apscheduler4.py, in its own virtual environment,
bench/.venv-aps4, created on the first run).

Everything is measured from outside the replicas: the jobs' own evidence
lines (which ticks ran, where, when), the server's statistics and statement
log, and /proc.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fleet import (
    APS4_INSTALL,
    APS4_PYTHON,
    BENCH,
    SERVER,
    Fleet,
    Server,
    now_iso,
    process_rss_mb,
    run_fleet,
    wait_for_runs,
)

SKEW = ("+0.45s", "-0.45s", None)
# Jobs of each replica in the 100-replica run. Every replica fires every job, so the
# fleet fires 100,000 ticks a second; each replica queues only its own share of them
# (scheduler/gate/others.py), and the rest cost it one probe a second.
SCALE_JOBS = 1000


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def round_trips(server: Server) -> dict[str, Any]:
    """Statements per tick, counted in the server's log, per replica and per session."""
    out: dict[str, Any] = {}
    for jobs in (1, 10):
        r = run_fleet(server, "ours", 3, jobs, 10, statements=True)
        per_replica = []
        for pid, session in r.pop("statements").items():
            kinds = session["kinds"]
            if "pg_advisory_lock_shared" not in kinds:
                continue  # the ledger (housekeeping) session
            per_replica.append(
                {
                    "instance": session["app"],
                    "claims": kinds["scheduler_claim"],
                    "finishes": kinds["scheduler_finish"],
                    "heartbeats": kinds["now()"],
                    "runs": r["by_instance"].get(session["app"], 0),
                    "pid": pid,
                }
            )
        out[f"ours_{jobs}_jobs"] = {**r, "lock_sessions": per_replica}
    return out


def summarize_round_trips(r: dict[str, Any]) -> dict[str, float]:
    """Calls per tick from the server's counts.

    A claim call answers every tick of its batch (won and lost alike); a finish
    call records the batch of runs that ended together. Per tick: the runner
    pays its share of one claim and of one finish; every other replica its
    share of one claim.
    """
    sessions = r["lock_sessions"]
    ticks = sum(s["runs"] for s in sessions)  # every tick ran once, on one of them
    claims = sum(s["claims"] for s in sessions)
    finishes = sum(s["finishes"] for s in sessions)
    replicas = len(sessions)
    claim_share = claims / replicas / max(1, ticks)  # claim calls per tick, per replica
    return {
        "runner": round(claim_share + finishes / max(1, ticks), 3),
        "other": round(claim_share, 3),
        "heartbeats": sum(s["heartbeats"] for s in sessions),
    }


def alternative_round_trips(r: dict[str, Any]) -> dict[str, Any]:
    """Statements and sessions per tick for an alternative, from the server's log."""
    statements = r.pop("statements", {})
    total = sum(sum(s["kinds"].values()) for s in statements.values())
    runs = sum(r["by_instance"].values())
    replicas = r["replicas"]
    return {
        "statements_per_run_fleet": round(total / max(1, runs), 2),
        "statements_per_run_per_replica": round(total / max(1, runs) / replicas, 2),
        # every backend pid in the log is one connection (the naive lock opens one per run)
        "connections_per_run_fleet": round(len(statements) / max(1, runs), 2),
    }


# Idle: jobs with nothing due during the run. Grids are anchored at the epoch, so
# hourly jobs all fire at the top of every hour, and a run that spans one is not
# idle (seen: 17.5 transactions a minute instead of 8). Every 30 days instead.
IDLE_INTERVAL_S = 30 * 86400


class Idle:
    """One idle replica of each kind, each in its own database, for the whole run.

    Transactions are counted in the server's statement log (exact, and never
    behind like the cumulative statistics of a long-lived session can be).
    """

    def __init__(self, server: Server, kinds: list[str]) -> None:
        self.server = server
        self.fleets: list[Fleet] = []
        self.began = 0.0
        self.offset = 0
        for kind in kinds:
            database = server.create(f"idle_{kind}", log_statements=True)
            fleet = Fleet(kind, server, database, 100, interval_s=IDLE_INTERVAL_S)
            fleet.start(f"idle-{kind}")
            self.fleets.append(fleet)

    def begin(self) -> None:
        time.sleep(8)  # past start-up
        self.began, self.offset = time.time(), self.server.log_offset()

    def finish(self) -> dict[str, Any]:
        minutes = (time.time() - self.began) / 60
        sessions = {f.kind: len(self.server.sessions(f.database)) for f in self.fleets}
        ended = self.server.log_offset()
        out = {}
        for fleet in self.fleets:
            count = self.server.logged_transactions(fleet.database, self.offset)
            fleet.stop()
            self.server.drop(fleet.database)
            out[fleet.kind] = {
                "minutes": round(minutes, 2),
                "transactions_per_minute": round(count / minutes, 1) if count >= 0 else None,
                "sessions": sessions[fleet.kind],
                "log_bytes": ended - self.offset,
            }
        return out


# What a PostgreSQL replica imports from its dependencies, and nothing of ours.
LIBRARIES = (
    "asyncio",
    "psycopg",
    "sqlalchemy",
    "sqlalchemy.dialects.postgresql.psycopg",
    "pydantic_settings",
    "apscheduler.schedulers.background",
    "yaml",
)
_RSS = "print([l for l in open('/proc/self/status') if l.startswith('VmRSS')][0].split()[1])"


def import_floor() -> dict[str, float]:
    """RSS of a bare interpreter, and of one that has only imported the libraries."""

    def rss(imports: tuple[str, ...]) -> float:
        code = "".join(f"import {name}\n" for name in imports) + _RSS
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        return round(int(out.stdout.strip()) / 1024, 1)

    return {"interpreter_mb": rss(()), "libraries_mb": rss(LIBRARIES)}


def memory_and_start(server: Server) -> list[dict[str, Any]]:
    out = []
    for jobs in (10, 100, 1000):
        database = server.create(f"mem{jobs}")
        fleet = Fleet(
            "ours", server, database, jobs, interval_s=IDLE_INTERVAL_S, first_every_second=True
        )
        replica = fleet.start("mem")
        try:
            log_path = fleet.root / "mem.log"
            deadline = time.monotonic() + 60
            while "lock session up" not in log_path.read_text(errors="replace"):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no start-up within 60 s: {log_path}")
                time.sleep(0.05)
            ready = time.time() - replica.launched
            wait_for_runs(fleet)
            first = (fleet.first_run_at() or 0) - replica.launched
            time.sleep(3)
            rss = process_rss_mb(replica.process.pid)
        finally:
            fleet.stop()
            server.drop(database)
        out.append(
            {
                "jobs": jobs,
                "rss_mb": round(rss, 1),
                "ready_s": round(ready, 2),
                "first_run_s": round(first, 2),
            }
        )
    return out


def long_runs(server: Server) -> dict[str, Any]:
    """Sessions while many runs are going at once: 50 jobs that each run for 5 s."""
    r = run_fleet(server, "ours", 2, 50, 6, max_workers=100, job_seconds=5, warmup=3)
    return {
        "jobs": 50,
        "concurrent_runs_per_replica": 25,
        "sessions_per_replica": r["sessions_per_replica"],
    }


def ensure_aps4() -> bool:
    if APS4_PYTHON.exists():
        return True
    log("creating bench/.venv-aps4 for APScheduler 4.0.0a6")
    try:
        subprocess.run([sys.executable, "-m", "venv", str(APS4_PYTHON.parent.parent)], check=True)
        subprocess.run([str(APS4_PYTHON), "-m", "pip", "install", "-q", *APS4_INSTALL], check=True)
    except subprocess.CalledProcessError as exc:
        log(f"APScheduler 4 not available: {exc}")
        return False
    return True


# What the figures depend on (the results themselves excepted), for the commit line.
MEASURED_FILES = (
    "scheduler",
    "bench",
    "pyproject.toml",
    ":(exclude)bench/RESULTS.md",
    ":(exclude)bench/results.json",
)


def environment(server: Server) -> dict[str, str]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    versions = {}
    for package in ("APScheduler", "SQLAlchemy", "psycopg", "pydantic-settings"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "-"
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=BENCH
    ).stdout.strip()
    changed = subprocess.run(
        ["git", "status", "--porcelain", "--", *MEASURED_FILES],
        capture_output=True,
        text=True,
        cwd=BENCH.parent,
    ).stdout.strip()
    if changed:
        commit += " with uncommitted changes"
    return {
        "date": now_iso(),
        "machine": f"{os.cpu_count()} cores ({cpu}), {memory:.0f} GiB",
        "os": platform.platform(),
        "python": platform.python_version(),
        "postgresql": server.version,
        "packages": ", ".join(f"{k} {v}" for k, v in versions.items()),
        "commit": commit,
    }


def others_kept(new: str, old: str) -> str:
    """`new`, followed by the sections of `old` it does not have: those other scripts
    wrote (bench/page_load.py's "The page", bench/in_app.py's), kept as they were."""
    have = {line for line in new.splitlines() if line.startswith("## ")}
    kept = [
        section
        for section in re.split(r"(?m)^(?=## )", old)
        if section.startswith("## ") and section.splitlines()[0] not in have
    ]
    return "\n".join([new.rstrip("\n"), *(k.rstrip("\n") for k in kept)]) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description="Run the benchmarks; write RESULTS.md.")
    parser.add_argument("--quick", action="store_true", help="shorter windows (smoke test)")
    parser.add_argument(
        "--base", type=Path, help="a checkout to measure the edges and the scale run beside"
    )
    parser.add_argument(
        "--scale-jobs", type=int, default=SCALE_JOBS, help="jobs of each of the 100 replicas"
    )
    args = parser.parse_args()
    began = time.monotonic()
    server = Server(SERVER)
    results: dict[str, Any] = {"environment": environment(server)}
    aps4 = ensure_aps4()
    window = 4 if args.quick else 7

    log("idle replicas (measured over the whole run)")
    idle = Idle(server, ["ours", *(["aps4"] if aps4 else [])])
    idle.begin()

    log("round trips per tick (server log)")
    rt = round_trips(server)
    results["round_trips"] = {
        k: {
            **summarize_round_trips(v),
            "lateness_p50_ms": v["lateness_p50_ms"],
            "lateness_p99_ms": v["lateness_p99_ms"],
            "duplicates": v["duplicates"],
            "missing": v["missing"],
            "lock_sessions": v["lock_sessions"],
        }
        for k, v in rt.items()
    }

    log("fleet scale")
    matrix = []
    for replicas in (1, 3, 6):
        for jobs in (10, 100, 500):
            log(f"  {replicas} replica(s) x {jobs} jobs")
            r = run_fleet(server, "ours", replicas, jobs, window, max_workers=200)
            r.pop("by_instance")
            matrix.append(r)
    results["scale"] = matrix

    log("sessions with long runs")
    results["long_runs"] = long_runs(server)

    log("memory and start-up")
    results["memory"] = memory_and_start(server)
    results["import_floor"] = import_floor()

    log("side by side: clock skew of +-0.45 s, 1 ms jobs, 3 replicas, 10 jobs")
    side: dict[str, Any] = {}
    for kind in ("ours", "naive", *(["aps4"] if aps4 else [])):
        log(f"  {kind}")
        r = run_fleet(server, kind, 3, 10, window, offsets=SKEW, statements=kind != "ours")
        extra = alternative_round_trips(r) if kind != "ours" else {}
        r.pop("statements", None)
        side[kind] = {**r, **extra}
    if aps4:
        log("  aps4 without skew (lateness), 3 replicas, 10 and 100 jobs")
        for jobs in (10, 100):
            r = run_fleet(server, "aps4", 3, jobs, window, statements=jobs == 10)
            extra = alternative_round_trips(r) if jobs == 10 else {}
            side[f"aps4_{jobs}_no_skew"] = {**r, **extra}
        for jobs in (10, 100):
            r = run_fleet(server, "ours", 3, jobs, window, max_workers=200)
            side[f"ours_{jobs}_no_skew"] = r
    results["side_by_side"] = side

    from edges import edges

    log("at the edges: bursts of 1,000 and 5,000 ticks, 1,000 ticks a second")
    results["edges"] = edges(server, args.base, args.quick)

    from scale import scale

    log(f"at scale: 100 replicas x {args.scale_jobs} jobs, steady and with a kill every 5 s")
    results["at_scale"] = scale(args.base, 100, args.scale_jobs, 30 if args.quick else 120)

    log("idle load")
    results["idle"] = idle.finish()
    results["elapsed_s"] = round(time.monotonic() - began, 1)

    (BENCH / "results.json").write_text(json.dumps(results, indent=2, default=str))
    from report import render

    md = BENCH / "RESULTS.md"
    text = others_kept(render(results), md.read_text() if md.exists() else "")
    md.write_text(text)
    print(text)
    log(f"done in {results['elapsed_s']:.0f} s: bench/RESULTS.md, bench/results.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
