"""The unit tier's shared fixtures."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from scheduler.backends.embedded import EmbeddedBackend
from scheduler.cli import main
from scheduler.gate import Gate
from tests.support import FakeMonotonic, Recorder

JOBS = """
from scheduler import job

@job(key=2001)
def sync(ctx):
    pass

@job(key=2002)
def report(ctx):
    pass
"""

CONFIG = """
jobs:
  sync:
    interval: 1m
  report:
    cron: "0 2 * * *"
"""


@pytest.fixture
def run(tmp_path: Path, capsys, monkeypatch):
    """`scheduler COMMAND ...` on a project of two jobs with an embedded ledger."""
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "work.py").write_text(textwrap.dedent(JOBS))
    (tmp_path / "config.yaml").write_text(textwrap.dedent(CONFIG))
    for var in [v for v in os.environ if v.startswith("SCHEDULER_")]:
        monkeypatch.delenv(var)

    def run(*args: str) -> tuple[int, str, str]:
        command, *rest = args
        code = main([command, "--config", str(tmp_path / "config.yaml"), *rest])
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture
def gate_over_file(tmp_path):
    """(gate, recorder, clock, backend) over a SQLite ledger and file locks in tmp_path."""
    made = []

    def make(instance: str = "u1", max_workers: int = 4, clock: FakeMonotonic | None = None):
        backend = EmbeddedBackend(tmp_path / "scheduler.db", instance=instance, namespace=77)
        backend.migrate()
        seen, clock = Recorder(), clock or FakeMonotonic()
        gate = Gate(
            backend,
            instance=instance,
            max_workers=max_workers,
            holder_timeout=30,
            listeners=[seen],
            monotonic=clock,
        )
        made.append(gate)
        return gate, seen, clock, backend

    yield make
    for gate in made:
        gate.backend.close()
