"""The embedded ledger on a shared host: its files this user's alone, a writer frozen in a
transaction named, a ledger removed under running replicas, readers that never wait, a WAL
that shrinks again, and what no retry mends refused at start-up."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import pytest

from scheduler.backends import ledger_file
from scheduler.backends.base import Outcome, Unavailable
from scheduler.backends.embedded import LedgerBusy
from scheduler.backends.embedded_keeper import EXIT_RESTART
from scheduler.backends.ledger_file import JOURNAL_SIZE_LIMIT
from scheduler.config.settings import load_config
from scheduler.errors import ConfigError
from scheduler.fleet.status import fleet_status, history
from scheduler.ledger.history import TickFilter
from scheduler.registry.catalog import load_catalog
from tests.unit.embedded_helpers import (
    Replica,
    claim,
    finish,
    mode,
    opened,
    project,
    replica,
    scheduler,
    statuses,
    tick,
)


@pytest.fixture
def replicas(tmp_path):
    with opened(tmp_path) as make:
        yield make


def ledger_files(folder) -> list:
    return [folder / name for name in ("scheduler.db", "scheduler.db-wal", "scheduler.db-shm")]


# -- 2. the ledger's files ---------------------------------------------------------------


def test_the_ledger_files_are_this_users_alone(tmp_path, replicas):
    old = os.umask(0)  # the most permissive umask: the modes must not depend on it
    try:
        a = replicas("a")
        assert claim(a, tick()).outcome is Outcome.RUN
    finally:
        os.umask(old)
    assert [mode(path) for path in ledger_files(tmp_path)] == [0o600, 0o600, 0o600]


HOLD = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("SELECT count(*) FROM scheduler_ticks").fetchall()
print("open", flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def held_open(database):
    """Another process (an older replica, say) with the ledger open."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(database)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        yield holder
    finally:
        holder.kill()
        holder.communicate(timeout=10)  # waits, and closes the pipes


@pytest.mark.parametrize("name", ["scheduler.db", "scheduler.db-wal", "scheduler.db-shm"])
def test_ledger_files_others_can_read_are_refused_while_in_use(
    tmp_path, replicas, name, monkeypatch
):
    monkeypatch.setattr(ledger_file, "IN_USE_PATIENCE", 0.5)
    a = replicas("a")
    claim(a, tick())
    a.close()
    with held_open(tmp_path / "scheduler.db") as holder:
        (tmp_path / name).chmod(0o644)
        b = Replica(tmp_path / "scheduler.db", "b")
        said = rf"{name}: other users can read it \(mode 644\).*process {holder.pid} has it open"
        with pytest.raises(ConfigError, match=said):
            b.verify()


def test_a_ledger_others_could_open_is_copied_into_a_new_file_of_this_users(tmp_path, replicas):
    """As an older version left it: 0644, and another user opened it back then."""
    a = replicas("a")
    ran = claim(a, tick())
    a.close()
    a.ledger_engine.dispose()
    database = tmp_path / "scheduler.db"
    database.chmod(0o644)
    theirs = os.open(database, os.O_RDONLY)
    try:
        b = Replica(database, "b")  # as a replica starts: verify, migrate, connect
        b.verify()
        b.migrate()
        b.connect()
        assert os.fstat(theirs).st_ino != database.stat().st_ino  # they read nothing new
        assert statuses(b)[ran.scheduled_at] == "running"  # nothing lost
        finish(b, claim(b, tick(-1)))
        assert [mode(path) for path in ledger_files(tmp_path)] == [0o600, 0o600, 0o600]
        b.close()
        b.ledger_engine.dispose()
    finally:
        os.close(theirs)


@pytest.mark.parametrize(
    ("chmod", "said", "holder"),
    [
        (0o644, r"scheduler.db: other users can read it \(mode 644\)", True),
        (0o400, r"scheduler.db: read-only \(mode 400\)", False),
    ],
)
def test_a_replica_refuses_to_start_on_such_a_ledger_with_one_line(tmp_path, chmod, said, holder):
    config = project(tmp_path)
    with contextlib.ExitStack() as stack:
        a = replica(tmp_path, "a", connect=False)  # a ledger, with its tables
        a.ledger_engine.dispose()
        if holder:
            stack.enter_context(held_open(tmp_path / "scheduler.db"))
        (tmp_path / "scheduler.db").chmod(chmod)
        done = scheduler(config, "run", timeout=60)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("scheduler: ")]
    assert len(lines) == 1 and "Traceback" not in done.stderr
    assert re.search(said, lines[0]), lines[0]


# -- 4. a writer frozen inside a ledger transaction ----------------------------------------

FREEZE = """
import os, signal, sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
conn.execute("UPDATE scheduler_counters SET value = value")
print("writing", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""


def test_a_writer_frozen_in_a_ledger_transaction_is_named_by_the_others(tmp_path, replicas):
    a = replicas("a", busy_timeout=1)
    writer = subprocess.Popen(
        [sys.executable, "-c", FREEZE, str(tmp_path / "scheduler.db")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "writing"
        with pytest.raises(LedgerBusy, match=rf"held by process {writer.pid}, stopped"):
            claim(a, tick())
        assert any(f"process {writer.pid}, stopped" in note for note in a.notes())
    finally:
        writer.send_signal(signal.SIGCONT)
        writer.kill()
        writer.communicate(timeout=10)  # waits, and closes the pipe
    assert claim(a, tick()).outcome is Outcome.RUN  # the fleet goes on once it has ended


# -- 6. the ledger removed under running replicas -----------------------------------------


def test_a_ledger_removed_under_a_replica_ends_it_and_no_new_ledger_reads_its_wal(
    tmp_path, replicas
):
    a = replicas("a")
    ran = claim(a, tick(5))
    assert a.keep_once()  # sees its -wal and -shm
    (tmp_path / "scheduler.db").unlink()

    assert not a.keep_once()
    assert a.exits == [EXIT_RESTART] and "the ledger was removed" in (a.broken or "")
    assert not (tmp_path / "scheduler.db-wal").exists()  # set aside, not left for a new one
    assert list(tmp_path.glob("scheduler.db-wal.removed-*"))

    b = replicas("b")  # its supervisor starts it again: one new ledger for every replica
    assert statuses(b) == {}
    assert claim(b, ran.scheduled_at).outcome is Outcome.SKIPPED  # a's run still holds the job


ORPHAN = """
import os, sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("PRAGMA journal_mode=WAL")
conn.execute("PRAGMA wal_autocheckpoint=0")
conn.execute("CREATE TABLE old_ledger (x)")
conn.execute("INSERT INTO old_ledger VALUES (1)")
print("open", flush=True)
if sys.argv[2] == "die":
    os._exit(0)  # killed: no checkpoint, the -wal and -shm stay
sys.stdin.read()
"""


def test_a_removed_ledgers_wal_is_set_aside_before_a_new_ledger_is_made(tmp_path):
    database = tmp_path / "scheduler.db"
    subprocess.run([sys.executable, "-c", ORPHAN, str(database), "die"], check=True)
    database.unlink()
    assert (tmp_path / "scheduler.db-wal").stat().st_size > 0
    a = replica(tmp_path, "a", connect=False)
    with sqlite3.connect(database) as conn:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
    assert "old_ledger" not in tables and "scheduler_ticks" in tables
    assert list(tmp_path.glob("scheduler.db-wal.removed-*"))
    a.ledger_engine.dispose()


def test_a_new_ledger_waits_while_a_process_still_has_the_removed_one_open(tmp_path):
    database = tmp_path / "scheduler.db"
    holder = subprocess.Popen(
        [sys.executable, "-c", ORPHAN, str(database), "stay"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        database.unlink()
        with pytest.raises(Unavailable, match=rf"process {holder.pid} still has the removed"):
            Replica(database, "a").migrate()
        assert not database.exists()
    finally:
        holder.kill()
        holder.communicate(timeout=10)  # waits, and closes the pipes


# -- 8. the smaller ones --------------------------------------------------------------------


def test_a_second_replica_of_a_live_name_is_refused_at_once(tmp_path, replicas):
    replicas("r1")
    second = Replica(tmp_path / "scheduler.db", "r1")
    with pytest.raises(ConfigError, match=rf"'r1' is in use by a live replica \(pid {os.getpid()}"):
        second.verify()


def test_status_and_history_do_not_wait_for_a_writer(tmp_path, replicas):
    config = project(tmp_path)
    a = replicas("a")
    finish(a, claim(a, tick()))
    writer = sqlite3.connect(tmp_path / "scheduler.db", isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")  # a writer holds the write lock
    found: dict[str, object] = {}

    def read() -> None:
        reader = Replica(tmp_path / "scheduler.db", "cli")
        reader.migrate()
        catalog = load_catalog(load_config(str(config)))
        found["history"] = history(reader, TickFilter(limit=5))
        found["status"] = fleet_status(reader, catalog, tick())
        reader.ledger_engine.dispose()

    started = time.monotonic()
    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(10)
    writer.execute("ROLLBACK")
    writer.close()
    assert "status" in found, "status waited for the writer"
    assert time.monotonic() - started < 10
    assert len(found["history"]) == 1  # type: ignore[arg-type]


def test_the_wal_shrinks_again_after_a_long_reader(tmp_path, replicas):
    a = replicas("a")
    wal = tmp_path / "scheduler.db-wal"
    with a.ledger_engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_size_limit").scalar() == JOURNAL_SIZE_LIMIT
    reader = sqlite3.connect(tmp_path / "scheduler.db", isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM scheduler_ticks").fetchall()  # holds its snapshot
    with a.ledger_engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE pad (x)")
    for _ in range(40):
        with a.ledger_engine.begin() as conn:
            conn.exec_driver_sql("INSERT INTO pad SELECT randomblob(100000)")
    grown = wal.stat().st_size
    assert grown > 3_000_000
    reader.execute("ROLLBACK")
    reader.close()
    with a.ledger_engine.begin() as conn:
        conn.exec_driver_sql("DELETE FROM pad")

    def pages() -> int:
        with a.ledger_engine.connect() as conn:
            return int(conn.exec_driver_sql("PRAGMA page_count").scalar() or 0)

    before = pages()
    a.maintain()
    assert wal.stat().st_size < grown / 10
    assert pages() < before - 500  # the 40 rows' pages went back to the disk
