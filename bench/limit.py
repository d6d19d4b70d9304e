"""Where the limit lies: fleets of more and more replicas of 1,000 jobs, and where the CPU goes.

    .venv/bin/python bench/limit.py [--base TREE] [--replicas 30 40 50 60] [--jobs 1000]

Each fleet on a PostgreSQL cluster of its own (as bench/scale.py: initdb, `max_connections
= 400`), with pg_stat_statements loaded, started as scale.py starts its fleets (ten
replicas a second). Once all are up and 10 s have passed, a window (`--window`, 60 s) is
measured from outside:

- what ran: the ticks of the window run once, a second (of `--jobs`); duplicates;
  the ticks not run, by what the ledger says of them (skipped, missed, crashed, no row);
  the lateness of the runs;
- where the CPU went: the machine (/proc/stat), the replicas and the server (its
  postmaster and every process under it, from /proc), in cores;
- the server's calls: per entry point (`scheduler_decide`, `scheduler_finish`,
  `scheduler_taken`, the rest together) the calls a second and their mean time inside
  the server, and the server's CPU per call (its cores over all calls a second);
- the sessions waiting: `pg_stat_activity` sampled every 50 ms, the mean number of
  active sessions waiting on a lock (`Lock`) and on CPU or anything else.

With `--base TREE`, each size is run on TREE's `scheduler` first, then on this
checkout's. Writes the section "Where the limit lies" of bench/RESULTS.md and `limit` in
bench/results.json: the sizes measured now, in place of the same sizes' rows measured
before, beside the other sizes (each row names its code and the date it was measured).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg
from edges import commit_of, replace_section, sides
from fleet import (
    BENCH,
    Fleet,
    Server,
    machine_jiffies,
    now_iso,
    process_cpu,
    verify,
    whole_ticks,
)
from scale import NotUp, ledger_statuses, log, start_cluster, start_in_tens, wait_up

SECTION = "## Where the limit lies"
SETTLE = 10.0  # s after all are up: past the first chores and the catch-up passes
UP_WITHIN = 900.0
ENTRY_POINTS = ("scheduler_decide", "scheduler_finish", "scheduler_taken")


def server_cpu(postmaster: int) -> float:
    """CPU seconds of the cluster's processes now alive: the postmaster and its children."""
    found = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(postmaster)], capture_output=True, text=True
    ).stdout.split()
    return sum(process_cpu(int(pid)) for pid in [*found, str(postmaster)])


class Waits:
    """Active sessions of the database, sampled every 50 ms: by wait event type."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.samples = 0
        self.seen: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> Waits:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self._stop.wait(0.05):
                rows = conn.execute(
                    "SELECT coalesce(wait_event_type, 'CPU') FROM pg_stat_activity"
                    " WHERE datname = current_database() AND state = 'active'"
                    " AND pid <> pg_backend_pid()"
                ).fetchall()
                self.seen.update(kind for (kind,) in rows)
                self.samples += 1

    def mean(self, kind: str) -> float:
        return round(self.seen[kind] / max(1, self.samples), 2)


def entry_point(query: str) -> str:
    found = re.search(r"\b(" + "|".join(ENTRY_POINTS) + r")\(", query)
    return found.group(1) if found else "other"


def calls(url: str) -> dict[str, dict[str, float]]:
    """Per entry point: calls and total time in the server (ms), since the last reset."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT query, calls, total_exec_time FROM pg_stat_statements"
            " WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
        ).fetchall()
    out: dict[str, dict[str, float]] = {}
    for query, n, total in rows:
        entry = out.setdefault(entry_point(query), {"calls": 0.0, "ms": 0.0})
        entry["calls"] += n
        entry["ms"] += total
    return out


def measure(
    server: Server, postmaster: int, tree: Path | None, replicas: int, jobs: int, window: float
) -> dict[str, Any]:
    database = server.create("limit")
    url = server.database_url(database)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION pg_stat_statements")
    fleet = Fleet("ours", server, database, jobs, tree=tree)
    names = [f"s{i}" for i in range(replicas)]
    try:
        began = time.time()
        start_in_tens(fleet, names)  # as bench/scale.py starts its fleets
        try:
            wait_up(fleet, names, began + UP_WITHIN)
        except NotUp as short:
            return {"replicas": replicas, "jobs": jobs, "up": short.up, "up_s": None}
        up_s = round(time.time() - began, 1)
        time.sleep(SETTLE)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("SELECT pg_stat_statements_reset()")
        start = time.time()
        replicas_cpu = {r.process.pid: process_cpu(r.process.pid) for r in fleet.replicas}
        server_before, machine_before = server_cpu(postmaster), machine_jiffies()
        with Waits(url) as waits:
            time.sleep(window)
        end = time.time()
        elapsed = end - start
        machine_after = machine_jiffies()
        used = sum(process_cpu(pid) - cpu for pid, cpu in replicas_cpu.items())
        server_used = server_cpu(postmaster) - server_before
        spent = calls(url)
    finally:
        fleet.stop(timeout=120)
    total, idle = (a - b for a, b in zip(machine_after, machine_before, strict=True))
    runs = fleet.runs()
    result = verify(runs, jobs, start, end)
    ran = {(r["job"], float(r["scheduled"])) for r in runs}
    statuses = ledger_statuses(url, start, end)
    not_run = whole_ticks(jobs, start, end) - ran
    calls_per_s = sum(e["calls"] for e in spent.values()) / elapsed
    server_cores = server_used / elapsed
    result.update(
        code=commit_of(tree or BENCH),
        date=now_iso(),
        replicas=replicas,
        jobs=jobs,
        up_s=up_s,
        runs_per_s=round(result["ran_once"] / result["seconds"]),
        not_run=dict(Counter(statuses.get(t, "no row") for t in not_run)),
        machine_cores=round((total - idle) / total * (os.cpu_count() or 1), 2),
        replicas_cores=round(used / elapsed, 2),
        server_cores=round(server_cores, 2),
        calls_per_s=round(calls_per_s),
        server_cpu_per_call_ms=round(server_cores / calls_per_s * 1000, 2) if calls_per_s else None,
        entry_points={
            name: {
                "per_s": round(e["calls"] / elapsed, 1),
                "mean_ms": round(e["ms"] / e["calls"], 2) if e["calls"] else None,
            }
            for name, e in sorted(spent.items())
        },
        waiting_on_locks=waits.mean("Lock"),
        on_cpu=waits.mean("CPU"),
    )
    server.drop(database)
    return result


def ladder(base: Path | None, sizes: list[int], jobs: int, window: float) -> dict[str, Any]:
    trees, found_in = sides(base)
    cluster = start_cluster()
    with open(cluster.data / "postgresql.conf", "a") as conf:
        conf.write("shared_preload_libraries = 'pg_stat_statements'\n")
    cluster.restart()
    out: dict[str, Any] = {"sizes": {}}
    try:
        server = Server(cluster.url())
        postmaster = int((cluster.data / "postmaster.pid").read_text().split()[0])
        for size in sizes:
            for label, tree in trees.items():
                log(f"{size} replicas x {jobs} jobs, {label} ({found_in[label]})")
                found = measure(server, postmaster, tree, size, jobs, window)
                out["sizes"].setdefault(str(size), {})[label] = found
                log("  " + ", ".join(f"{k} {v}" for k, v in found.items()))
    finally:
        cluster.remove()
    out.update(date=now_iso(), commit=commit_of(BENCH), jobs=jobs, window=window)
    if base is not None:
        out["base_commit"] = commit_of(base)
    return out


COLUMNS = (
    ("up_s", "all up (s)"),
    ("runs_per_s", "runs/s"),
    ("duplicates", "twice"),
    ("not_run", "not run (ledger)"),
    ("lateness_p50_ms", "p50 (ms)"),
    ("lateness_p99_ms", "p99 (ms)"),
    ("machine_cores", "machine (cores)"),
    ("replicas_cores", "replicas"),
    ("server_cores", "server"),
    ("calls_per_s", "server calls/s"),
    ("server_cpu_per_call_ms", "server CPU per call (ms)"),
    ("decide", "claim: per s, mean ms"),
    ("waiting_on_locks", "sessions waiting on locks"),
)


def _cell(r: dict[str, Any], key: str) -> str:
    if key == "decide":
        e = r.get("entry_points", {}).get("scheduler_decide", {})
        return f"{e.get('per_s')}, {e.get('mean_ms')}"
    if key == "not_run":
        counts = r.get("not_run") or {}
        return ", ".join(f"{n} {what}" for what, n in sorted(counts.items())) or "0"
    return str(r.get(key))


def render(found: dict[str, Any]) -> str:
    labels = ["base", "this"]
    lines = [
        SECTION,
        "",
        f"Fleets of more and more replicas, each with the same {found['jobs']:,} jobs every",
        "second (1 ms each), on a PostgreSQL cluster of their own with pg_stat_statements;",
        "measured by `.venv/bin/python bench/limit.py`, each size on the code it names (its",
        "commit; with `--base`, the base first, in the same run), a window of",
        f"{found.get('window', 0):g} s once all are up. A run adds its sizes to the table, in",
        "place of the same size's rows measured before. *runs/s*: ticks of the",
        "window run once, a second; *not run*: the rest, by what the ledger says of them.",
        "CPU in cores of this 2-core machine; *server CPU per call*: the server's cores over",
        "its calls a second (claims, finishes, probes and the rest); *claim*: the claims a",
        "second and their mean time in the server; *sessions waiting on locks*: active",
        "sessions waiting on a lock, on average (pg_stat_activity every 50 ms).",
        "",
        "| replicas | code | " + " | ".join(title for _, title in COLUMNS) + " |",
        "|---|---|" + "---|" * len(COLUMNS),
    ]
    for size, by_label in sorted(found["sizes"].items(), key=lambda item: int(item[0])):
        for label in [label for label in labels if label in by_label]:
            r = by_label[label]
            if r.get("up_s") is None:
                note = f"only {r.get('up')} of {size} up after {UP_WITHIN:g} s"
                lines.append(f"| {size} | {label} | {note} |" + " |" * (len(COLUMNS) - 1))
                continue
            cells = " | ".join(_cell(r, key) for key, _ in COLUMNS)
            lines.append(f"| {size} | {label} ({r.get('code', '?')}) | {cells} |")
    return "\n".join(lines) + "\n"


def merged(before: dict[str, Any] | None, now: dict[str, Any]) -> dict[str, Any]:
    """The sizes measured now, in place of the same sizes' rows; the other sizes kept (a
    size measured alone, on this code, drops its earlier base row)."""
    if not before or before.get("jobs") != now["jobs"]:
        return now
    sizes = {**before.get("sizes", {}), **now["sizes"]}
    return {**before, **{k: v for k, v in now.items() if k != "sizes"}, "sizes": sizes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, help="a checkout to measure side by side")
    parser.add_argument("--replicas", type=int, nargs="+", default=[30, 40, 50, 60])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--window", type=float, default=60.0, help="seconds measured")
    args = parser.parse_args()
    results = ladder(args.base, args.replicas, args.jobs, args.window)
    path = BENCH / "results.json"
    stored = json.loads(path.read_text()) if path.exists() else {}
    stored["limit"] = merged(stored.get("limit"), results)
    results = stored["limit"]
    path.write_text(json.dumps(stored, indent=2, default=str))
    md = BENCH / "RESULTS.md"
    text = md.read_text() if md.exists() else ""
    md.write_text(replace_section(text, render(results), SECTION))
    print(render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
