"""Embedded mode as its users meet it: a job that moves the working folder, another user
running `status`, two fleets on one ledger, and a full disk under the finishes."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from sqlalchemy.exc import OperationalError

from scheduler.config.settings import Settings, load_config
from scheduler.errors import ConfigError
from scheduler.fleet.housekeeping import Housekeeping
from scheduler.fleet.reload import reread
from scheduler.observers import events
from scheduler.registry.catalog import Catalog, load_catalog
from tests.support import make_job, now_tick, settle
from tests.unit.embedded_helpers import command_env, project, replica, scheduler

ROOT = Path(__file__).resolve().parents[2]


def test_a_job_that_changes_the_working_folder_does_not_break_the_next_reload(
    tmp_path, monkeypatch
):
    project(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SCHEDULER_CONFIG", raising=False)
    config = load_config("config.yaml", jobs_path="jobs")
    catalog = load_catalog(config)
    monkeypatch.chdir("/")  # a job's os.chdir('/')
    (tmp_path / "config.yaml").write_text("jobs:\n  steady:\n    interval: 2h\n")
    reloaded = reread(config, catalog)
    assert reloaded.changes(catalog) and not reloaded.restart_needed


@pytest.fixture
def shared_folder():
    """A folder every local user may look into, as a project folder usually is."""
    folder = Path(tempfile.mkdtemp(prefix="scheduler-shared-", dir="/tmp"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


def as_nobody(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`scheduler ...` as the user nobody, by the system's Python (the venv's may sit in a
    folder nobody can enter), with the project and its packages on the path."""
    import sqlalchemy

    packages = Path(sqlalchemy.__file__).resolve().parents[1]
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": f"{ROOT}:{packages}",
        "SCHEDULER_CONFIG": str(folder / "config.yaml"),
    }
    command = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
    return subprocess.run(
        [*command, "/usr/bin/python3", "-m", "scheduler", *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="running as another user needs root")
@pytest.mark.parametrize("command", ["status", "history"])
def test_another_user_running_status_gets_one_line(shared_folder, command):
    project(shared_folder)
    for path in [shared_folder, *shared_folder.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    a = replica(shared_folder, "a")
    try:
        done = as_nobody(shared_folder, command)
    finally:
        a.close()
        a.ledger_engine.dispose()
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.splitlines()
    assert "scheduler.db" in line and "root" in line


def test_a_key_clash_in_embedded_mode_does_not_advise_a_schema(tmp_path):
    theirs = replica(tmp_path, "r2")  # live: its presence file is held
    try:
        settings = Settings(instance_name="r2")
        other = Catalog((make_job(7101, lambda ctx: None, name="other"),))
        Housekeeping(theirs, other, settings).reregister(other)
        mine = replica(tmp_path, "r1", connect=False)
        ours = Catalog((make_job(7101, lambda ctx: None, name="steady"),))
        keeper = Housekeeping(mine, ours, Settings(instance_name="r1"))
        with pytest.raises(ConfigError) as refused:
            keeper.track_jobs()
        assert "its own folder" in str(refused.value) and "schema" not in str(refused.value)
        mine.ledger_engine.dispose()
    finally:
        theirs.close()
        theirs.ledger_engine.dispose()


def test_a_full_disk_under_the_finishes_is_said_in_few_lines(gate_over_file, caplog):
    job = make_job(41, lambda ctx: None, name="quick")
    gate, seen, clock, backend = gate_over_file()

    def full(requests):
        raise OperationalError("UPDATE", {}, Exception("database or disk is full"))

    backend.finish = full
    gate.submit(job, now_tick(-1))
    settle(gate, lambda: gate.finishes.pending(), "the run to end")
    caplog.set_level(logging.WARNING, logger="scheduler.gate")
    for _ in range(60):  # a minute of trying again, once a second
        clock.now += 1.0
        gate.step()
    said = [r for r in caplog.records if r.name == "scheduler.gate"]
    assert 2 <= len(said) <= 6, [r.getMessage() for r in said]
    assert not any(r.exc_info for r in said)
    assert all("database or disk is full" in r.getMessage() for r in said)
    assert "more like it unsaid" in said[-1].getMessage()
    assert not seen.of(events.RunFinished)


def test_a_second_replica_of_the_same_name_is_refused_at_once(tmp_path):
    """In embedded mode a live presence is a live process: nothing to wait for."""
    config = project(tmp_path)
    first = subprocess.Popen(
        [sys.executable, "-m", "scheduler", "run"],
        cwd=tmp_path,
        env=command_env(config, "r1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert first.stderr is not None
        for line in first.stderr:
            if "lock session up" in line:
                break
        started = time.monotonic()
        second = scheduler(config, "run", instance="r1", timeout=60)
        assert second.returncode == 2, second.stderr
        assert time.monotonic() - started < 20
        assert "'r1' is in use by a live replica" in second.stderr, second.stderr
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=30)  # waits, and closes the pipe
