"""Bad input refused by real `scheduler` processes: exit 2 before anything starts.

The same cases as tests/unit/test_hostile_input.py, a representative subset,
against `python -m scheduler run` (and other commands) as a user would run them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_hostile_input import CASES, assert_refused, project, run_against

pytestmark = pytest.mark.fleet


SUBPROCESS_CASES = [
    ("run", "password with @ and #"),
    ("run", "password with a bad percent escape"),
    ("run", "billion laughs"),
    ("run", "deeply nested"),
    ("run", "not UTF-8"),
    ("run", "holder_timeout infinite"),
    ("run", "interval 1e308"),
    ("run", "webhook port out of range"),
    ("run", "instance name with slashes"),
    ("run", "bare @job"),
    ("check", "password with @ and #"),
    ("check", "misspelled database_url"),
    ("status", "port out of range"),
    ("history", "billion laughs"),
    ("jobs", "job file linked from outside"),
]


@pytest.mark.parametrize(("command", "name"), SUBPROCESS_CASES)
def test_refused_by_a_real_process(command, name, tmp_path):
    case = CASES[name]
    config = project(tmp_path, case)
    result = subprocess.run(
        [sys.executable, "-m", "scheduler", command, "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,  # a `run` that starts instead of refusing fails here
        env={"PATH": "/usr/bin:/bin", **case.env},
        cwd=tmp_path,
    )
    assert_refused(case, result.returncode, result.stdout, result.stderr)


def test_run_waits_for_a_database_that_is_not_up_yet(tmp_path):
    """Refused connections pass (the database may be starting): retried, not an exit."""
    with pytest.raises(subprocess.TimeoutExpired):
        run_against("postgresql://postgres@127.0.0.1:1/db", tmp_path, timeout=3)


def test_a_busy_port_is_one_line_and_exit_2(tmp_path: Path):
    (tmp_path / "jobs").mkdir()
    (tmp_path / "config.yaml").write_text("jobs: {}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCHEDULER_")}
    with socket.create_server(("0.0.0.0", 0)) as taken:
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "scheduler", "run", "--http-port", str(port)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("scheduler: ")]
    assert errors == [
        f"scheduler: http_port {port} on 0.0.0.0: already in use"
        " (another process is listening there)"
    ], done.stderr
