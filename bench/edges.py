"""At the edges: a burst of ticks all due at once, and 1,000 ticks a second for a while.

    .venv/bin/python bench/edges.py [--base TREE] [--quick] [--profile DIR]
    .venv/bin/python bench/edges.py --base TREE --steady-rounds N

3 replicas, `max_workers: 20`, jobs of 1 ms, against the local PostgreSQL (as
bench/run.py). A burst: 1,000 and then 5,000 jobs on one minute grid, so that
every job's tick falls due at the same instant; measured from the jobs'
evidence: when half of them and the last one started (after the tick), and
whether each ran once. The steady run: 1,000 jobs every second for a window
(lateness p50 and p99). Transactions from `pg_stat_database`, for the fleet,
per tick and per run.

With `--base TREE` (a worktree of an earlier commit: `git worktree add
/tmp/bench-base <commit>`), each scenario runs on TREE's `scheduler` first and
then on this checkout's, side by side in this one run, and the ratios (this
checkout over TREE) are printed. `--profile DIR` samples replica 0 with py-spy
during each burst and writes DIR/<code>-burst<N>.txt: per function, the share
of samples it was on the stack in, for the CPU (the thread holding the GIL,
every thread) and for the dispatcher thread's wall time (waits included).

`--steady-rounds N` runs only the steady scenario, N times on each side, taking
turns, and prints each run and the p99s (nothing is written).

Writes the section "At the edges" of bench/RESULTS.md and `edges` in
bench/results.json, leaving the rest of both as they are (bench/run.py, with
the same `--base`, measures these too, in its whole run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fleet import BENCH, SERVER, BusyByPhase, Fleet, Server, now_iso, quantile, run_fleet

REPLICAS = 3
MAX_WORKERS = 20
BURSTS = (1000, 5000)
STEADY_JOBS = 1000
PHASES = 20  # the steady run's CPU busy, by 50 ms of the second
SECTION = "## At the edges"
STATS_LAG = 11  # s: an idle session reports its transactions within 10 s (PostgreSQL 15)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def which_scheduler(tree: Path | None) -> str:
    """Where the replicas' `scheduler` package comes from (checked, not assumed): with the
    environment they get (`Fleet.start`: a tree's PYTHONPATH, or this process's)."""
    env = dict(os.environ) if tree is None else {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, "-c", "import scheduler; print(scheduler.__file__)"],
        capture_output=True,
        text=True,
        cwd="/",
        env=env,
        check=True,
    )
    return str(Path(out.stdout.strip()).parent.parent)


def wait_ready(fleet: Fleet, deadline: float) -> None:
    """Every replica's lock session is up (its scheduler was started just before)."""
    while True:
        logs = [(fleet.root / f"{r.name}.log").read_text(errors="replace") for r in fleet.replicas]
        if all("lock session up" in text for text in logs):
            return
        if time.time() > deadline:
            raise RuntimeError(f"replicas not ready in time for the burst; see {fleet.root}")
        time.sleep(0.1)


class Profile:
    """Two py-spy recordings of one replica: CPU (samples of the thread holding the GIL),
    and wall time (every sample, idle ones too: the dispatcher's waits on the server)."""

    def __init__(self, pid: int, out: Path) -> None:
        self.out = out
        spy = shutil.which("py-spy", path=str(Path(sys.executable).parent))
        if spy is None:
            log("py-spy not found (pip install -e '.[bench]'): no profile")
        record = [spy, "record", "--pid", str(pid), "--rate", "200", "--threads"]
        self.spies = [
            subprocess.Popen(
                [*record, *extra, "--format", "raw", "-o", str(self._raw(kind))],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for kind, extra in (("cpu", ["--gil"]), ("wall", ["--idle"]))
            if spy is not None
        ]

    def _raw(self, kind: str) -> Path:
        return self.out.with_suffix(f".{kind}.raw")

    def stop(self) -> None:
        for spy in self.spies:
            spy.send_signal(signal.SIGINT)  # py-spy writes its file on an interrupt
        for spy in self.spies:
            spy.wait(30)

    def summary(self, limit: int = 25) -> dict[str, list[tuple[str, float]]]:
        """Per function, the share of samples it was on the stack in (inclusive) or on top
        of it (self): CPU over every thread; wall time of the dispatcher thread alone."""
        if not self._raw("cpu").exists() or not self._raw("wall").exists():
            return {}
        cpu, cpu_self = _shares(self._raw("cpu"))
        wall, _ = _shares(self._raw("wall"), thread="gate")
        found = {
            "cpu_inclusive": cpu[:limit],
            "cpu_self": cpu_self[:limit],
            "dispatcher_wall": wall[:limit],
        }
        lines = []
        for name, rows in found.items():
            lines += [f"# {name} (% of samples)", *(f"{v:5.1f}%  {f}" for f, v in rows), ""]
        self.out.with_suffix(".txt").write_text("\n".join(lines))
        return {name: rows[:12] for name, rows in found.items()}


def _shares(raw: Path, thread: str | None = None) -> tuple[list[tuple[str, float]], ...]:
    """py-spy's collapsed stacks (first frame: the thread): inclusive and self shares."""
    total, inclusive, alone = 0, Counter[str](), Counter[str]()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not count.isdigit() or (thread is not None and not frames[0].endswith(thread)):
            continue
        n = int(count)
        total += n
        names = [_frame(f) for f in frames[1:]]
        for name in set(names):
            inclusive[name] += n
        if names:
            alone[names[-1]] += n

    def shares(counts: Counter[str]) -> list[tuple[str, float]]:
        return [(f, round(100 * n / max(1, total), 1)) for f, n in counts.most_common()]

    return shares(inclusive), shares(alone)


def _frame(frame: str) -> str:
    """`fn (path/to/module.py:12)` as `fn (package/module.py)`: one entry per function."""
    name, _, where = frame.partition(" (")
    parts = Path(where.rsplit(":", 1)[0]).parts
    return f"{name} ({'/'.join(parts[-2:])})" if parts else name


def burst(
    server: Server, jobs: int, tree: Path | None, label: str, profile: Path | None
) -> dict[str, Any]:
    """`jobs` jobs whose tick falls due at one instant; when their runs started.

    The grid is the epoch's minutes: the tick measured is the first whole minute at
    least STATS_LAG after every replica is up (start-up itself, 5,000 jobs read on
    three replicas, takes a while on a loaded machine). Transactions are counted from
    1 s before the tick to STATS_LAG after the last run started, heartbeats and
    housekeeping included.
    """
    database = server.create(f"burst{jobs}")
    fleet = Fleet("ours", server, database, jobs, max_workers=MAX_WORKERS, interval_s=60, tree=tree)
    spy: Profile | None = None
    try:
        for i in range(REPLICAS):
            fleet.start(f"burst-{i}")
        wait_ready(fleet, time.time() + 180)
        # A session's counts reach pg_stat_database within STATS_LAG once it is idle: the
        # tick comes that long after start-up, and the count is read that long after.
        tick = math.ceil((time.time() + STATS_LAG) / 60) * 60
        time.sleep(max(0.0, tick - 1 - time.time()))
        xacts = server.transactions(database)
        if profile is not None:
            spy = Profile(fleet.replicas[0].process.pid, profile / f"{label}-burst{jobs}")
        seen, since = 0, time.time()
        while time.time() < tick + 60:  # until every tick ran, or none started for 5 s
            count = sum(1 for r in fleet.runs() if r["scheduled"] == tick)
            if count >= jobs or (count and count == seen and time.time() > since + 5):
                break
            if count != seen:
                seen, since = count, time.time()
            time.sleep(0.2)
        if spy is not None:
            spy.stop()
        time.sleep(STATS_LAG)  # and a second run of a tick would have started by now
        xacts = server.transactions(database) - xacts
    finally:
        codes = fleet.stop()
    runs = [r for r in fleet.runs() if r["scheduled"] == tick]
    counts = Counter(r["job"] for r in runs)
    late = [r["start"] - r["scheduled"] for r in runs]
    server.drop(database)
    result = {
        "jobs": jobs,
        "ran_once": sum(1 for n in counts.values() if n == 1),
        "duplicates": sum(n - 1 for n in counts.values() if n > 1),
        "missing": jobs - len(counts),
        "half_s": _s(quantile(late, 0.5)),
        "p90_s": _s(quantile(late, 0.9)),
        "last_s": _s(max(late, default=None)),
        "transactions_per_tick": round(xacts / jobs, 3),
        "transactions_per_run": round(xacts / max(1, len(runs)), 3),
        "by_instance": dict(Counter(r["instance"] for r in runs)),
        "exit_codes": codes,
    }
    if spy is not None:
        result["profile"] = spy.summary()
    return result


def _s(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def steady(
    server: Server, tree: Path | None, window: float, profile: Path | None = None
) -> dict[str, Any]:
    """1,000 jobs on 1 s intervals: lateness and transactions, as bench/run.py measures;
    where the CPU goes (replicas, server, its SQL functions; with `profile`, replica 0
    sampled by py-spy over the window, to `profile`.txt)."""

    def watched(fleet: Fleet) -> Callable[[], dict[str, Any]]:
        busy = BusyByPhase(bins=PHASES)
        busy.start()
        spy = Profile(fleet.replicas[0].process.pid, profile) if profile is not None else None

        def stop() -> dict[str, Any]:
            found: dict[str, Any] = {"busy_by_phase": busy.stop()}
            if spy is not None:
                spy.stop()
                found["profile"] = spy.summary()
            return found

        return stop

    r = run_fleet(
        server,
        "ours",
        REPLICAS,
        STEADY_JOBS,
        window,
        max_workers=MAX_WORKERS,
        tree=tree,
        functions=True,
        during=watched,
    )
    keys = ("ticks", "ran_once", "duplicates", "missing", "lateness_p50_ms", "lateness_p99_ms")
    cores = r["replicas_cpu_cores"] + r["server_cpu_cores"]
    return {
        **{k: r[k] for k in keys},
        "transactions_per_tick": r["transactions_per_tick"],
        "transactions_per_run": r["transactions_per_run"],
        "cpu_per_replica_pct": r["cpu_per_replica_pct"],
        "replicas_cpu_cores": r["replicas_cpu_cores"],
        "server_cpu_cores": r["server_cpu_cores"],
        # Each second's ticks fall due together: their work, spread over every core of
        # this machine, is as short as the drain of a second could be.
        "cpu_bound_ms": round(1000 * cores / (os.cpu_count() or 1), 1),
        "server_functions": function_shares(r["functions"]),
        **r["during"],  # busy_by_phase, and the profile if one was asked for
    }


def function_shares(found: dict[str, dict[str, float]], top: int = 6) -> list[list[Any]]:
    """The SQL functions the server spent most time in by themselves: name, share of all
    function time (%), calls, and time per call (ms, its inner calls included)."""
    total = sum(f["self_ms"] for f in found.values()) or 1.0
    ranked = sorted(found.items(), key=lambda kv: -kv[1]["self_ms"])[:top]
    return [
        [
            name,
            round(100 * f["self_ms"] / total, 1),
            f["calls"],
            round(f["total_ms"] / max(1, f["calls"]), 3),
        ]
        for name, f in ranked
    ]


def sides(base: Path | None) -> tuple[dict[str, Path | None], dict[str, str]]:
    """The trees measured ("base" if given, then "this": None, this checkout) and where
    each one's `scheduler` is imported from; a base that does not shadow it is refused."""
    trees: dict[str, Path | None] = {"this": None}
    if base is not None:
        trees = {"base": base.resolve(), "this": None}
    found_in = {k: which_scheduler(v) for k, v in trees.items()}
    if base is not None and found_in["base"] == found_in["this"]:
        raise RuntimeError(f"{base} does not shadow this checkout's scheduler")
    return trees, found_in


def edges(
    server: Server, base: Path | None, quick: bool = False, profile: Path | None = None
) -> dict[str, Any]:
    """Every scenario on `base` (if given) and on this checkout, one after the other."""
    trees, found_in = sides(base)
    if profile is not None:
        profile.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {}
    for jobs in BURSTS:
        for label, tree in trees.items():
            log(f"burst of {jobs}, {label} ({found_in[label]})")
            found = burst(server, jobs, tree, label, profile)
            out.setdefault(f"burst_{jobs}", {})[label] = found
            log(f"  {_said(found)}")
    for label, tree in trees.items():
        log(f"steady {STEADY_JOBS}/s, {label}")
        spy = profile / f"{label}-steady" if profile is not None else None
        found = steady(server, tree, 5 if quick else 10, spy)
        out.setdefault("steady", {})[label] = found
        log(f"  {_said(found)}")
    out.update(date=now_iso(), commit=commit_of(BENCH))
    if base is not None:
        out["base_commit"] = commit_of(base)
    out["ratios"] = ratios(out)
    return out


def _said(found: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in found.items() if not isinstance(v, dict | list))


RATIOS = {
    "burst": ("half_s", "last_s", "transactions_per_run"),
    "steady": ("lateness_p50_ms", "lateness_p99_ms", "transactions_per_run"),
}


def ratios(edges: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """This checkout's figures over the base's (below 1: better now)."""
    out = {}
    for scenario, sides in edges.items():
        if not scenario.startswith(("burst_", "steady")) or "base" not in sides:
            continue
        keys = RATIOS["steady" if scenario == "steady" else "burst"]
        base, this = sides["base"], sides["this"]
        out[scenario] = {
            k: round(this[k] / base[k], 2) if base.get(k) and this.get(k) is not None else None
            for k in keys
        }
    return out


def render(edges: dict[str, Any]) -> str:
    """The section of bench/RESULTS.md."""
    sides = ["base", "this"] if "base_commit" in edges else ["this"]
    lines = [
        SECTION,
        "",
        f"3 replicas, `max_workers: {MAX_WORKERS}`, jobs of 1 ms; measured by",
        "`.venv/bin/python bench/edges.py"
        + (" --base TREE`" if "base" in sides else "`")
        + f" on {edges.get('date', '?')}"
        + (
            f" (base: {edges.get('base_commit', '?')}, this: {edges.get('commit', '?')})."
            if "base" in sides
            else f" (commit {edges.get('commit', '?')})."
        ),
        "A burst: every job's tick due at one instant (one minute grid); *half* and",
        "*last*: seconds from the tick until half of the runs, and the last, had started.",
        "",
        "| burst | code | ran once | duplicates | missing | half (s) | last (s) "
        "| transactions per tick | per run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for jobs in BURSTS:
        for side in sides:
            b = edges[f"burst_{jobs}"][side]
            lines.append(
                f"| {jobs:,} | {side} | {b['ran_once']} | {b['duplicates']} | {b['missing']} "
                f"| {b['half_s']} | {b['last_s']} | {b['transactions_per_tick']} "
                f"| {b['transactions_per_run']} |"
            )
    lines += [
        "",
        f"Steady: {STEADY_JOBS:,} jobs every second (transactions from `pg_stat_database`,",
        "for the fleet):",
        "",
        "| code | ticks | ran once | duplicates | missing | lateness p50 (ms) | p99 (ms) "
        "| transactions per tick | per run | CPU per replica | CPU, replicas / server (cores) "
        "| CPU bound (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for side in sides:
        s = edges["steady"][side]
        lines.append(
            f"| {side} | {s['ticks']} | {s['ran_once']} | {s['duplicates']} | {s['missing']} "
            f"| {s['lateness_p50_ms']} | {s['lateness_p99_ms']} | {s['transactions_per_tick']} "
            f"| {s['transactions_per_run']} | {s['cpu_per_replica_pct']}% "
            f"| {s.get('replicas_cpu_cores', '?')} / {s.get('server_cpu_cores', '?')} "
            f"| {s.get('cpu_bound_ms', '?')} |"
        )
    lines += [
        "",
        "*CPU*: the replicas' and the PostgreSQL server's CPU over the window (cores: CPU",
        "seconds per second). Each second's ticks fall due together, so their work is done",
        "in a burst: *CPU bound* is that work spread over every core of this machine, the",
        "shortest the drain of a second could be with the work as it is. A p99 lateness",
        "close to it means the drain is held by the CPU, not by a wait.",
    ]
    for side in sides:
        phases = edges["steady"][side].get("busy_by_phase")
        if phases:
            step = 1000 // len(phases)
            shown = ", ".join(
                f"{i * step}-{(i + 1) * step} ms {round(100 * b)}%"
                for i, b in enumerate(phases)
                if i < 8
            )
            lines += [
                "",
                f"The machine's CPU busy (both cores) by phase of the second, {side}: {shown}; "
                f"later phases at most {round(100 * max(phases[8:], default=0))}%.",
            ]
    for side in sides:
        functions = edges["steady"][side].get("server_functions")
        if functions:
            said = ", ".join(
                f"{name} {share}% ({calls} calls, {per_call} ms each)"
                for name, share, calls, per_call in functions
            )
            lines += ["", f"The server's time in its SQL functions by themselves, {side}: {said}."]
    r = ratios(edges)
    if r:
        lines += ["", "This code over the base (below 1: better):", ""]
        for scenario, values in r.items():
            said = ", ".join(f"{k} {v}" for k, v in values.items())
            lines.append(f"- {scenario.replace('_', ' ')}: {said}")
    return "\n".join(lines) + "\n"


def replace_section(text: str, section: str, heading: str = SECTION) -> str:
    """`section` in place of the one with its heading (up to the next `## `), or appended."""
    start = text.find(heading)
    if start < 0:
        return text.rstrip("\n") + "\n\n" + section
    end = text.find("\n## ", start + len(heading))
    rest = "" if end < 0 else text[end + 1 :]
    return text[:start] + section + ("\n" + rest if rest else "")


def commit_of(tree: Path) -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=tree
    ).stdout.strip()


def alternate(server: Server, base: Path | None, rounds: int) -> dict[str, list[dict[str, Any]]]:
    """The steady run alone, `rounds` times per side, the sides taking turns: this machine's
    speed drifts over minutes, and figures a few percent apart need several turns each."""
    trees, _ = sides(base)
    out: dict[str, list[dict[str, Any]]] = {label: [] for label in trees}
    for turn in range(rounds):
        for label, tree in trees.items():
            found = steady(server, tree, 10)
            out[label].append(found)
            log(f"steady {STEADY_JOBS}/s, {label}, turn {turn + 1}: {_said(found)}")
    for label, runs in out.items():
        p99 = [r["lateness_p99_ms"] for r in runs]
        bound = [r["cpu_bound_ms"] for r in runs]
        log(f"{label}: p99 {p99} (median {statistics.median(p99)}), CPU bound {bound}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, help="a checkout to measure side by side")
    parser.add_argument("--quick", action="store_true", help="a shorter steady window")
    parser.add_argument("--profile", type=Path, help="py-spy profiles of each burst, here")
    parser.add_argument(
        "--steady-rounds",
        type=int,
        metavar="N",
        help="only the steady run, N times per side taking turns (RESULTS.md left as it is)",
    )
    args = parser.parse_args()
    server = Server(SERVER)
    if args.steady_rounds:
        alternate(server, args.base, args.steady_rounds)
        return 0
    results = edges(server, args.base, args.quick, args.profile)
    path = BENCH / "results.json"
    stored = json.loads(path.read_text()) if path.exists() else {}
    stored["edges"] = results
    path.write_text(json.dumps(stored, indent=2, default=str))
    md = BENCH / "RESULTS.md"
    md.write_text(replace_section(md.read_text() if md.exists() else "", render(results)))
    print(render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
