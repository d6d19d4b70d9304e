"""A replica waiting for its database at start-up: it retries and says so, louder with time."""

from __future__ import annotations

import logging
import os
import textwrap
import threading
from pathlib import Path

from scheduler.backends.base import Unavailable
from scheduler.backends.embedded import EmbeddedBackend
from scheduler.catalog import load_catalog
from scheduler.config import load_config
from scheduler.daemon import Daemon
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
