"""Starting fleets of replicas (ours or an alternative) and measuring them from outside.

Everything measured here comes from outside the replicas: the jobs' own
evidence lines (which ticks ran, where, when), the server's statistics and log
(transactions, statements, sessions), and /proc (CPU, memory).
"""

from __future__ import annotations

import compileall
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

# The server every benchmark runs against (one fresh database per scenario).
SERVER = os.environ.get(
    "SCHEDULER_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
APS4_PYTHON = BENCH / ".venv-aps4" / "bin" / "python"
APS4_INSTALL = [
    "apscheduler==4.0.0a6",
    "sqlalchemy[asyncio]>=2,<2.2",
    "psycopg[binary]>=3.1",
    "sniffio",
]
CLOCK_TICK = os.sysconf("SC_CLK_TCK")

# The jobs' evidence: one line per run, appended with one write (O_APPEND: lines of
# several processes never interleave). The file is opened once per process and the line
# built by hand, so that the job costs the replica what a job of 1 ms would, and not
# the benchmark's own bookkeeping (opening a file and encoding JSON cost more than the
# gate's own work for a run).
OUR_JOBS = """
import json, os, threading, time
from scheduler import job

# A timed wait, not time.sleep (see scheduler/waits.py); not scheduler.waits itself,
# which a base tree of an earlier commit may not have.
NEVER = threading.Event()
EVIDENCE = os.open(os.environ["BENCH_EVIDENCE"], os.O_WRONLY | os.O_APPEND)
SECONDS = float(os.environ.get("BENCH_JOB_SECONDS", "0.001"))


def _run(ctx):
    start = time.time()
    line = (
        f'{{"job": {json.dumps(ctx.job_name)}, "tick": "{ctx.scheduled_at.isoformat()}", '
        f'"instance": {json.dumps(ctx.instance)}, "start": {start!r}, '
        f'"scheduled": {ctx.scheduled_at.timestamp()!r}}}\\n'
    )
    os.write(EVIDENCE, line.encode())
    NEVER.wait(SECONDS)
"""


def faketime_library() -> str | None:
    found = sorted(Path("/usr/lib").glob("*/faketime/libfaketimeMT.so.1"))
    return str(found[0]) if found else None


class Server:
    """The PostgreSQL server the benchmark runs against; one database per scenario."""

    def __init__(self, url: str) -> None:
        self.url = url
        with psycopg.connect(url, autocommit=True) as conn:
            self.version = conn.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
        self.log_path = self._find_log()

    def database_url(self, name: str) -> str:
        return self.url.rsplit("/", 1)[0] + "/" + name

    def create(self, prefix: str, log_statements: bool = False, functions: bool = False) -> str:
        name = f"bench_{prefix}_{uuid.uuid4().hex[:6]}"
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
            if log_statements:
                conn.execute(f"ALTER DATABASE \"{name}\" SET log_statement = 'all'")
            if functions:  # time spent in each SQL function (pg_stat_user_functions)
                conn.execute(f"ALTER DATABASE \"{name}\" SET track_functions = 'all'")
        return name

    def function_times(self, name: str) -> dict[str, dict[str, float]]:
        """Per SQL function of database `name`: calls, and its time in ms, in all (its calls
        included) and by itself; as the server has them once the sessions have ended."""
        with psycopg.connect(self.database_url(name), autocommit=True) as conn:
            rows = conn.execute(
                "SELECT funcname, calls, total_time, self_time FROM pg_stat_user_functions"
            ).fetchall()
        return {f: {"calls": c, "total_ms": t, "self_ms": s} for f, c, t, s in rows}

    def drop(self, name: str) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def transactions(self, name: str) -> int:
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute("SELECT pg_stat_clear_snapshot()")
            row = conn.execute(
                "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s",
                (name,),
            ).fetchone()
        return int(row[0]) if row else 0

    def sessions(self, name: str) -> dict[int, str]:
        """Backend pid -> application_name of the sessions on database `name` now."""
        with psycopg.connect(self.url, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT pid, application_name FROM pg_stat_activity"
                " WHERE datname = %s AND application_name <> ''",
                (name,),
            ).fetchall()
        return {int(pid): app for pid, app in rows}

    def _find_log(self) -> Path | None:
        major = self.version.split(".")[0]
        path = Path(f"/var/log/postgresql/postgresql-{major}-main.log")
        return path if path.exists() and os.access(path, os.R_OK) else None

    def log_offset(self) -> int:
        return self.log_path.stat().st_size if self.log_path else 0

    def statements(self, name: str, since: int, apps: dict[int, str]) -> dict[int, dict[str, Any]]:
        """Statements the server logged for database `name`, per backend pid.

        Each entry: the session's application_name (from `apps`, sampled from
        pg_stat_activity while it ran) and a Counter of statement kinds (the
        function called, or the statement's first words).
        """
        sessions: dict[int, dict[str, Any]] = defaultdict(lambda: {"app": "", "kinds": Counter()})
        for pid, sql in self.logged(name, since):
            sessions[pid]["app"] = apps.get(pid, "")
            sessions[pid]["kinds"][_kind(sql)] += 1
        return dict(sessions)

    def logged(self, name: str, since: int) -> list[tuple[int, str]]:
        """(backend pid, statement) of every statement the server logged for database
        `name` since the log offset `since` (none without a readable log)."""
        if not self.log_path:
            return []
        with open(self.log_path, "rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace")
        pattern = re.compile(
            r"\[(\d+)\] \S+@" + re.escape(name) + r" LOG:  (?:statement|execute [^:]*): (.*)"
        )
        return [
            (int(m.group(1)), m.group(2).strip())
            for line in text.splitlines()
            if (m := pattern.search(line)) is not None
        ]

    def logged_transactions(self, name: str, since: int) -> int:
        """Transactions on database `name` in the server's statement log since `since`.

        A statement outside BEGIN ... COMMIT is a transaction of its own; an
        explicit block counts once.
        """
        if not self.log_path:
            return -1
        open_block: set[int] = set()
        count = 0
        for pid, statement in self.logged(name, since):
            sql = statement.upper()
            if sql.startswith(("BEGIN", "START TRANSACTION")):
                open_block.add(pid)
            elif sql.startswith(("COMMIT", "ROLLBACK")) and pid in open_block:
                open_block.discard(pid)
                count += 1
            elif pid not in open_block:
                count += 1
        return count


def _kind(sql: str) -> str:
    found = re.search(
        r"(scheduler_claim|scheduler_finish|pg_try_advisory_lock"
        r"|pg_advisory_unlock|pg_advisory_lock_shared|now\(\))",
        sql,
    )
    if found:
        return found.group(1)
    return " ".join(sql.split()[:2])[:40]


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) a process has used."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICK


def server_cpu() -> float:
    """CPU seconds the local PostgreSQL's processes (named `postgres`) have used: their sum
    over a window measures the server's share of the work (sessions that end inside the
    window are left out; a fleet's sessions last the whole window)."""
    total = 0.0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == "postgres":
                    total += process_cpu(int(entry.name))
            except OSError:
                continue
    return total


def machine_jiffies() -> tuple[int, int]:
    """(all, idle) jiffies of every CPU of this machine so far (/proc/stat)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(values), values[3] + values[4]  # idle and iowait


class BusyByPhase:
    """How busy this machine's CPUs are, by phase of the wall-clock second (`bins` of it),
    sampled from /proc/stat every few milliseconds between `start` and `stop`: where
    every tick falls due on a whole second, it shows how long each second's work holds
    the CPU."""

    def __init__(self, bins: int = 20, every: float = 0.004) -> None:
        self.bins, self.every = bins, every
        self.total, self.idle = [0] * bins, [0] * bins
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> list[float]:
        """The busy fraction of each bin, from the second's start."""
        self._stop.set()
        self._thread.join(5)
        pairs = zip(self.total, self.idle, strict=True)
        return [round(1 - idle / total, 2) if total else 0.0 for total, idle in pairs]

    def _sample(self) -> None:
        before, (total, idle) = time.time(), machine_jiffies()
        while not self._stop.wait(self.every):
            now, (total2, idle2) = time.time(), machine_jiffies()
            phase = int(((before + now) / 2 % 1) * self.bins)
            self.total[phase] += total2 - total
            self.idle[phase] += idle2 - idle
            before, total, idle = now, total2, idle2


def process_rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def precompile(folders: list[Path]) -> None:
    """Byte-compile the replicas' code once, as installing a package or building an
    image does: with PYTHONDONTWRITEBYTECODE set (as in many containers, and on the
    machines these benchmarks run on) every replica would otherwise compile the
    scheduler and the jobs module again as it starts, on either side of a comparison."""
    for folder in folders:
        compileall.compile_dir(folder, quiet=1)


@dataclass
class Replica:
    name: str
    process: subprocess.Popen[bytes]
    launched: float


@dataclass
class Fleet:
    """Replicas of one kind (`ours`, `naive`, `aps4`) running N jobs on one database."""

    kind: str
    server: Server
    database: str
    jobs: int
    job_seconds: float = 0.001
    max_workers: int | None = None
    interval_s: int = 1
    first_every_second: bool = False  # job_0 ticks every second whatever interval_s is
    anchor: datetime | None = None  # the grid's `start` (None: the epoch)
    tree: Path | None = None  # a checkout whose `scheduler` the replicas run (None: this one)
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="scheduler-bench-")))
    replicas: list[Replica] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.evidence = self.root / "evidence.jsonl"
        self.evidence.touch()
        if self.kind == "ours":
            (self.root / "jobs").mkdir()
            code = [OUR_JOBS]
            lines = ["jobs:"]
            for i in range(self.jobs):
                every = 1 if i == 0 and self.first_every_second else self.interval_s
                code.append(f"@job(key={10_000 + i})\ndef job_{i}(ctx):\n    _run(ctx)\n")
                start = f", start: '{self.anchor.isoformat()}'" if self.anchor else ""
                lines.append(f"  job_{i}: {{interval: {every}{start}}}")
            (self.root / "jobs" / "bench_jobs.py").write_text("\n".join(code))
            (self.root / "config.yaml").write_text("\n".join(lines) + "\n")
            precompile([self.root / "jobs", (self.tree or ROOT) / "scheduler"])

    @property
    def url(self) -> str:
        return self.server.database_url(self.database)

    def command(self, name: str) -> list[str]:
        if self.kind == "ours":
            return [sys.executable, "-m", "scheduler", "run"]
        script = {"naive": "naive_lock.py", "aps4": "apscheduler4.py"}[self.kind]
        python = str(APS4_PYTHON) if self.kind == "aps4" else sys.executable
        return [
            python,
            str(BENCH / "alternatives" / script),
            "--database-url",
            self.url,
            "--jobs",
            str(self.jobs),
            "--instance",
            name,
            "--evidence",
            str(self.evidence),
            "--job-ms",
            str(self.job_seconds * 1000),
            "--interval-s",
            str(self.interval_s),
        ]

    def start(self, name: str, clock_offset: str | None = None) -> Replica:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SCHEDULER_")}
        env.update(
            SCHEDULER_DATABASE_URL=self.url,
            SCHEDULER_INSTANCE_NAME=name,
            SCHEDULER_CONFIG=str(self.root / "config.yaml"),
            BENCH_EVIDENCE=str(self.evidence),
            BENCH_JOB_SECONDS=str(self.job_seconds),
        )
        if self.max_workers:
            env["SCHEDULER_MAX_WORKERS"] = str(self.max_workers)
        if self.tree is not None:  # replicas run from `root`: nothing else shadows it
            env["PYTHONPATH"] = str(self.tree)
        if clock_offset:
            library = faketime_library()
            if library is None:
                raise RuntimeError("clock skew needs libfaketime: apt-get install faketime")
            env.update(LD_PRELOAD=library, FAKETIME=clock_offset, FAKETIME_DONT_FAKE_MONOTONIC="1")
        log = open(self.root / f"{name}.log", "wb")  # noqa: SIM115 (the child keeps it)
        process = subprocess.Popen(
            self.command(name), cwd=self.root, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        replica = Replica(name, process, time.time())
        self.replicas.append(replica)
        return replica

    def stop(self, timeout: float = 60) -> list[int | None]:
        for replica in self.replicas:
            if replica.process.poll() is None:
                replica.process.send_signal(signal.SIGTERM)
        codes: list[int | None] = []
        for replica in self.replicas:
            try:
                codes.append(replica.process.wait(timeout))
            except subprocess.TimeoutExpired:
                replica.process.kill()
                codes.append(None)
        return codes

    def runs(self) -> list[dict[str, Any]]:
        out = []
        for line in self.evidence.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def first_run_at(self) -> float | None:
        runs = self.runs()
        return min((r["start"] for r in runs), default=None)


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def whole_ticks(jobs: int, start: float, end: float) -> set[tuple[str, float]]:
    """(job, tick) of every whole second strictly inside [start, end), for every job."""
    first, last = int(start) + 1, int(end) - 1
    return {(f"job_{i}", float(t)) for i in range(jobs) for t in range(first, last + 1)}


def verify(runs: list[dict[str, Any]], jobs: int, start: float, end: float) -> dict[str, Any]:
    """Every whole-second tick of every job in [start, end): ran once, twice, or never?"""
    first, last = int(start) + 1, int(end) - 1
    window = whole_ticks(jobs, start, end)
    counts = Counter((r["job"], float(r["scheduled"])) for r in runs)
    lateness = [
        r["start"] - r["scheduled"] for r in runs if (r["job"], float(r["scheduled"])) in window
    ]
    return {
        "ticks": len(window),
        "ran_once": sum(1 for t in window if counts[t] == 1),
        "duplicates": sum(counts[t] - 1 for t in window if counts[t] > 1),
        "missing": sum(1 for t in window if counts[t] == 0),
        "seconds": last - first + 1,
        "lateness_p50_ms": _ms(quantile(lateness, 0.5)),
        "lateness_p99_ms": _ms(quantile(lateness, 0.99)),
    }


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 1)


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def wait_for_runs(fleet: Fleet, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while fleet.first_run_at() is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{fleet.kind}: no run within {timeout:g} s; see {fleet.root}")
        time.sleep(0.2)


def run_fleet(
    server: Server,
    kind: str,
    replicas: int,
    jobs: int,
    window: float,
    *,
    offsets: tuple[str | None, ...] | None = None,
    max_workers: int | None = None,
    job_seconds: float = 0.001,
    statements: bool = False,
    warmup: float = 2.0,
    tree: Path | None = None,
    functions: bool = False,
    during: Callable[[Fleet], Callable[[], Any]] | None = None,
) -> dict[str, Any]:
    """Start a fleet, let it warm up, measure a window, stop it, check what ran.

    With `functions`: the server's time in each SQL function over the whole run; with
    `during`: a probe started with the fleet at the window's start, whose answer (what
    the function it returns gives at the window's end) is the result's `during`.
    """
    database = server.create(
        f"{kind}{replicas}x{jobs}", log_statements=statements, functions=functions
    )
    fleet = Fleet(kind, server, database, jobs, job_seconds, max_workers, tree=tree)
    log_start = server.log_offset()
    sessions: Counter[str] = Counter()  # the most each replica held at one sample
    held: Counter[int] = Counter()  # samples x replicas that held that many sessions
    apps: dict[int, str] = {}
    try:
        for i in range(replicas):
            fleet.start(f"{kind}-{i}", clock_offset=offsets[i] if offsets else None)
        wait_for_runs(fleet)
        time.sleep(warmup)
        start, xacts = time.time(), server.transactions(database)
        cpu = [process_cpu(r.process.pid) for r in fleet.replicas]
        server_cpu_start = server_cpu()
        finish = during(fleet) if during is not None else None
        while time.time() < start + window:
            now = server.sessions(database)
            apps.update(now)
            for app, count in Counter(now.values()).items():
                sessions[app] = max(sessions[app], count)
                held[count] += 1
            time.sleep(0.5)
        end = time.time()
        xacts = server.transactions(database) - xacts
        cpu = [process_cpu(r.process.pid) - c for r, c in zip(fleet.replicas, cpu, strict=True)]
        server_cpu_used = server_cpu() - server_cpu_start
        found_during = finish() if finish is not None else None
        rss = [process_rss_mb(r.process.pid) for r in fleet.replicas]
    finally:
        codes = fleet.stop()
    runs = fleet.runs()
    result = verify(runs, jobs, start, end)
    if functions:
        time.sleep(1)  # a session's last counts reach the server as it ends
        result["functions"] = server.function_times(database)
    elapsed = end - start
    result.update(
        kind=kind,
        replicas=replicas,
        jobs=jobs,
        exit_codes=codes,
        ticks_per_s_once=round(result["ran_once"] / result["seconds"], 1),
        transactions_per_tick=round(xacts / (jobs * elapsed), 3),
        # per run started in the window: the same when every tick runs, and higher when a
        # fleet that falls behind leaves ticks to the sweep (which records them in bulk)
        transactions_per_run=round(xacts / max(1, sum(start <= r["start"] < end for r in runs)), 3),
        cpu_per_replica_pct=round(100 * sum(cpu) / len(cpu) / elapsed, 1),
        replicas_cpu_cores=round(sum(cpu) / elapsed, 3),
        server_cpu_cores=round(server_cpu_used / elapsed, 3),
        during=found_during,
        rss_mb=round(max(rss), 1),
        # What a replica holds between chores (most samples), and the most, during one.
        sessions_per_replica=held.most_common(1)[0][0] if held else 0,
        sessions_per_replica_max=max(sessions.values(), default=0),
        by_instance=dict(Counter(r["instance"] for r in runs)),
    )
    if statements:
        result["statements"] = server.statements(database, log_start, apps)
    server.drop(database)
    return result
