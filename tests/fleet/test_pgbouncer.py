"""Behind PgBouncer: session mode works; transaction mode is refused by `check` and `run`
(docs/operating.md: Deployment notes)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.fleet.tools import require
from tests.support import Fleet, cli, free_port, host_port, wait_for

pytestmark = pytest.mark.fleet

JOBS = ["operations.py"]  # every_second (1 ms), always_fails (raises "disk full")


@contextmanager
def pgbouncer(mode: str, database_url: str) -> Iterator[str]:
    """Debian's pgbouncer in front of the test database; yields its URL."""
    binary = require("pgbouncer", "pgbouncer")
    host, port = host_port(database_url)
    listen = free_port()
    # Outside pytest's private tmp_path: as root, pgbouncer runs as nobody.
    folder = Path(tempfile.mkdtemp(prefix=f"pgbouncer-{mode}-"))
    folder.chmod(0o777)
    ini = folder / "pgbouncer.ini"
    ini.write_text(
        f"[databases]\n* = host={host} port={port} user=postgres\n"
        f"[pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {listen}\n"
        f"auth_type = any\npool_mode = {mode}\nunix_socket_dir =\n"
        f"logfile = {folder}/pgbouncer.log\npidfile = {folder}/pgbouncer.pid\n"
    )
    command = [binary, *(["-u", "nobody"] if os.geteuid() == 0 else []), str(ini)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    log = folder / "pgbouncer.log"
    try:
        wait_for(lambda: log.exists() and "listening on" in log.read_text(), 15, "pgbouncer")
        yield f"postgresql://postgres@127.0.0.1:{listen}/{database_url.rsplit('/', 1)[1]}"
    finally:
        process.terminate()
        process.wait(10)
        shutil.rmtree(folder, ignore_errors=True)


def test_pgbouncer_in_transaction_mode_is_refused(tmp_path, database_url):
    with pgbouncer("transaction", database_url) as url:
        fleet = Fleet(tmp_path, url, {"every_second": {"interval": "1s"}}, job_files=JOBS)
        check = cli(fleet, "check")
        assert check.returncode == 2, check.stdout + check.stderr
        assert "PgBouncer" in check.stdout and "pool_mode = session" in check.stdout
        replica = fleet.start("r1")
        try:
            assert replica.wait(60) == 2, replica.log()
        finally:
            fleet.kill_all()
        assert "PgBouncer" in replica.log() and "session" in replica.log()
        assert "Traceback" not in replica.log()
        assert not fleet.evidence()


def test_pgbouncer_in_session_mode_works(tmp_path, database_url):
    with pgbouncer("session", database_url) as url:
        fleet = Fleet(tmp_path, url, {"every_second": {"interval": "1s"}}, job_files=JOBS)
        check = cli(fleet, "check")
        assert check.returncode == 0, check.stdout + check.stderr
        fleet.start("r1")
        try:
            fleet.wait_ready()
            wait_for(lambda: len(fleet.evidence()) >= 2, 30, "runs through PgBouncer")
            assert fleet.stop() == {"r1": 0}
        finally:
            fleet.kill_all()
