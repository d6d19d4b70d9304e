"""A replica waiting for its database at start-up: it retries and says so, louder with time."""

from __future__ import annotations

import logging
import os
import textwrap
import threading
from pathlib import Path

import pytest

from scheduler.backends.base import Unavailable
from scheduler.backends.embedded import EmbeddedBackend
from scheduler.config.settings import load_config
from scheduler.daemon import Daemon
from scheduler.errors import ConfigError
from scheduler.registry.catalog import load_catalog
from tests.support import FakeMonotonic


class Unreachable(EmbeddedBackend):
    """A database that does not answer the first `failures` times; each try costs `cost` s."""

    def __init__(self, path: Path, clock: FakeMonotonic, failures: int, cost: float) -> None:
        super().__init__(path, instance="r1", namespace=4242)
        self.fake_clock, self.failures, self.cost = clock, failures, cost
        self.tries = 0

    def verify(self) -> None:
        self.tries += 1
        self.fake_clock.now += self.cost
        if self.tries <= self.failures:
            raise Unavailable("connection refused")


class Waits(threading.Event):
    """A stop event whose waits pass on the fake clock, not on the wall."""

    def __init__(self, clock: FakeMonotonic) -> None:
        super().__init__()
        self.clock = clock

    def wait(self, timeout: float | None = None) -> bool:
        self.clock.now += timeout or 0.0
        return self.is_set()


def daemon(tmp_path: Path, monkeypatch, failures: int, cost: float) -> tuple[Daemon, Unreachable]:
    for var in [v for v in os.environ if v.startswith("SCHEDULER_")]:
        monkeypatch.delenv(var)
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "work.py").write_text(
        textwrap.dedent(
            """
            from scheduler import job

            @job(key=1)
            def tidy(ctx):
                pass
            """
        )
    )
    (tmp_path / "config.yaml").write_text("jobs:\n  tidy:\n    interval: 1h\n")
    config = load_config(str(tmp_path / "config.yaml"))
    clock = FakeMonotonic()
    backend = Unreachable(tmp_path / "scheduler.db", clock, failures, cost)
    subject = Daemon(config, load_catalog(config), backend=backend, monotonic=clock)
    subject.stop_requested = Waits(clock)
    return subject, backend


def retries(caplog) -> list[int]:
    return [r.levelno for r in caplog.records if "database unreachable" in r.getMessage()]


def test_an_unreachable_database_is_a_warning_then_an_error_after_a_minute(
    tmp_path, monkeypatch, caplog
):
    subject, backend = daemon(tmp_path, monkeypatch, failures=3, cost=25.0)
    with caplog.at_level(logging.WARNING, logger="scheduler"):
        assert subject.prepare()
    assert backend.tries == 4
    # Under a minute of waiting: warnings; past it, an error an operator's alerting sees.
    assert retries(caplog) == [logging.WARNING, logging.WARNING, logging.ERROR]
    assert "connection refused" in caplog.text


def test_a_stop_while_waiting_for_the_database_ends_the_wait(tmp_path, monkeypatch, caplog):
    subject, backend = daemon(tmp_path, monkeypatch, failures=10**6, cost=1.0)
    original = backend.verify

    def verify_then_stop() -> None:
        subject.stop_requested.set()  # as SIGTERM would, while the database is away
        original()

    backend.verify = verify_then_stop  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="scheduler"):
        assert not subject.prepare()
    assert backend.tries == 1


def name_taken(subject: Daemon, times: int) -> list[float]:
    """track_jobs finds the replica's name in use `times` times; returns when it looked."""
    from scheduler.fleet.housekeeping import NameInUse

    looked: list[float] = []
    original = subject.housekeeping.track_jobs

    def track_jobs() -> None:
        looked.append(subject.monotonic())
        if len(looked) <= times:
            raise NameInUse("instance_name 'r1' is in use by a live replica")
        original()

    subject.housekeeping.track_jobs = track_jobs  # type: ignore[method-assign]
    return looked


def test_a_replica_restarted_at_once_waits_for_its_earlier_session_to_end(
    tmp_path, monkeypatch, caplog
):
    subject, _ = daemon(tmp_path, monkeypatch, failures=0, cost=0.0)
    looked = name_taken(subject, times=5)  # its earlier session ends after about 5 s
    with caplog.at_level(logging.WARNING, logger="scheduler"):
        assert subject.prepare()
    assert len(looked) == 6
    waiting = [r for r in caplog.records if "in use by a live replica" in r.getMessage()]
    assert len(waiting) == 1 and "earlier session" in waiting[0].getMessage()


def test_a_second_live_replica_of_the_same_name_is_refused_after_the_wait(tmp_path, monkeypatch):
    subject, _ = daemon(tmp_path, monkeypatch, failures=0, cost=0.0)
    looked = name_taken(subject, times=10**6)
    with pytest.raises(ConfigError, match="in use by a live replica"):
        subject.prepare()
    patience = 2 * subject.settings.holder_timeout + 5
    assert patience < looked[-1] - looked[0] <= patience + 2
