"""The library API (`scheduler.Replica`) on the embedded backend: start, stop, settings,
errors, and a host it never holds up."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from scheduler import ConfigError, Replica
from scheduler.backends.embedded import EmbeddedBackend
from scheduler.cli.commands import main
from tests.support import wait_for

TICKING = """
from pathlib import Path
from scheduler import job

@job(key=3101)
def tick(ctx):
    with open(Path(__file__).resolve().parent.parent / "ticks.txt", "a") as out:
        out.write(ctx.scheduled_at.isoformat() + "\\n")
"""


def project(folder: Path, monkeypatch: pytest.MonkeyPatch, config: str = "") -> Path:
    """A job ticking every second, writing each tick to ticks.txt; no SCHEDULER_ from outside."""
    for var in [v for v in os.environ if v.startswith("SCHEDULER_")]:
        monkeypatch.delenv(var)
    (folder / "jobs").mkdir()
    (folder / "jobs" / "tick.py").write_text(textwrap.dedent(TICKING))
    (folder / "config.yaml").write_text(config or "jobs:\n  tick:\n    interval: 1s\n")
    return folder / "config.yaml"


def ticks(folder: Path) -> list[str]:
    path = folder / "ticks.txt"
    return path.read_text().split() if path.exists() else []


def test_a_replica_runs_its_jobs_between_start_and_stop(tmp_path, monkeypatch):
    replica = Replica(config=project(tmp_path, monkeypatch), host_lock="off")
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)
    replica.start()
    try:
        assert replica.active and not replica.standby
        wait_for(lambda: len(ticks(tmp_path)) >= 2, 10, "two ticks")
        # No signal handler of its own, and no thread that would keep the host up.
        assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)) == before
        assert all(t.daemon for t in threading.enumerate() if t is not threading.main_thread())
    finally:
        replica.stop()
    assert not replica.active
    seen = len(ticks(tmp_path))
    time.sleep(1.5)
    assert len(ticks(tmp_path)) == seen  # stopped: no tick runs
    replica.stop()  # again: nothing to do
    replica.stop(grace=0)


def test_start_returns_with_the_lock_session_up(tmp_path, monkeypatch):
    """The dispatcher opens the lock session on its own thread, after the start: `start()`
    waits for it, so a probe right after it says ready (not a 503 of a slow connect)."""
    slow = EmbeddedBackend.connect

    def connect(self: EmbeddedBackend) -> None:
        time.sleep(0.5)
        slow(self)

    monkeypatch.setattr(EmbeddedBackend, "connect", connect)
    with Replica(config=project(tmp_path, monkeypatch), host_lock="off") as replica:
        assert replica.daemon is not None and replica.daemon.ready()


def test_with_and_async_with_start_and_stop(tmp_path, monkeypatch):
    config = project(tmp_path, monkeypatch)
    with Replica(config=config, host_lock="off") as replica:
        assert replica.active
    assert not replica.active

    async def lifespan() -> bool:
        async with Replica(config=config, host_lock="off") as hosted:
            return hosted.active

    assert asyncio.run(lifespan())


def test_bad_config_raises_the_line_scheduler_check_prints(tmp_path, monkeypatch, capsys):
    config = project(tmp_path, monkeypatch, "jobs:\n  tick:\n    interval: 0s\n")
    assert main(["check", "--config", str(config)]) == 2
    printed = capsys.readouterr().err.strip()
    with pytest.raises(ConfigError) as raised:
        Replica(config=config).start()
    assert printed == f"scheduler: {raised.value}"
    assert "jobs.tick.interval" in printed


def test_a_misspelled_keyword_is_named_as_the_keyword(tmp_path, monkeypatch):
    config = project(tmp_path, monkeypatch)
    with pytest.raises(
        ConfigError,
        match=r"keyword argument max_worker: unknown setting"
        r" \(did you mean max_workers\?\)",
    ):
        Replica(config=config, max_worker=3).start()


def test_keywords_beat_the_environment_which_beats_config_yaml(tmp_path, monkeypatch):
    config = project(
        tmp_path,
        monkeypatch,
        "scheduler:\n  max_workers: 3\n  skip_alert_after: 4\n  retries: 2\n"
        "jobs:\n  tick:\n    interval: 1h\n",
    )
    monkeypatch.setenv("SCHEDULER_MAX_WORKERS", "5")
    monkeypatch.setenv("SCHEDULER_SKIP_ALERT_AFTER", "6")
    with Replica(config=config, host_lock="off", max_workers=7) as replica:
        assert replica.config is not None
        settings = replica.config.settings
        assert (settings.max_workers, settings.skip_alert_after, settings.retries) == (7, 6, 2)


def test_modules_are_imported_by_name_beside_the_jobs_folder(tmp_path, monkeypatch):
    project(tmp_path, monkeypatch)
    package = tmp_path / "lib" / "appjobs_3102"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "from scheduler import job\n\n@job(key=3102)\ndef report(ctx):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    (tmp_path / "config.yaml").write_text(
        "jobs:\n  tick:\n    interval: 1h\n  report:\n    interval: 1h\n"
    )
    replica = Replica(config=tmp_path / "config.yaml", modules=["appjobs_3102"], host_lock="off")
    with replica:
        assert replica.daemon is not None
        assert {job.name for job in replica.daemon.catalog} == {"tick", "report"}


def test_a_module_the_application_imported_first_still_gives_its_jobs(tmp_path, monkeypatch):
    config = project(tmp_path, monkeypatch, "jobs:\n  early:\n    interval: 1h\n")
    (tmp_path / "jobs" / "tick.py").unlink()
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "early_3103.py").write_text(
        "from scheduler import job\n\n@job(key=3103)\ndef early(ctx):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    __import__("early_3103")  # the application's own import, before the replica's
    with Replica(config=config, modules=["early_3103"], host_lock="off") as replica:
        assert replica.daemon is not None
        assert [job.name for job in replica.daemon.catalog] == ["early"]


def test_a_module_that_does_not_exist_is_a_config_error(tmp_path, monkeypatch):
    config = project(tmp_path, monkeypatch)
    with pytest.raises(ConfigError, match=r"modules: 'no_such_3104': no such module"):
        Replica(config=config, modules=["no_such_3104"]).start()


HOST = """
import logging, sys
from scheduler import Replica

logging.basicConfig(level=logging.INFO)

Replica(config=sys.argv[1], host_lock="off", shutdown_grace=2).start()  # not kept
print("started", flush=True)
"""


def test_the_host_exits_without_stopping_its_replica(tmp_path, monkeypatch):
    """Daemon threads only, and a stop at exit (even of a replica the host let go of): the
    host's interpreter ends at once."""
    config = project(tmp_path, monkeypatch)
    done = subprocess.run(  # a thread keeping the host alive would run into the timeout
        [sys.executable, "-c", HOST, str(config)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "started\n"
    assert "stopped cleanly" in done.stderr  # the stop at exit released every lock


COROUTINE = """
import asyncio, threading
from pathlib import Path
from scheduler import job

@job(key=3105)
async def beat(ctx):
    await asyncio.sleep(0)
    with open(Path(__file__).resolve().parent.parent / "threads.txt", "a") as out:
        out.write(f"{threading.get_ident()}\\n")
"""


def test_coroutine_jobs_run_on_the_loop_of_async_with(tmp_path, monkeypatch):
    config = project(tmp_path, monkeypatch, "jobs:\n  beat:\n    interval: 1s\n")
    (tmp_path / "jobs" / "tick.py").write_text(textwrap.dedent(COROUTINE))
    ran = tmp_path / "threads.txt"

    async def application() -> None:
        async with Replica(config=config, host_lock="off"):
            while not ran.exists():
                await asyncio.sleep(0.05)

    asyncio.run(asyncio.wait_for(application(), 15))
    assert ran.read_text().split()[0] == str(threading.get_ident())  # this loop's thread
    ran.unlink()
    with Replica(config=config, host_lock="off"):  # no loop: each run on one of its own
        wait_for(ran.exists, 10, "a run")
    assert ran.read_text().split()[0] != str(threading.get_ident())


LONG = """
from pathlib import Path
from scheduler import job

@job(key=3106)
def long(ctx):
    folder = Path(__file__).resolve().parent.parent
    (folder / "began").touch()
    told = ctx.lock_lost.wait(20)
    (folder / "ended").write_text("told" if told else "not told")
"""


def test_a_run_past_the_grace_is_told_and_the_host_goes_on(tmp_path, monkeypatch):
    """`scheduler run` ends its process when a run outlives the grace; a host's process is
    not the replica's to end: the run is told its lock is lost, and the host goes on."""
    config = project(tmp_path, monkeypatch, "jobs:\n  long:\n    interval: 1s\n")
    (tmp_path / "jobs" / "tick.py").write_text(textwrap.dedent(LONG))
    replica = Replica(config=config, host_lock="off").start()
    wait_for((tmp_path / "began").exists, 10, "the run to begin")
    replica.stop(grace=0.2)
    assert not replica.active
    wait_for((tmp_path / "ended").exists, 10, "the run to end")
    assert (tmp_path / "ended").read_text() == "told"
    (tmp_path / "began").unlink()
    # Its lock was let go when it returned: a replica started now runs the job.
    with Replica(config=config, host_lock="off", instance_name="after", shutdown_grace=0):
        wait_for((tmp_path / "began").exists, 10, "a run by the next replica")
