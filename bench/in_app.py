"""One host of an application with 4 web workers: database sessions and memory of the
active replica's worker and of the standbys', beside a worker that runs no replica.

    .venv/bin/python bench/in_app.py [--seconds 10]

Serves the recipes of docs/in-your-application.md as written there (FastAPI under
`uvicorn --workers 4`; Flask under `gunicorn -w 4`, without and with preload_app)
against a fresh database on the local PostgreSQL, with the recipes' job every second,
and each once more with the replica left out (`replica.start` made a no-op) for the
baseline. After a warm-up, it samples pg_stat_activity every 0.2 s for `--seconds`
(sessions by each worker's pid in its replica's application_name), then reads each
worker's RSS and PSS (/proc: PSS shares the pages workers share, a preload_app
master's imports among them). Writes the figures to bench/in_app.json and its section
of bench/RESULTS.md (the rest of that file as it was).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
from fleet import BENCH, ROOT, SERVER, Server

WORKERS = 4
PAGE = ROOT / "docs" / "in-your-application.md"
BLOCK = re.compile(r"```(?:python|yaml)\n# (\S+)\n(.*?)```", re.DOTALL)
PID = re.compile(r"-([0-9]+)$")
# Worker processes that run no replica: the recipe's Replica imports nothing ahead, and its
# start() does nothing.
NO_REPLICA = """import scheduler.replica
scheduler.replica._import_ahead = lambda keywords: None
scheduler.replica.Replica.start = lambda self, *args, **kwargs: self
"""
SERVERS = {
    "uvicorn": ["uvicorn", "myapp.main:app", "--workers", str(WORKERS), "--port", "{port}"],
    "gunicorn": ["gunicorn", "-c", "gunicorn.conf.py", "-w", str(WORKERS)],
    "gunicorn --preload": ["gunicorn", "-c", "gunicorn.conf.py", "-w", str(WORKERS), "--preload"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def recipes(folder: Path, replica: bool) -> None:
    for name, body in BLOCK.findall(PAGE.read_text()):
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
    (folder / "myapp" / "__init__.py").write_text("" if replica else NO_REPLICA)
    (folder / "config.yaml").write_text("jobs:\n  send_digest:\n    interval: 1s\n")


def workers(master: int) -> set[int]:
    try:
        found = Path(f"/proc/{master}/task/{master}/children").read_text().split()
    except OSError:
        return set()
    return {
        int(pid)
        for pid in found
        if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    }


def memory_mb(pid: int) -> tuple[float, float]:
    """(RSS, PSS) of a process, in MB."""
    found = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("Rss", "Pss"):
            found[name] = int(value.split()[0]) / 1024
    return round(found["Rss"], 1), round(found["Pss"], 1)


def answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5):
            return True
    except OSError:
        return False


def measure(server: Server, kind: str, replica: bool, seconds: float) -> dict[str, Any]:
    database = server.create("in_app")
    folder = Path(tempfile.mkdtemp(prefix="scheduler-bench-in-app-"))
    recipes(folder, replica)
    port = free_port()
    command = [c.format(port=port) for c in SERVERS[kind]]
    if kind.startswith("gunicorn"):
        command[5:5] = ["-b", f"127.0.0.1:{port}"]
        command.append("myapp.web:create_app()")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCHEDULER_")}
    env.update(
        SCHEDULER_DATABASE_URL=server.database_url(database),
        SCHEDULER_HOST_LOCK=str(folder / "host.lock"),
        PYTHONPATH=str(folder),
    )
    with open(folder / "server.log", "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", *command],
            cwd=folder,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 120
        while not (answers(port) and len(workers(process.pid)) == WORKERS):
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError(f"{kind}: not serving; see {folder / 'server.log'}")
            time.sleep(0.5)
        time.sleep(5)  # warm-up: the replicas started, the job runs
        most: Counter[int] = Counter()
        with psycopg.connect(server.url, autocommit=True) as conn:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                rows = conn.execute(
                    "SELECT application_name FROM pg_stat_activity WHERE datname = %s",
                    (database,),
                ).fetchall()
                now = Counter(int(m.group(1)) for (name,) in rows if (m := PID.search(name or "")))
                for pid in now:
                    most[pid] = max(most[pid], now[pid])
                time.sleep(0.2)
        pids = workers(process.pid)
        found = []
        for pid in sorted(pids):
            rss, pss = memory_mb(pid)
            role = "active" if most[pid] else "standby" if replica else "no replica"
            found.append(
                {"pid": pid, "role": role, "sessions": most[pid], "rss_mb": rss, "pss_mb": pss}
            )
        return {"server": kind, "replica": replica, "workers": found}
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
        server.drop(database)


def summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per server: each role's sessions and memory (the standbys' mean)."""
    rows = []
    for kind in SERVERS:
        row: dict[str, Any] = {"server": kind}
        for run in (r for r in runs if r["server"] == kind):
            for role in ("active", "standby", "no replica"):
                of = [w for w in run["workers"] if w["role"] == role]
                if of:
                    row[role] = {
                        "workers": len(of),
                        "sessions": max(w["sessions"] for w in of),
                        "rss_mb": round(sum(w["rss_mb"] for w in of) / len(of), 1),
                        "pss_mb": round(sum(w["pss_mb"] for w in of) / len(of), 1),
                    }
            if run["replica"]:
                row["host_sessions"] = sum(w["sessions"] for w in run["workers"])
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10, help="sampling the sessions")
    args = parser.parse_args()
    server = Server(SERVER)
    runs = []
    for kind in SERVERS:
        for replica in (True, False):
            print(f"{kind}, {'with' if replica else 'without'} the replica", flush=True)
            runs.append(measure(server, kind, replica, args.seconds))
    figures = {"date": time.strftime("%Y-%m-%d"), "summary": summary(runs), "runs": runs}
    (BENCH / "in_app.json").write_text(json.dumps(figures, indent=2))
    section = SECTION.format(
        command=" ".join(["bench/in_app.py", *sys.argv[1:]]),
        seconds=f"{args.seconds:g}",
        date=figures["date"],
        load=", ".join(f"{x:.1f}" for x in os.getloadavg()),
        table=table(figures["summary"]),
    )
    results = BENCH / "RESULTS.md"
    text = results.read_text()
    head, found, rest = text.partition(SECTION.split("\n", 1)[0])
    tail = rest[rest.find("\n## ") :] if found and "\n## " in rest else ""
    results.write_text(head.rstrip("\n") + "\n\n" + section + tail)
    print(section)
    return 0


def table(summary: list[dict[str, Any]]) -> str:
    def role(row: dict[str, Any], name: str) -> list[str]:
        of = row.get(name)
        return [str(of["sessions"]), f"{of['rss_mb']} / {of['pss_mb']}"] if of else ["-", "-"]

    lines = [
        "| server | active: sessions | active: RSS / PSS (MB) | standby: sessions"
        " | standby: RSS / PSS (MB) | no replica: RSS / PSS (MB) | sessions of the host |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in summary:
        cells = [
            row["server"],
            *role(row, "active"),
            *role(row, "standby"),
            role(row, "no replica")[1],
            str(row.get("host_sessions", "-")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


SECTION = """## In your application: one host, 4 web workers

`.venv/bin/python {command}` (not part of `bench/run.py`; raw figures in
`bench/in_app.json`), {date}, this machine (load average {load} from other work): the
recipes of docs/in-your-application.md, one host of 4 workers that share a host lock,
the recipes' job every second. *Sessions*: the most a worker held at once over {seconds} s,
sampled every 0.2 s (pg_stat_activity, by the pid in each replica's name); memory from
/proc after that, RSS / PSS (PSS shares out the pages the workers share: a
preload_app master's imports), the standbys' mean; *no replica*: the same app with the
replica left out.

{table}
"""


if __name__ == "__main__":
    raise SystemExit(main())
