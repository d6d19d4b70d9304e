"""At scale: 100 replicas on one PostgreSQL, steady and with a replica killed every 5 s.

    .venv/bin/python bench/scale.py [--base TREE] [--replicas 100] [--jobs 1000] [--window 120]

A throwaway cluster of its own (initdb from the server binaries, as the
failover tests build theirs; `max_connections = 400`), so that 100 replicas and
their sessions never crowd the shared server. Every replica runs the same
jobs on 1 s intervals (1 ms each). Measured from outside: the jobs' evidence
(each tick of the window once, none missing, lateness), the sessions of the
database sampled every second from `pg_stat_activity` (per replica: the
count most samples saw, and the most any saw; the fleet's total), transactions
from `pg_stat_database`, and the CPU of every replica from /proc.

The second run kills a replica (SIGKILL) every 5 s and starts another in its
place: a tick whose run was going in the killed replica is `crashed` (its
evidence line may be missing; the ledger's rows say which).

With `--base TREE`, each run is made on TREE's `scheduler` first, then on this
checkout's. Writes the section "At scale" of bench/RESULTS.md and `scale` in
bench/results.json for 100 jobs, and for more a section and an entry of their own per
number of jobs and replicas ("At scale: 100 replicas of 1,000 jobs", `scale_1000_100`).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg
from edges import commit_of, replace_section, sides
from fleet import BENCH, Fleet, Server, now_iso, process_cpu, verify, whole_ticks

from tests.clusters import Cluster

SECTION = "## At scale"


def section(jobs: int, replicas: int) -> str:
    """The section of bench/RESULTS.md for a run of this size: one per size measured."""
    return SECTION if jobs == 100 else f"{SECTION}: {replicas} replicas of {jobs:,} jobs"


def key(jobs: int, replicas: int) -> str:
    """Its entry in bench/results.json."""
    return "scale" if jobs == 100 else f"scale_{jobs}_{replicas}"


KILL_EVERY = 5.0  # seconds between kills in the second run
# Seconds for every replica's lock session to come up. On 2 cores, 100 replicas of 1,000
# jobs start one after another: each imports its jobs, and registers them under the
# registration writers' table lock, while the ones already up run theirs.
UP_WITHIN = 900.0
STATS_LAG = 11  # s: an idle session reports its transactions within 10 s (PostgreSQL 15)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def start_cluster() -> Cluster:
    cluster = Cluster("scale")
    with open(cluster.data / "postgresql.conf", "a") as conf:  # the last line counts
        conf.write("max_connections = 400\nshared_buffers = 128MB\n")
    cluster.start()
    return cluster


class NotUp(Exception):
    """Some replicas' lock sessions were not up by the deadline."""

    def __init__(self, up: int) -> None:
        super().__init__(f"{up} replicas up")
        self.up = up


def start_in_tens(fleet: Fleet, names: list[str]) -> None:
    """The replicas started ten a second: the first imports share 2 cores."""
    for i, name in enumerate(names):
        fleet.start(name)
        if i % 10 == 9:
            time.sleep(1.0)


def wait_up(fleet: Fleet, names: list[str], deadline: float) -> None:
    """These replicas' lock sessions are up; NotUp (how many are) past the deadline."""
    waiting = set(names)
    while waiting:
        for name in list(waiting):
            text = (fleet.root / f"{name}.log").read_text(errors="replace")
            if "lock session up" in text:
                waiting.discard(name)
        if waiting and time.time() > deadline:
            raise NotUp(len(names) - len(waiting))
        time.sleep(0.5)


def ledger_statuses(url: str, start: float, end: float) -> dict[tuple[str, float], str]:
    """(job, tick as epoch seconds) -> status, for the ticks of [start, end)."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT job_name, extract(epoch FROM scheduled_at)::float8, status"
            " FROM scheduler_ticks"
            " WHERE scheduled_at >= to_timestamp(%s) AND scheduled_at < to_timestamp(%s)",
            (start, end),
        ).fetchall()
    return {(name, tick): status for name, tick, status in rows}


def without_row(
    runs: list[dict[str, Any]],
    statuses: dict[tuple[str, float], str],
    window: set[tuple[str, float]],
) -> int:
    """Ticks of the window (`verify`'s) that never ran and that the ledger has no row for:
    nothing explains them (each one the fleet let go of while it could still run)."""
    ran = {(r["job"], float(r["scheduled"])) for r in runs}
    return len(window - ran - statuses.keys())


def run(
    server: Server,
    tree: Path | None,
    replicas: int,
    jobs: int,
    window: float,
    kills: bool,
    up_within: float = UP_WITHIN,
) -> dict[str, Any]:
    database = server.create("scale")
    fleet = Fleet("ours", server, database, jobs, tree=tree)
    names = [f"s{i}" for i in range(replicas)]
    samples: list[Counter[str]] = []
    killed = 0
    try:
        began = time.time()
        start_in_tens(fleet, names)
        try:
            wait_up(fleet, names, began + up_within)
        except NotUp as short:
            fleet.stop(timeout=120)
            server.drop(database)
            log(f"  only {short.up} of {replicas} up after {up_within:g} s; logs: {fleet.root}")
            return {"replicas": replicas, "jobs": jobs, "up": short.up, "up_s": None}
        up_s = round(time.time() - began, 1)
        time.sleep(10)  # past the first chores and the catch-up passes
        start, xacts = time.time(), server.transactions(database)
        cpu = {r.process.pid: process_cpu(r.process.pid) for r in fleet.replicas}
        next_kill = start + KILL_EVERY
        while time.time() < start + window:
            samples.append(Counter(server.sessions(database).values()))
            if kills and time.time() >= next_kill:
                live = [r for r in fleet.replicas if r.process.poll() is None]
                victim = live[killed % len(live)]
                # A replica started in the window (after a kill) counts from its start.
                pid = victim.process.pid
                cpu[pid] = process_cpu(pid) - cpu.get(pid, 0.0)
                victim.process.send_signal(signal.SIGKILL)
                killed += 1
                fleet.start(f"k{killed}")
                next_kill += KILL_EVERY
            time.sleep(1.0)
        end = time.time()
        for r in fleet.replicas:
            if r.process.poll() is None:
                cpu[r.process.pid] = process_cpu(r.process.pid) - cpu.get(r.process.pid, 0.0)
        time.sleep(STATS_LAG)
        xacts = server.transactions(database) - xacts
    finally:
        codes = fleet.stop(timeout=120)
    runs = fleet.runs()
    statuses = ledger_statuses(server.database_url(database), start, end)
    result = verify(runs, jobs, start, end)
    elapsed = end - start
    per_replica = [n for sample in samples for app, n in sample.items() if app in _names(fleet)]
    totals = [sum(n for app, n in s.items() if app in _names(fleet)) for s in samples]
    result.update(
        replicas=replicas,
        jobs=jobs,
        up=replicas,
        up_s=up_s,
        window_s=round(elapsed, 1),
        killed=killed,
        crashed_rows=sum(1 for status in statuses.values() if status == "crashed"),
        without_row=without_row(runs, statuses, whole_ticks(jobs, start, end)),
        exit_codes=Counter(str(c) for c in codes),
        sessions_per_replica=statistics.mode(per_replica) if per_replica else None,
        sessions_per_replica_max=max(per_replica, default=0),
        sessions_total_median=statistics.median(totals) if totals else None,
        sessions_total_max=max(totals, default=0),
        transactions_per_s=round(xacts / elapsed, 1),
        transactions_per_tick=round(xacts / (jobs * elapsed), 3),
        cpu_fleet_cores=round(sum(cpu.values()) / elapsed, 2),
    )
    server.drop(database)
    return result


def _names(fleet: Fleet) -> set[str]:
    return {r.name for r in fleet.replicas}


def scale(
    base: Path | None, replicas: int, jobs: int, window: float, up_within: float = UP_WITHIN
) -> dict[str, Any]:
    trees, found_in = sides(base)
    cluster = start_cluster()
    out: dict[str, Any] = {}
    try:
        server = Server(cluster.url())
        for scenario, kills in (("steady", False), ("kills", True)):
            for label, tree in trees.items():
                log(f"{replicas} replicas x {jobs} jobs, {scenario}, {label} ({found_in[label]})")
                found = run(server, tree, replicas, jobs, window, kills, up_within)
                out.setdefault(scenario, {})[label] = found
                log("  " + ", ".join(f"{k} {v}" for k, v in found.items()))
    finally:
        cluster.remove()
    out.update(
        date=now_iso(), commit=commit_of(BENCH), replicas=replicas, jobs=jobs, up_within=up_within
    )
    if base is not None:
        out["base_commit"] = commit_of(base)
    return out


COLUMNS = (
    ("up_s", "all up (s)"),
    ("ticks", "ticks"),
    ("ran_once", "ran once"),
    ("duplicates", "duplicates"),
    ("missing", "missing"),
    ("crashed_rows", "crashed (ledger)"),
    ("without_row", "missing, no row"),
    ("lateness_p50_ms", "lateness p50 (ms)"),
    ("lateness_p99_ms", "p99 (ms)"),
    ("sessions_per_replica", "sessions per replica (most samples / most)"),
    ("sessions_total_max", "sessions, fleet (most)"),
    ("transactions_per_s", "transactions/s"),
    ("transactions_per_tick", "per tick"),
    ("cpu_fleet_cores", "CPU, fleet (cores)"),
)


def render(found: dict[str, Any]) -> str:
    sides = ["base", "this"] if "base_commit" in found else ["this"]
    said = (
        f"(base: {found.get('base_commit', '?')}, this: {found.get('commit', '?')})"
        if "base" in sides
        else f"(commit {found.get('commit', '?')})"
    )
    lines = [
        section(found["jobs"], found["replicas"]),
        "",
        f"{found['replicas']} replicas, each with the same {found['jobs']} jobs every second (1 ms",
        "each), on a PostgreSQL cluster of their own; measured by `.venv/bin/python",
        f"bench/scale.py` on {found.get('date', '?')} {said}. *kills*: a replica",
        f"SIGKILLed every {KILL_EVERY:g} s and another started in its place. A tick the",
        "killed replica had claimed and not finished is recorded `crashed` by the sweep",
        "(*crashed*, from the ledger) and is not run again (at most once): such a tick is",
        "*missing* from the jobs' evidence if its run had not started. *Missing, no",
        "row*: ticks that never ran and that the ledger has no row for: 0 on every",
        f"correct run whose lateness stays below the {STATS_LAG} s the fleet runs on after",
        "the window (a tick still queued when the fleet stops has no row until a later",
        "sweep records it missed).",
        "",
        "| run | code | " + " | ".join(title for _, title in COLUMNS) + " |",
        "|---|---|" + "---|" * len(COLUMNS),
    ]
    for scenario in ("steady", "kills"):
        for side in sides:
            r = found[scenario][side]
            if r.get("up_s") is None:
                within = f"{found.get('up_within', UP_WITHIN):g}"
                note = f"only {r.get('up')} of {r.get('replicas')} replicas up after {within} s"
                lines.append(f"| {scenario} | {side} | {note} |" + " |" * (len(COLUMNS) - 1))
                continue
            cells = []
            for key, _ in COLUMNS:
                value = r.get(key)
                if key == "sessions_per_replica":
                    value = f"{value} / {r.get('sessions_per_replica_max')}"
                cells.append(str(value))
            lines.append(f"| {scenario} | {side} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, help="a checkout to measure side by side")
    parser.add_argument("--replicas", type=int, default=100)
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--window", type=float, default=120.0, help="seconds measured")
    parser.add_argument(
        "--up-within", type=float, default=UP_WITHIN, help="seconds for every replica to come up"
    )
    args = parser.parse_args()
    results = scale(args.base, args.replicas, args.jobs, args.window, args.up_within)
    path = BENCH / "results.json"
    stored = json.loads(path.read_text()) if path.exists() else {}
    stored[key(args.jobs, args.replicas)] = results
    path.write_text(json.dumps(stored, indent=2, default=str))
    md = BENCH / "RESULTS.md"
    text = md.read_text() if md.exists() else ""
    md.write_text(replace_section(text, render(results), section(args.jobs, args.replicas)))
    print(render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
