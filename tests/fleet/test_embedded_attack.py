"""Embedded mode as another local user would attack it: `nobody`, against a running fleet.

The attacker needs none of the project: a small script run by the system's Python as
`nobody` tries to hold a job's lock, to take SQLite's WAL write lock in `-shm` (which
stops every replica), and to read the jobs' history. It must fail at each, on a fresh
fleet and on one upgraded from the files an older version left (0755 folder, 0644 lock
files and ledger), even when it opened those files before the upgrade and kept them.
The fleet's folder is one every user may look into, as a project folder usually is.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy

from tests.support import Fleet, assert_exactly_once, parse_tick, wait_for, whole_seconds

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="attacking as the user nobody needs root to switch to it"
)

JOBS = ["shared_host.py"]
SCHEDULES = {"ten_seconds": {"interval": "3s"}, "quick": {"interval": "1s"}}
NAMESPACE = 1396918340  # the default lock_namespace
QUICK = 2702
ROOT = Path(__file__).resolve().parents[2]
AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]

ATTACK = r"""
import fcntl, json, os, sqlite3, struct, sys

folder, mode = sys.argv[1], sys.argv[2]
db = os.path.join(folder, "scheduler.db")
job_lock = os.path.join(folder, "scheduler.db.locks", sys.argv[3])

def hold_job_lock():
    fd = os.open(job_lock, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd

def lock_ledger():  # SQLite's WAL write lock: byte 120 of -shm
    fd = os.open(db + "-shm", os.O_RDONLY)
    fcntl.fcntl(fd, fcntl.F_SETLK, struct.pack("hhqqi4x", fcntl.F_RDLCK, 0, 120, 1, 0))
    return fd

def read_history():
    conn = sqlite3.connect("file:" + db + "?mode=ro", uri=True)
    return conn.execute("SELECT count(*) FROM scheduler_ticks").fetchone()

def read_ledger_file():
    return os.open(db, os.O_RDONLY)

if mode == "hold":  # as before an upgrade: open and lock what is open to all, and keep it
    kept = {"job_lock": hold_job_lock(), "ledger": read_ledger_file()}
    print(json.dumps({name: os.fstat(fd).st_ino for name, fd in kept.items()}), flush=True)
    sys.stdin.read()
    sys.exit(0)

tried = {}
for name, attempt in [("hold_job_lock", hold_job_lock), ("lock_ledger", lock_ledger),
                      ("read_history", read_history), ("read_ledger_file", read_ledger_file)]:
    try:
        attempt()
        tried[name] = "done"
    except (OSError, sqlite3.Error) as exc:
        tried[name] = "refused: " + str(exc)
print(json.dumps(tried))
"""


@pytest.fixture
def shared_folder() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="scheduler-attack-", dir="/tmp"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def attacker(folder: Path, mode: str) -> list[str]:
    script = folder / "attack.py"
    if not script.exists():
        script.write_text(ATTACK)
        script.chmod(0o644)
    return [*AS_NOBODY, "/usr/bin/python3", str(script), str(folder), mode, lock_name(QUICK)]


def lock_name(key: int) -> str:
    return f"{NAMESPACE}-{key}.lock"


def attack(folder: Path) -> dict[str, str]:
    done = subprocess.run(attacker(folder, "try"), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def history_as_nobody(folder: Path) -> subprocess.CompletedProcess[str]:
    """`scheduler history` itself, as nobody (the system's Python, the project on its path)."""
    packages = Path(sqlalchemy.__file__).resolve().parents[1]
    return subprocess.run(
        [*AS_NOBODY, "/usr/bin/python3", "-m", "scheduler", "history"],
        cwd=folder,
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": f"{ROOT}:{packages}",
            "SCHEDULER_CONFIG": str(folder / "config.yaml"),
        },
        capture_output=True,
        text=True,
        timeout=60,
    )


def readable_by_all(folder: Path) -> None:
    """The project's own files (config, jobs) are as a checkout leaves them: 0644."""
    for path in [folder / "config.yaml", folder / "evidence.jsonl", *folder.glob("jobs/*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    (folder / "jobs").chmod(0o755)


def assert_refused(tried: dict[str, str]) -> None:
    assert all(result.startswith("refused:") for result in tried.values()), tried


def run_under_attack(fleet: Fleet, since: float) -> dict[str, Any]:
    """Attack a fleet started at `since`; its quick job must run every second meanwhile."""
    fleet.wait_ready()

    def runs() -> list[dict[str, Any]]:
        return [e for e in fleet.starts() if e["job"] == "quick" and e["at"] > since]

    first = wait_for(runs, 60, "a quick run")
    began = parse_tick(first[0]["tick"])
    tried = attack(fleet.root)
    cli = history_as_nobody(fleet.root)
    time.sleep(3)
    end = datetime.now(UTC)
    codes = fleet.stop()
    logs = fleet.logs()
    assert set(codes.values()) == {0}, logs
    window = whole_seconds(began, end - timedelta(seconds=2))
    assert_exactly_once(fleet.evidence(), "quick", window, logs)
    return {"tried": tried, "cli": cli, "logs": logs}


def test_another_user_can_neither_lock_nor_read_a_running_embedded_fleet(shared_folder):
    fleet = Fleet(shared_folder, None, SCHEDULES, job_files=JOBS)
    readable_by_all(shared_folder)
    since = time.time()
    for name in ("r1", "r2"):
        fleet.start(name)
    try:
        found = run_under_attack(fleet, since)
    finally:
        fleet.kill_all()
    assert_refused(found["tried"])
    assert "Permission denied" in found["tried"]["hold_job_lock"]
    assert "Permission denied" in found["tried"]["lock_ledger"]
    cli = found["cli"]
    assert cli.returncode == 2 and "Traceback" not in cli.stderr, cli.stderr
    assert len(cli.stderr.splitlines()) == 1 and not cli.stdout, cli.stdout + cli.stderr


def test_an_upgrade_from_an_older_versions_files_shuts_the_attacker_out(shared_folder):
    fleet = Fleet(shared_folder, None, SCHEDULES, job_files=JOBS)
    readable_by_all(shared_folder)
    fleet.start("r1")
    try:
        fleet.wait_ready()
        wait_for(lambda: any(e["job"] == "quick" for e in fleet.starts()), 60, "a quick run")
        assert fleet.stop() == {"r1": 0}
    finally:
        fleet.kill_all()
    # The files as the older version made them: a 0755 folder, 0644 files and ledger.
    locks = shared_folder / "scheduler.db.locks"
    for path in [locks, locks / "instances"]:
        path.chmod(0o755)
    for path in [shared_folder / "scheduler.db", *locks.glob("*.lock"), *locks.glob("*/*.lock")]:
        path.chmod(0o644)
    before = attack(shared_folder)
    assert before["hold_job_lock"] == "done" and before["read_ledger_file"] == "done", before

    holding = subprocess.Popen(
        attacker(shared_folder, "hold"), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holding.stdout is not None
        kept = json.loads(holding.stdout.readline())  # opened back then, and kept
        fleet.replicas.clear()
        since = time.time()
        for name in ("r1", "r2"):
            fleet.start(name)
        found = run_under_attack(fleet, since)
    finally:
        fleet.kill_all()
        holding.kill()
        holding.wait(10)

    assert_refused(found["tried"])
    assert found["cli"].returncode == 2, found["cli"].stdout
    # What the attacker kept open is no longer the fleet's: a lock on a file nobody uses,
    # and a ledger file no replica writes.
    assert kept["job_lock"] != (locks / lock_name(QUICK)).stat().st_ino
    assert kept["ledger"] != (shared_folder / "scheduler.db").stat().st_ino
    assert "other users could open the ledger" in found["logs"]
    assert "lock files made this user's alone" in found["logs"]
    modes = [
        os.stat(path).st_mode & 0o777
        for path in [locks, locks / "instances", shared_folder / "scheduler.db"]
    ]
    assert modes == [0o700, 0o700, 0o600]
