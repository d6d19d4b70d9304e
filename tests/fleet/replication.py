"""A primary and a streaming standby of the tests' own, built from the server binaries.

What a failover test needs and the shared server must never suffer: a primary
that is stopped hard (`pg_ctl stop -m immediate`) and a standby promoted in
its place. The primary is a `tests.clusters.Cluster`; the standby is a copy
of it made by `pg_basebackup -R`, on a port of its own. With `synchronous`,
the primary waits for the standby to flush every commit before it reports
it (`synchronous_standby_names = '*'`, `synchronous_commit = on`); without,
the standby follows as fast as it can and the last commits may never reach it.
"""

from __future__ import annotations

import os
import pwd
import tempfile
import time
from pathlib import Path

import psycopg

from tests.clusters import Cluster, server_binaries
from tests.support import Proxy, free_port


def _tools() -> Path:
    """The real folder of pg_ctl: pg_basebackup sits beside it, not beside a link to it."""
    found = server_binaries()
    assert found is not None
    return (found / "pg_ctl").resolve().parent


class Standby(Cluster):
    """A streaming standby of `primary`: `pg_basebackup -R`, then its own port and socket.

    `link`: the port the standby streams from, when not the primary's own (a
    proxy that can hold the WAL back, as a slow or congested network does).
    """

    def __init__(self, primary: Cluster, name: str = "standby", link: int | None = None) -> None:
        self.bin = _tools()
        self.owner = primary.owner
        self.base = Path(tempfile.mkdtemp(prefix=f"scheduler-{name}-"))
        self.data = self.base / "data"
        self.port = free_port()
        if self.owner:
            entry = pwd.getpwnam(self.owner)
            os.chown(self.base, entry.pw_uid, entry.pw_gid)
        self._run(
            "pg_basebackup",
            *("-D", str(self.data), "-h", "127.0.0.1", "-p", str(primary.port)),
            *("-U", "postgres", "-R", "-X", "stream", "-c", "fast"),
        )
        with open(self.data / "postgresql.conf", "a") as conf:
            conf.write(
                f"port = {self.port}\nunix_socket_directories = '{self.base}'\n"
                f"cluster_name = '{name}'\n"
            )
        if link is not None:  # after -R's own line in postgresql.auto.conf: the last one counts
            with open(self.data / "postgresql.auto.conf", "a") as conf:
                conf.write(
                    f"primary_conninfo = 'host=127.0.0.1 port={link} user=postgres "
                    f"application_name={name}'\n"
                )

    def promote(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-w", "promote")


class Pair:
    """A primary and its standby, both running; `remove()` stops both whatever happened."""

    def __init__(self, synchronous: bool) -> None:
        self.synchronous = synchronous
        self.primary = Cluster("primary")
        self.standby: Standby | None = None
        self.link: Proxy | None = None  # the WAL's way from the primary to the standby
        try:
            self.primary.start()
            self.link = Proxy("127.0.0.1", self.primary.port)
            self.standby = Standby(self.primary, link=self.link.port)
            if synchronous:
                # Set after the base backup: the standby, once promoted, must not
                # wait for a standby of its own that does not exist.
                with open(self.primary.data / "postgresql.conf", "a") as conf:
                    conf.write("synchronous_standby_names = '*'\nsynchronous_commit = on\n")
                self.primary._run("pg_ctl", "-D", str(self.primary.data), "reload")
            self.standby.start()
            self.wait_streaming()
        except BaseException:
            self.remove()
            raise

    def url(self, database: str = "postgres") -> str:
        """Both nodes in one multi-host URL: whichever is writable is the one used."""
        assert self.standby is not None
        return (
            f"postgresql://postgres@127.0.0.1:{self.primary.port},127.0.0.1:{self.standby.port}"
            f"/{database}?target_session_attrs=read-write"
        )

    def standby_url(self, database: str = "postgres") -> str:
        """The standby alone (after the failover: the new primary alone)."""
        assert self.standby is not None
        return self.standby.url(database)

    def wait_streaming(self, timeout: float = 60) -> None:
        """The standby streams from the primary (and, if synchronous, is its sync standby)."""
        wanted = "sync" if self.synchronous else "async"
        deadline = time.monotonic() + timeout
        with psycopg.connect(self.primary.url(), autocommit=True) as conn:
            while True:
                rows = conn.execute("SELECT sync_state FROM pg_stat_replication").fetchall()
                if any(state == wanted for (state,) in rows):
                    return
                if time.monotonic() > deadline:
                    raise AssertionError(f"the standby is not streaming ({wanted}): {rows}")
                time.sleep(0.1)

    def replay_lag(self) -> tuple[int, float]:
        """How far the standby is behind: WAL bytes not yet replayed, and replay_lag in seconds."""
        with psycopg.connect(self.primary.url(), autocommit=True) as conn:
            row = conn.execute(
                "SELECT coalesce(max(pg_current_wal_lsn() - replay_lsn), 0)::bigint,"
                " coalesce(extract(epoch FROM max(replay_lag)), 0)::float8"
                " FROM pg_stat_replication"
            ).fetchone()
        assert row is not None
        return int(row[0]), float(row[1])

    def hold_wal(self) -> None:
        """From now on the WAL does not reach the standby (the primary does not wait for it)."""
        assert self.link is not None
        self.link.cut()

    def fail_over(self, detection_s: float = 0.0) -> None:
        """The primary dies at once (no checkpoint, no goodbye); the standby is promoted.

        `detection_s`: how long no node takes writes in between, as while a
        failover manager decides (Patroni, pg_auto_failover take seconds).
        """
        assert self.standby is not None
        self.primary.stop("immediate")
        time.sleep(detection_s)
        self.standby.promote()

    def remove(self) -> None:
        if self.link is not None:
            self.link.close()
        for node in (self.standby, self.primary):
            if node is not None:
                node.remove()  # never raises: a stop that fails leaves nothing to stop
