"""The unit tier's shared fixtures."""

from __future__ import annotations

import os
import textwrap
from datetime import UTC, datetime
from pathlib import Path

import pytest

from scheduler.backends import open_backend
from scheduler.backends.embedded import EmbeddedBackend
from scheduler.cli.commands import main
from scheduler.config.settings import load_config
from scheduler.gate import Gate
from scheduler.registry.catalog import load_catalog
from scheduler.web.routes import Page
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
PAGE_NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)  # the page's clock in page tests


def two_jobs(folder: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A project of the two jobs in `folder`, and no SCHEDULER_ setting from outside."""
    (folder / "jobs").mkdir()
    (folder / "jobs" / "work.py").write_text(textwrap.dedent(JOBS))
    (folder / "config.yaml").write_text(textwrap.dedent(CONFIG))
    for var in [v for v in os.environ if v.startswith("SCHEDULER_")]:
        monkeypatch.delenv(var)
    return folder / "config.yaml"


@pytest.fixture
def run(tmp_path: Path, capsys, monkeypatch):
    """`scheduler COMMAND ...` on a project of two jobs with an embedded ledger."""
    two_jobs(tmp_path, monkeypatch)

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


@pytest.fixture
def project(tmp_path: Path, monkeypatch):
    """Page(**env): the page of a project of two jobs over an embedded ledger, at PAGE_NOW."""
    path = two_jobs(tmp_path, monkeypatch)
    monkeypatch.setenv("SCHEDULER_INSTANCE_NAME", "unit-1")

    def make(**env: str) -> Page:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        return page_of(path)

    return make


def page_of(path: Path) -> Page:
    """The page of the project at `path`, over the backend its settings name, at PAGE_NOW."""
    config = load_config(path)
    backend = open_backend(config.settings)
    backend.migrate()
    catalog = load_catalog(config)
    return Page(backend, lambda: catalog, config.settings, clock=lambda: PAGE_NOW)
