"""The host lock: processes sharing a file elect one active replica; a standby takes over
when the active one stops (the real-process kill is in tests/integration/test_replica_host.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from scheduler import Replica
from scheduler.config.settings import load_config
from scheduler.fleet.host_lock import HostLock, default_file, standbys
from tests.support import wait_for
from tests.unit.test_replica import project, ticks


def test_one_holder_at_a_time(tmp_path):
    first, second = HostLock(tmp_path / "host.lock"), HostLock(tmp_path / "host.lock")
    assert first.try_take() and first.try_take()  # taking it again: still ours
    assert not second.try_take()
    first.release()
    assert second.try_take()
    second.release()
    assert os.stat(tmp_path / "host.lock").st_mode & 0o777 == 0o600


def test_the_default_file_is_named_after_the_schema_and_database_in_a_folder_of_ours(
    tmp_path, monkeypatch
):
    config = project(tmp_path, monkeypatch)
    url = "postgresql://app:secret@db.example:5432/orders"
    settings = load_config(str(config), database_url=url, schema="billing").settings
    path = default_file(settings, tmp_path / "scheduler.db")
    assert path.parent.name == f"scheduler-{os.getuid()}"
    assert path.name.startswith("billing-orders-") and path.suffix == ".lock"
    assert "secret" not in str(path)
    other = load_config(str(config), database_url=url.replace("orders", "stock")).settings
    assert default_file(other, tmp_path / "scheduler.db") != path


def test_a_standby_takes_over_within_a_second_when_the_active_one_stops(tmp_path, monkeypatch):
    config = project(tmp_path, monkeypatch)
    lock = str(tmp_path / "host.lock")
    active = Replica(config=config, host_lock=lock, instance_name="first").start()
    standby = Replica(config=config, host_lock=lock, instance_name="second")
    began = time.monotonic()
    standby.start()
    try:
        assert time.monotonic() - began < 30  # waiting for its turn would never end here
        assert active.active and not active.standby
        assert standby.standby and not standby.active and standby.daemon is None
        assert standbys(tmp_path / "host.lock") == ["second"]  # what `status` lists
        active.stop()
        stopped = time.monotonic()
        wait_for(lambda: standby.active, 15, "the standby to take over", every=0.02)
        # Within a second on a quiet machine (docs/in-your-application.md gives the figure,
        # tests/integration/test_replica_host.py prints it); a loaded one may stall seconds.
        assert time.monotonic() - stopped < 5.0
        assert standbys(tmp_path / "host.lock") == []
        seen = len(ticks(tmp_path))
        wait_for(lambda: len(ticks(tmp_path)) > seen, 5, "a tick run by the new active replica")
    finally:
        standby.stop()
        active.stop()


def status(config, env: dict[str, str]) -> tuple[int, str, str]:
    done = subprocess.run(
        [sys.executable, "-m", "scheduler", "status", "--config", str(config)],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    return done.returncode, done.stdout, done.stderr


def test_scheduler_run_stands_by_behind_a_host_lock_it_is_given(tmp_path, monkeypatch):
    """Off by default for `scheduler run`; set, the second process waits, and SIGTERM ends
    its wait with 0."""
    config = project(tmp_path, monkeypatch)
    env = {**os.environ, "SCHEDULER_HOST_LOCK": str(tmp_path / "host.lock")}
    command = [sys.executable, "-m", "scheduler", "run", "--config", str(config)]
    first = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: len(ticks(tmp_path)) >= 1, 15, "the first process to run a tick")
        second = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
        assert second.stderr is not None
        said = [second.stderr.readline() for _ in range(2)]
        assert "standing by" in said[-1], said
        code, out, _ = status(config, env)
        assert code == 0 and "on standby on this host: " in out
        second.send_signal(signal.SIGTERM)
        assert second.wait(10) == 0
        second.stderr.close()
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(20)
        assert first.stderr is not None
        first.stderr.close()
