"""Reloading config.yaml in a running replica (docs/changing.md)."""

from __future__ import annotations

import logging
import os
import textwrap
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from scheduler.backends.embedded import EmbeddedBackend
from scheduler.config.settings import load_config
from scheduler.daemon import Daemon, build_scheduler, reschedule
from scheduler.errors import ConfigError
from scheduler.fleet.reload import FileWatch, reread
from scheduler.ledger.registrations import registrations_of
from scheduler.registry.catalog import Catalog, load_catalog
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
    ("added", "said"),
    [
        ("ping_url: https://hc-ping.com/5f3c-secret", "ping_url unset -> https://hc-ping.com/…"),
        ("timeout: 5m", "timeout unset -> 5m"),
        ("retries: 2", "retries 0 -> 2"),
        ("catch_up: all", "catch_up off -> all"),
        ("retries: 2\n    retry_delay: 30s", "retries 0 -> 2; retry_delay 10s -> 30s"),
    ],
)
def test_a_reload_that_changes_any_field_of_a_job_says_which(project, added, said):
    config = load_config(str(project / "config.yaml"))
    catalog = load_catalog(config)
    edit(project, "interval: 2s", f"interval: 2s\n    {added}")
    assert reread(config, catalog).changes(catalog) == [f"sync: {said}"]


def test_a_job_that_differs_in_any_way_is_never_said_unchanged(project):
    """The guard: a field the description does not know of is still said."""
    from dataclasses import replace

    config = load_config(str(project / "config.yaml"))
    catalog = load_catalog(config)
    reloaded = reread(config, catalog)
    sync = catalog.by_name("sync")
    odd = replace(sync, spec=replace(sync.spec, source="elsewhere"))
    moved = replace(reloaded, catalog=Catalog([odd, catalog.by_name("report")]))
    assert moved.changes(catalog) == ["sync: changed"]
    assert reloaded.changes(catalog) == []


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
            found = registrations_of(conn, [3001])
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
    clock = [0.0]
    watch = FileWatch(link, clock=lambda: clock[0])
    assert not watch.changed()
    swapped = tmp_path / "..2026_12_01"
    swapped.mkdir()
    (swapped / "config.yaml").write_text("jobs: {}\n")  # same size: only the inode differs
    link.unlink()
    assert not watch.changed()  # gone for a moment: no change yet
    link.symlink_to(swapped / "config.yaml")
    assert not watch.changed()  # seen: counted once it stays so
    clock[0] += 1.0
    assert watch.changed() and not watch.changed()
    (swapped / "config.yaml").write_text("jobs: {a: 1}\n")
    watch.changed()
    clock[0] += 1.0
    assert watch.changed()


def test_a_file_watch_waits_until_the_file_is_still(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(textwrap.dedent(CONFIG))
    clock = [100.0]
    watch = FileWatch(path)
    watch.clock = lambda: clock[0]
    path.write_text("")  # an editor truncates, then writes: the empty file is no config
    assert not watch.changed()
    clock[0] += 1.0
    path.write_text(textwrap.dedent(CONFIG).replace("2s", "1s"))
    assert not watch.changed()  # it changed since the last look: still being written
    clock[0] += 1.0
    assert watch.changed()  # the same for a second: written
    assert not watch.changed()


@pytest.mark.parametrize(
    "text",
    [
        "",
        "\n",
        "# being written\n",
        "scheduler:\n  max_workers: 4\n",
        "scheduler:\n  max_workers: 4\njobs:\n",
    ],
)
def test_a_reload_never_applies_a_file_that_names_no_job(project, caplog, text):
    daemon, backend = started(project)
    try:
        before = daemon.catalog
        (project / "config.yaml").write_text(text)
        with caplog.at_level(logging.INFO, logger="scheduler"):
            assert not daemon.reload("config.yaml changed")
        (error,) = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert "names no job" in error.getMessage() and "jobs: {}" in error.getMessage()
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert not [w for w in warnings if "restart" in w], warnings  # no restart talk
        assert daemon.catalog is before
        assert {j.id for j in daemon.scheduler.get_jobs()} == {"sync", "report"}
    finally:
        daemon.scheduler.shutdown(wait=False)
        backend.close()


def test_jobs_written_empty_on_purpose_unschedules_every_job(project, caplog):
    daemon, backend = started(project)
    try:
        (project / "config.yaml").write_text("scheduler:\n  max_workers: 4\njobs: {}\n")
        with caplog.at_level(logging.INFO, logger="scheduler"):
            assert daemon.reload("SIGHUP")
        assert daemon.catalog.scheduled == ()
        assert daemon.scheduler.get_jobs() == []
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        daemon.scheduler.shutdown(wait=False)
        backend.close()


def test_a_file_that_changes_while_it_is_read_is_read_again_later(project, monkeypatch):
    import scheduler.fleet.reload as reload_module

    config = load_config(str(project / "config.yaml"))
    catalog = load_catalog(config)
    real = reload_module.load_config

    def read_then_written(*args, **kwargs):
        found = real(*args, **kwargs)
        edit(project, "interval: 2s", "interval: 1s")  # the writer goes on meanwhile
        return found

    monkeypatch.setattr(reload_module, "load_config", read_then_written)
    with pytest.raises(reload_module.Unsettled, match="changed while it was read"):
        reread(config, catalog)


def test_a_reload_the_ledger_failed_is_tried_again_until_it_applies(project, caplog):
    from sqlalchemy.exc import OperationalError

    daemon, backend = started(project)
    clock = [0.0]
    daemon.reloads.clock = lambda: clock[0]
    failures = [3]
    real = daemon.housekeeping.reregister

    def cut_off(catalog):
        if failures[0]:
            failures[0] -= 1
            raise OperationalError("SELECT 1", {}, Exception("connection failed"))
        return real(catalog)

    daemon.housekeeping.reregister = cut_off
    try:
        edit(project, "interval: 2s", "interval: 1s")
        daemon.reload_requested.set()
        with caplog.at_level(logging.INFO, logger="scheduler"):
            daemon._reload_if_asked(None)  # fails: the ledger
            assert failures == [2]
            daemon._reload_if_asked(None)  # not yet: it backs off
            assert failures == [2]
            for _ in range(20):
                clock[0] += 1.0
                daemon._reload_if_asked(None)
        assert failures == [0]
        assert daemon.catalog.by_name("sync").describe() == "every 1s"
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "connection failed" in errors[0]  # once per distinct failure
        assert "config.yaml reloaded" in caplog.text
        tries = [r for r in caplog.records if "config.yaml reloaded:" in r.getMessage()]
        assert len(tries) == 1
        caplog.clear()
        clock[0] += 100.0
        daemon._reload_if_asked(None)  # applied: nothing more to try
        assert "reload" not in caplog.text
    finally:
        daemon.scheduler.shutdown(wait=False)
        backend.close()
