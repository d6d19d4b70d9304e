"""Where a simulated fleet keeps its ledger and locks: a PostgreSQL database of its own, or
an embedded ledger in a folder of its own. Each world gets a fresh one."""

from __future__ import annotations

import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy import Engine, create_engine

from scheduler.backends.embedded import EmbeddedBackend
from scheduler.backends.postgres import PostgresBackend
from tests.simulation.faults import Faulty, install_pg_trigger
from tests.support import with_database

NAMESPACE = 4949
HOLDER_TIMEOUT = 30.0


class PgSite:
    kind = "postgresql"

    def __init__(self, server: str) -> None:
        self.server = server
        self.name = f"scheduler_sim_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(server, autocommit=True) as admin:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.name)))
            # A commit need not wait for its WAL to reach the disk: what is simulated is
            # sessions ending, never the server losing what it acknowledged (a third of a
            # seed's time went to flushes).
            admin.execute(
                sql.SQL("ALTER DATABASE {} SET synchronous_commit = off").format(
                    sql.Identifier(self.name)
                )
            )
        self.url = with_database(server, self.name)
        self.admin = psycopg.connect(self.url, autocommit=True)
        # The world's own session (no ping before each use: a restart disposes of it).
        self.engine: Engine = create_engine(
            self.url.replace("postgresql://", "postgresql+psycopg://", 1)
        )
        self.opened: list[PostgresBackend] = []
        first = self.backend("migrator")
        first.migrate()
        install_pg_trigger(self.admin)

    def backend(self, instance: str) -> PostgresBackend:
        made = PostgresBackend(
            self.url, instance=instance, namespace=NAMESPACE, holder_timeout=HOLDER_TIMEOUT
        )
        self.opened.append(made)
        return made

    def held(self, replicas: list[Faulty]) -> dict[int, set[int]]:
        """Job locks held, by the lock session's backend pid, read from pg_locks."""
        rows = self.admin.execute(
            "SELECT pid, objid::integer FROM pg_locks WHERE locktype = 'advisory'"
            " AND objsubid = 2 AND classid = %s::oid AND mode = 'ExclusiveLock' AND granted",
            (NAMESPACE,),
        ).fetchall()
        by_pid: dict[int, set[int]] = {}
        for pid, key in rows:
            by_pid.setdefault(pid, set()).add(key)
        return {id(r): by_pid.get(r.pid, set()) for r in replicas if r.pid is not None}

    def kill(self, proxy: Faulty) -> bool:
        """End a lock session from the server's side (its locks go at once)."""
        if proxy.pid is None:
            return False
        self.admin.execute("SELECT pg_terminate_backend(%s, 5000)", (proxy.pid,))
        return True

    def restart(self) -> None:
        """Every session of the database ended, as a restart of the server would."""
        others = (
            "FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        self.admin.execute(f"SELECT pg_terminate_backend(pid) {others}")
        for _ in range(500):  # all at once, then until every one has ended (5 s at most)
            if not self.admin.execute(f"SELECT count(*) {others}").fetchone()[0]:  # type: ignore[index]
                break
            time.sleep(0.01)
        self.engine.dispose()

    def close(self) -> None:
        for backend in self.opened:
            backend.close()
            backend.ledger_engine.dispose()
        self.engine.dispose()
        self.admin.close()
        with psycopg.connect(self.server, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(self.name))
            )


class EmbeddedSite:
    kind = "embedded"

    def __init__(self) -> None:
        # In memory where the system has it: the ledger's flushes cost nothing there.
        memory = Path("/dev/shm")
        where = memory if memory.is_dir() else None
        self.folder = Path(tempfile.mkdtemp(prefix="scheduler-sim-", dir=where))
        self.path = self.folder / "scheduler.db"
        self.opened: list[EmbeddedBackend] = []
        observer = self.backend("observer")  # never connected: its engine reads and writes
        observer.migrate()
        self.engine: Engine = observer.ledger_engine

    def backend(self, instance: str) -> EmbeddedBackend:
        made = EmbeddedBackend(
            self.path, instance=instance, namespace=NAMESPACE, keep_every=3600.0, exit=_refuse
        )
        self.opened.append(made)
        return made

    def held(self, replicas: list[Faulty]) -> dict[int, set[int]]:
        return {id(r): set(r._real.locks.held_keys()) for r in replicas}

    def kill(self, proxy: Faulty) -> bool:
        return False  # kernel locks live with the process: the replica meets a lost session

    def restart(self) -> None:
        return None

    def close(self) -> None:
        for backend in self.opened:
            backend.close()
            backend.ledger_engine.dispose()
        shutil.rmtree(self.folder, ignore_errors=True)


def _refuse(code: int) -> Any:
    raise AssertionError(f"the embedded backend asked to end the process ({code})")
