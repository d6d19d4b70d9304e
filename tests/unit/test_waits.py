"""Sleeping: `scheduler.waits.sleep` is the one way the package waits a while.

`time.sleep` fails (EINVAL) under libfaketime with a shifted wall clock, which is
how the fleet tests stand for a host whose clock is off: a thread that slept with
it died, and with the log writer went every log line of the replica.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import scheduler
from tests.support import faketime_library

PACKAGE = Path(scheduler.__file__).parent


def sleeps_in(path: Path) -> list[int]:
    """Lines that call time.sleep, or import it by name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "sleep"
            and isinstance(node.value, ast.Name)
            and node.value.id == "time"
        ):
            found.append(node.lineno)
        if isinstance(node, ast.ImportFrom) and node.module == "time":
            found += [node.lineno for alias in node.names if alias.name == "sleep"]
    return sorted(found)


def test_the_package_never_calls_time_sleep():
    found = {
        str(path.relative_to(PACKAGE)): lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if (lines := sleeps_in(path))
    }
    assert not found, f"use scheduler.waits.sleep, not time.sleep: {found}"


def test_the_scan_finds_a_sleep(tmp_path):
    """The guard above can fail: it finds both spellings."""
    (tmp_path / "a.py").write_text("import time\ntime.sleep(1)\nfrom time import sleep\n")
    assert sleeps_in(tmp_path / "a.py") == [2, 3]


@pytest.mark.parametrize("offset", ["-3600s", "+90s"])
def test_sleeping_and_logging_work_with_a_shifted_wall_clock(offset):
    script = (
        "import logging, sys\n"
        "from scheduler import logs, waits\n"
        "waits.sleep(0.05)\n"
        "logs.setup_logging('text', stream=sys.stdout)\n"
        "logging.getLogger('scheduler.test').warning('still here')\n"
        "logs.stop_logging()\n"
    )
    env = {
        "LD_PRELOAD": faketime_library(),
        "FAKETIME": offset,
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "PYTHONPATH": str(PACKAGE.parent),
    }
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "still here" in done.stdout
