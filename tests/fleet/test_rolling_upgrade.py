"""A rolling deploy over a ledger made by the last released version: a replica of that
release runs alone, a replica of this code starts beside it (and migrates the ledger in
place while the old one claims), both run side by side for about a minute, then the old
one stops. Every tick of the whole window runs exactly once (docs/operating.md:
Upgrading)."""

from __future__ import annotations

import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest

from scheduler.backends.schema import CURRENT_VERSION
from tests.support import ROOT, Fleet, assert_exactly_once, parse_tick, whole_seconds

pytestmark = pytest.mark.fleet

LAST_RELEASE = "5b2536cdd7f5c10f9d56d802aa3068095b5d3526"  # schema version 6
SCHEDULES = {"every_second": {"interval": "1s"}, "cron_second": {"cron": "* * * * * *"}}
SIDE_BY_SIDE_S = 50


@pytest.fixture
def last_release() -> Iterator[Path]:
    """The last released code, checked out beside this one."""
    present = subprocess.run(
        ["git", "-C", str(ROOT), "cat-file", "-e", f"{LAST_RELEASE}^{{commit}}"],
        capture_output=True,
    )
    if present.returncode:
        pytest.skip(f"the last release ({LAST_RELEASE[:7]}) is not in this clone: a shallow one?")
    with tempfile.TemporaryDirectory(prefix="scheduler-release-") as parent:
        tree = Path(parent) / "release"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), LAST_RELEASE],
            check=True,
            capture_output=True,
        )
        try:
            yield tree
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                capture_output=True,
            )


def schema_version(url: str) -> int:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT max(version) FROM scheduler_schema").fetchone()[0]


def test_a_rolling_deploy_over_the_last_releases_ledger_runs_each_tick_once(
    tmp_path, database_url, last_release
):
    fleet = Fleet(tmp_path, database_url, SCHEDULES, job_files=["exactly_once.py"])
    try:
        fleet.start("old", env={"PYTHONPATH": str(last_release)})
        fleet.wait_ready()
        assert schema_version(database_url) == 6  # the release made the ledger
        start = datetime.now(UTC) + timedelta(seconds=1.5)
        time.sleep(4)
        fleet.start("new")
        fleet.wait_ready()
        assert schema_version(database_url) == CURRENT_VERSION  # migrated in place
        beside = datetime.now(UTC)
        time.sleep(SIDE_BY_SIDE_S)
        fleet.replicas["old"].signal(signal.SIGTERM)  # the deploy replaces it
        assert fleet.replicas["old"].wait(60) == 0, fleet.logs()
        time.sleep(4)
        end = datetime.now(UTC) - timedelta(seconds=1.5)
        codes = fleet.stop()
    finally:
        fleet.kill_all()
    assert codes == {"old": 0, "new": 0}, fleet.logs()
    evidence = fleet.evidence()
    window = whole_seconds(start, end)
    for job in SCHEDULES:
        assert_exactly_once(evidence, job, window, fleet.logs())
    for name in ("old", "new"):  # both claimed ticks while side by side
        ran = [e for e in evidence if e["instance"] == name and parse_tick(e["tick"]) > beside]
        assert len(ran) >= 10, f"{name} ran {len(ran)} ticks beside the other\n{fleet.logs()}"
    for name in ("old", "new"):
        assert "Traceback" not in fleet.replicas[name].log(), fleet.logs()
    rows = [r for r in fleet.ledger() if start <= r["scheduled_at"] <= end]
    assert {r["status"] for r in rows} == {"succeeded"}, rows
