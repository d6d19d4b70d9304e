"""Reloading config.yaml in a running replica (README: Changing a running fleet)."""

from __future__ import annotations

import logging
import os
import textwrap
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from scheduler import ledger
from scheduler.backends.embedded import EmbeddedBackend
from scheduler.catalog import Catalog, load_catalog
from scheduler.config import load_config
from scheduler.daemon import Daemon, build_scheduler, reschedule
from scheduler.errors import ConfigError
from scheduler.reload import FileWatch, reread
from tests.support import FakeMonotonic
from tests.unit.test_schedule_groups import FakeGate, job

JOBS = """
from scheduler import job

@job(key=3001)
def sync(ctx):
    pass

@job(key=3002)
def report(ctx):
    pass
"""

CONFIG = """
scheduler:
  max_workers: 4
jobs:
  sync:
    interval: 2s
  report:
    cron: "0 2 * * *"
"""


@pytest.fixture
def project(tmp_path: Path, monkeypatch) -> Path:
    for var in [v for v in os.environ if v.startswith("SCHEDULER_")]:
        monkeypatch.delenv(var)
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "work.py").write_text(textwrap.dedent(JOBS))
    (tmp_path / "config.yaml").write_text(textwrap.dedent(CONFIG))
    return tmp_path


def edit(project: Path, old: str, new: str) -> None:
    path = project / "config.yaml"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


def started(project: Path) -> tuple[Daemon, EmbeddedBackend]:
    config = load_config(str(project / "config.yaml"))
    backend = EmbeddedBackend(project / "scheduler.db", instance="r1", namespace=4242)
    daemon = Daemon(config, load_catalog(config), backend=backend, monotonic=FakeMonotonic())
    assert daemon.prepare()
    daemon.scheduler.start(paused=True)
    return daemon, backend


def test_reread_gives_the_new_schedules_and_names_what_needs_a_restart(project):
    config = load_config(str(project / "config.yaml"))
    catalog = load_catalog(config)
    edit(project, "interval: 2s", "interval: 1s")
    edit(project, "max_workers: 4", "max_workers: 8")
    reloaded = reread(config, catalog)
    assert reloaded.catalog.by_name("sync").describe() == "every 1s"
    assert reloaded.changes(catalog) == [
        "sync: every 2s in UTC, alerts after 3 skips / 3 failures, grace 30 s"
        " -> every 1s in UTC, alerts after 3 skips / 3 failures, grace 30 s"
    ]
    assert reloaded.restart_needed == ("max_workers",)


@pytest.mark.parametrize(
    ("old", "new", "expect"),
    [
        ("interval: 2s", "interval: soon", "jobs.sync.interval"),
        ("report:", "nightly:", "no job named 'nightly'"),
        ("jobs:", "jobs: [", "config.yaml"),
    ],
)
def test_an_invalid_file_is_the_error_check_prints(project, old, new, expect):
    config = load_config(str(project / "config.yaml"))
    catalog = load_catalog(config)
    edit(project, old, new)
    with pytest.raises(ConfigError, match=expect.replace("[", r"\[")) as raised:
        reread(config, catalog)
    try:  # what `scheduler check` would say of the same file
        load_catalog(load_config(str(project / "config.yaml")))
    except ConfigError as exc:
        assert str(exc) in str(raised.value)


def test_reschedule_keeps_an_unchanged_schedule_and_starts_a_new_one_at_its_next_tick():
    before = Catalog((job("a", 1, interval="2s"), job("b", 2, cron="0 2 * * *")))
    after = Catalog((job("a", 1, interval="1s"), job("b", 2, cron="0 2 * * *")))
    scheduler = build_scheduler(before, FakeGate())  # type: ignore[arg-type]
    scheduler.start(paused=True)
    try:
        kept = scheduler.get_job("b").next_run_time  # computed from now, at the start
        since = datetime(2020, 11, 30, 12, 0, 0, 500_000, tzinfo=UTC)  # far from now: tells
        reschedule(scheduler, after, since)
        assert scheduler.get_job("b").next_run_time == kept  # untouched
        new = scheduler.get_job("a")
        assert new.next_run_time == datetime(2020, 11, 30, 12, 0, 1, tzinfo=UTC)
        assert scheduler.executor.groups["a"][0].schedule.interval == timedelta(seconds=1)
    finally:
        scheduler.shutdown(wait=False)


def test_a_reload_applies_a_valid_file_and_an_invalid_one_changes_nothing(project, caplog):
    daemon, backend = started(project)
    try:
        edit(project, "interval: 2s", "interval: 1s")
        with caplog.at_level(logging.INFO, logger="scheduler"):
            assert daemon.reload("SIGHUP")
        assert daemon.catalog.by_name("sync").describe() == "every 1s"
        interval = daemon.scheduler.get_job("sync").trigger
        assert interval is daemon.catalog.by_name("sync").trigger
        with backend.ledger_engine.connect() as conn:
            found = ledger.registrations_of(conn, [3001])
        mine = {r.name: r.schedule for r in found if r.until is None}
        assert '"interval":1.0' in mine["sync"]
        (ended,) = [r for r in found if r.until is not None]  # kept: it judges the past
        assert '"interval":2.0' in (ended.schedule or "") and ended.until == found[-1].since
        assert "job code is not reloaded" in caplog.text

        edit(project, "interval: 1s", "interval: -1s")
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="scheduler"):
            assert not daemon.reload("SIGHUP")
        (error,) = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert "config.yaml not reloaded" in error.getMessage()
        assert "jobs.sync.interval" in error.getMessage()
        assert daemon.catalog.by_name("sync").describe() == "every 1s"
        assert daemon.scheduler.get_job("sync").trigger is interval
    finally:
        daemon.scheduler.shutdown(wait=False)
        backend.close()


def test_a_file_watch_sees_an_edit_and_a_swapped_link(tmp_path):
    data = tmp_path / "..2026_11_30"
    data.mkdir()
    (data / "config.yaml").write_text("jobs: {}\n")
    link = tmp_path / "config.yaml"
    link.symlink_to(data / "config.yaml")
    watch = FileWatch(link)
    assert not watch.changed()
    swapped = tmp_path / "..2026_12_01"
    swapped.mkdir()
    (swapped / "config.yaml").write_text("jobs: {}\n")  # same size: only the inode differs
    link.unlink()
    assert not watch.changed()  # gone for a moment: no change yet
    link.symlink_to(swapped / "config.yaml")
    assert watch.changed() and not watch.changed()
    (swapped / "config.yaml").write_text("jobs: {a: 1}\n")
    assert watch.changed()
