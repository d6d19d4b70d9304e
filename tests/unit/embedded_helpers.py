"""Replicas of the embedded backend in one process, and what the embedded tests share.

Backends opened in one process stand for replicas on one host, each with its
own flock descriptors on the same files. `exits` collects the status a
replica would have exited with (the keeper ends a process it cannot trust).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import select

from scheduler.backends.base import ClaimRequest, FinishRequest, Intent
from scheduler.backends.embedded import EmbeddedBackend
from scheduler.ledger import tables

NAMESPACE = 4242
KEY = 77
LATER = datetime(2100, 1, 1, tzinfo=UTC)


class Replica(EmbeddedBackend):
    """An embedded backend that records the exit status instead of ending the tests."""

    def __init__(self, database: Path, instance: str, **options: object) -> None:
        self.exits: list[int] = []
        super().__init__(
            database, instance=instance, namespace=NAMESPACE, exit=self.exits.append, **options
        )


def replica(folder: Path, name: str, connect: bool = True, **options: object) -> Replica:
    backend = Replica(folder / "scheduler.db", name, **options)
    backend.migrate()
    if connect:
        backend.connect()
    return backend


@contextlib.contextmanager
def opened(folder: Path) -> Iterator[Callable[..., Replica]]:
    """`make(name, **options)`: a connected replica over `folder`; all closed at the end."""
    made: list[Replica] = []

    def make(name: str, **options: object) -> Replica:
        made.append(replica(folder, name, **options))
        return made[-1]

    try:
        yield make
    finally:
        for backend in made:
            backend.close()
            backend.ledger_engine.dispose()


def tick(seconds_ago: float = 0.0) -> datetime:
    now = datetime.now(UTC).replace(microsecond=0)
    return now - timedelta(seconds=seconds_ago)


def claim(backend: EmbeddedBackend, at: datetime, key: int = KEY, intent: Intent = Intent.RUN):
    request = ClaimRequest(
        key=key, name=f"job{key}", scheduled_at=at, intent=intent, grace_s=30, skip_threshold=3
    )
    (result,) = backend.claim([request], backend.instance, capacity=10).every()
    return result


def finish(backend: EmbeddedBackend, result, unlock: bool = True):
    request = FinishRequest(
        key=result.key,
        scheduled_at=result.scheduled_at,
        run_id=result.run_id,
        status="succeeded",
        error=None,
        unlock=unlock,
        fail_threshold=3,
        next_due=LATER,
    )
    (outcome,) = backend.finish([request])
    return outcome


def statuses(backend: EmbeddedBackend, key: int = KEY) -> dict[datetime, str]:
    with backend.ledger_engine.connect() as conn:
        found = conn.execute(select(tables.ticks).where(tables.ticks.c.job_key == key))
        return {r.scheduled_at: r.status for r in found}


def mode(path: Path) -> int:
    return os.stat(path).st_mode & 0o777


def nobody() -> tuple[int, int]:
    user = pwd.getpwnam("nobody")
    return user.pw_uid, user.pw_gid


# -- a project on disk, and `scheduler` commands run against it --------------------------

JOBS = """
    from scheduler import job

    @job(key=7101)
    def steady(ctx):
        pass
"""


def project(folder: Path, interval: str = "1h") -> Path:
    (folder / "jobs").mkdir(parents=True, exist_ok=True)
    (folder / "jobs" / "work.py").write_text(textwrap.dedent(JOBS))
    (folder / "config.yaml").write_text(f"jobs:\n  steady:\n    interval: {interval}\n")
    return folder / "config.yaml"


def command_env(config: Path, instance: str = "r1") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCHEDULER_")}
    env.update(SCHEDULER_CONFIG=str(config), SCHEDULER_INSTANCE_NAME=instance)
    return env


def scheduler(
    config: Path, *args: str, instance: str = "r1", timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "scheduler", *args],
        cwd=config.parent,
        env=command_env(config, instance),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
