"""Embedded mode: lock files, presence files and the whole lock folder removed under three
running replicas (a temp cleaner) while a 10 s job runs. No run may start beside another,
and the fleet must mend itself within seconds, saying in `status` what it mended."""

from __future__ import annotations

import json
import shutil
import sqlite3
import time
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from pathlib import Path
from typing import Any

from tests.support import Fleet, assert_exactly_once, cli, wait_for, whole_seconds

JOBS = ["shared_host.py"]
SCHEDULES = {"ten_seconds": {"interval": "3s"}, "quick": {"interval": "1s"}}
NAMES = ["r1", "r2", "r3"]


def status(fleet: Fleet) -> dict[str, Any]:
    done = cli(fleet, "status", "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def running(document: dict[str, Any], job: str) -> dict[str, Any] | None:
    return next(j["running"] for j in document["jobs"] if j["name"] == job)


def mended(fleet: Fleet, since: float) -> dict[str, Any] | None:
    """`status` once every replica is back, the running job's lock held by its runner, and
    each replica's note telling what it mended."""
    document = status(fleet)
    instances = {i["name"]: i for i in document["instances"]}
    run = running(document, "ten_seconds")
    if sorted(instances) != NAMES or run is None or run["lock_held_by"] != run["instance"]:
        return None
    at = datetime.fromtimestamp(since, UTC).isoformat(timespec="seconds")
    notes = {name: i.get("note") or "" for name, i in instances.items()}
    if not all(note[:25] >= at for note in notes.values()):  # each made its presence again
        return None
    return document if "took back the locks" in notes[run["instance"]] else None


def ten_second_runs(fleet: Fleet) -> list[tuple[float, float]]:
    starts = {e["run_id"]: e["at"] for e in fleet.starts() if e["job"] == "ten_seconds"}
    ends = {e["run_id"]: e["at"] for e in fleet.ends() if e["job"] == "ten_seconds"}
    return sorted((at, ends.get(run_id, float("inf"))) for run_id, at in starts.items())


def ledger_rows(root: Path, job: str) -> list[dict[str, Any]]:
    with sqlite3.connect(root / "scheduler.db") as conn:
        conn.row_factory = sqlite3.Row
        query = "SELECT * FROM scheduler_ticks WHERE job_name = ? ORDER BY scheduled_at"
        return [dict(row) for row in conn.execute(query, (job,))]


def remove_under_a_run(fleet: Fleet, remove) -> float:
    """Wait for a 10 s run to be 2 s in, then remove; returns when."""

    def under_way() -> bool:
        runs = ten_second_runs(fleet)
        return bool(runs) and runs[-1][1] == float("inf") and time.time() - runs[-1][0] > 2

    wait_for(under_way, 60, "a 10 s run under way")
    removed_at = time.time()
    remove()
    return removed_at


def test_lock_files_removed_under_three_replicas_never_let_a_run_overlap(tmp_path):
    fleet = Fleet(tmp_path, None, SCHEDULES, job_files=JOBS)
    folder = tmp_path / "scheduler.db.locks"
    for name in NAMES:
        fleet.start(name)
    try:
        fleet.wait_ready()
        began = datetime.now(UTC)

        def files() -> None:  # rm scheduler.db.locks/*.lock scheduler.db.locks/instances/*.lock
            for path in [*folder.glob("*.lock"), *folder.glob("instances/*.lock")]:
                path.unlink(missing_ok=True)

        first = remove_under_a_run(fleet, files)
        after_files = wait_for(lambda: mended(fleet, first), 30, "the fleet to mend the files")

        second = remove_under_a_run(fleet, lambda: shutil.rmtree(folder, ignore_errors=True))
        after_folder = wait_for(lambda: mended(fleet, second), 30, "the fleet to mend the folder")
        wait_for(
            lambda: sum(start > second for start, _ in ten_second_runs(fleet)) >= 2,
            60,
            "the 10 s job to go on after the removal",
        )
        end = datetime.now(UTC)
        codes = fleet.stop()
    finally:
        fleet.kill_all()
    logs = fleet.logs()
    assert set(codes.values()) == {0}, logs

    runs = ten_second_runs(fleet)
    overlaps = [(a, b) for a, b in pairwise(runs) if b[0] < a[1]]
    assert not overlaps, f"runs of the 10 s job overlapped: {overlaps}\n{logs}"
    assert not [e for e in fleet.starts() if e.get("overlap")], logs
    statuses = {row["status"] for row in ledger_rows(tmp_path, "ten_seconds")}
    assert "crashed" not in statuses, logs  # no live run was taken for a dead one

    for document in (after_files, after_folder):
        notes = " ".join(i.get("note", "") for i in document["instances"])
        assert "took back the locks of job key(s) 2701" in notes, document
        assert "made this replica's presence file again" in notes, document
    folder_notes = " ".join(i.get("note", "") for i in after_folder["instances"])
    assert "the lock folder" in folder_notes and "made it again" in folder_notes
    assert "lock files removed under this replica" in logs

    # The quick job never stopped: every second of the test ran once.
    window = whole_seconds(began + timedelta(seconds=2), end - timedelta(seconds=2))
    assert_exactly_once(fleet.evidence(), "quick", window, logs)
