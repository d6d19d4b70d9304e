"""Throwaway PostgreSQL clusters of the tests' own, built from the server binaries.

A test that restarts, stops or fails over a database must not do it to the
server the other tests share (they run in parallel). It builds its own
cluster here: `initdb` into a temporary folder, on a free port, trust auth,
run as the `postgres` user when the tests run as root (initdb refuses root).
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.support import free_port


def server_binaries() -> Path | None:
    """The folder of initdb and pg_ctl (Debian keeps them out of PATH)."""
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).parent
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
    return candidates[-1].parent if candidates else None


def _owner() -> str | None:
    """Who runs the cluster: this user, or `postgres` when this is root."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        return None
    return "postgres"


def available() -> str | None:
    """None if a cluster can be made here, else why not."""
    if server_binaries() is None:
        return "the PostgreSQL server binaries are not installed"
    if os.geteuid() == 0 and _owner() is None:
        return "running as root with no `postgres` user to run a cluster as"
    return None


class Cluster:
    """One cluster: `url(db)`, `start()`, `stop()`, `restart()`, `remove()`."""

    def __init__(self, name: str = "cluster") -> None:
        self.bin = server_binaries()
        assert self.bin is not None, available()
        self.owner = _owner()
        self.base = Path(tempfile.mkdtemp(prefix=f"scheduler-{name}-"))
        self.data = self.base / "data"
        self.port = free_port()
        if self.owner:
            uid, gid = pwd.getpwnam(self.owner).pw_uid, pwd.getpwnam(self.owner).pw_gid
            os.chown(self.base, uid, gid)
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8")
        with open(self.data / "postgresql.conf", "a") as conf:
            conf.write(
                f"port = {self.port}\nlisten_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{self.base}'\nfsync = off\n"
                "max_connections = 50\nshared_buffers = 16MB\n"
            )

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.base / "log"), "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def restart(self, mode: str = "fast") -> None:
        self._run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-l",
            str(self.base / "log"),
            "-m",
            mode,
            "-w",
            "restart",
        )

    def remove(self) -> None:
        subprocess.run(
            [str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop"],
            capture_output=True,
            user=self.owner,
        )
        shutil.rmtree(self.base, ignore_errors=True)

    def _run(self, tool: str, *args: str) -> None:
        assert self.bin is not None
        subprocess.run(
            [str(self.bin / tool), *args],
            check=True,
            capture_output=True,
            timeout=120,
            user=self.owner,
            cwd=self.base,
        )
