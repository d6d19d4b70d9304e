"""The embedded ledger's files on disk: `scheduler.db` and its `-wal` and `-shm`.

They are this user's alone (0600): whoever can open `-shm` can take SQLite's
WAL write lock and stop every replica, and whoever can read the file reads
every job's errors. The database is made here, 0600, before SQLite opens it
(SQLite gives `-wal` and `-shm` the database's mode), and SQLite itself is
never let make it (`mode=rw`): a ledger removed under running replicas must
not come back as a new file beside the old one's `-wal`.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import pwd
import sqlite3
import stat
import struct
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

from scheduler import waits
from scheduler.backends.base import Unavailable
from scheduler.errors import ConfigError

log = logging.getLogger("scheduler.embedded")

JOURNAL_SIZE_LIMIT = 64 * 1024 * 1024  # bytes a reset WAL is truncated to
VACUUM_PAGES = 2000  # free pages given back per look, in one short write
IN_USE_PATIENCE = 10.0  # seconds a start waits for a loose ledger to be let go
COMPANIONS = ("-wal", "-shm")
# SQLite's unix VFS keeps its WAL locks in -shm from byte 120: the write lock first,
# then the checkpointer's, the recoverer's and the readers'; byte 128 ("DMS") is held
# shared by every process that has the database open.
WAL_WRITE_LOCK = 120
SHM_DMS_LOCK = 128


class LedgerFile:
    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def companions(self) -> list[Path]:
        return [self.path.with_name(self.path.name + suffix) for suffix in COMPANIONS]

    def uri(self) -> str:
        """For sqlite3.connect(uri=True): read-write, never created by SQLite."""
        return f"file:{quote(str(self.path))}?mode=rw"

    def create(self) -> None:
        """The database file, 0600, unless it exists (an empty file is an empty ledger)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))

    def empty(self) -> bool:
        """A ledger just made: no table yet."""
        try:
            return os.stat(self.path).st_size == 0
        except OSError:
            return False

    def identity(self) -> tuple[int, int] | None:
        """(device, inode) of the file at the path now; None if there is none."""
        try:
            found = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (found.st_dev, found.st_ino)

    def identities(self) -> dict[Path, tuple[int, int]]:
        """(device, inode) of the companions at their paths now."""
        out = {}
        for path in self.companions:
            with contextlib.suppress(OSError):
                found = os.stat(path)
                out[path] = (found.st_dev, found.st_ino)
        return out

    # -- refusals ------------------------------------------------------------------------

    def refuse_unsafe(self) -> None:
        """At start-up: ledger files that are not this user's, or a ledger this user cannot
        write, end the start (ConfigError). Others' access is mended (`rewrite`)."""
        for path in [self.path, *self.companions]:
            try:
                found = os.stat(path)
            except FileNotFoundError:
                continue
            if found.st_uid != os.geteuid():
                raise ConfigError(
                    f"{path}: it is {_user(found.st_uid)}'s (mode "
                    f"{stat.S_IMODE(found.st_mode):o}), not {_user(os.geteuid())}'s: run the "
                    f"replicas as {_user(found.st_uid)}"
                )
        writable = not os.path.exists(self.path) or os.access(self.path, os.W_OK)
        mode = _mode(self.path)
        if not writable or (mode is not None and not mode & 0o200):
            raise ConfigError(
                f"{self.path}: read-only (mode {mode or 0:o}): a replica writes its ledger; "
                f"chmod 600 {self.path}"
            )
        folder = self.path.parent
        if folder.is_dir() and not os.access(folder, os.W_OK | os.X_OK):
            raise ConfigError(
                f"{folder}: {_user(os.geteuid())} cannot make files in it; SQLite makes "
                f"{self.path.name}-wal and -shm there"
            )

    def refuse_loose(self, loose: list[tuple[Path, int]], pid: int) -> ConfigError:
        """Files others can open, while process `pid` has the ledger open (no copy then)."""
        path, mode = loose[0]
        return ConfigError(
            f"{path}: other users can {'write' if mode & 0o022 else 'read'} it (mode "
            f"{mode:o}), so any of them could read the jobs' history or stop every "
            f"replica, and process {pid} has it open: stop every replica, then start "
            "again (the ledger is then copied into a new file of this user's alone)"
        )

    def loose(self) -> list[tuple[Path, int]]:
        """Ledger files other users may open, with their modes (an older version's)."""
        out = []
        for path in [self.path, *self.companions]:
            mode = _mode(path)
            if mode is not None and mode & 0o077:
                out.append((path, mode))
        return out

    def rewrite(self) -> None:
        """Copy the ledger into a new 0600 file at its path, with no process using it:
        a descriptor another user opened on the old one reads nothing new, and an old
        -shm they could lock is gone (SQLite makes a new one, 0600 like the ledger)."""
        fresh = self.path.with_name(f".{self.path.name}.{os.getpid()}.new")
        fresh.unlink(missing_ok=True)
        os.close(os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        os.chmod(fresh, 0o600)
        with contextlib.closing(sqlite3.connect(self.uri(), uri=True)) as conn:
            conn.execute("VACUUM INTO ?", (str(fresh),))
        old = self.identities()  # the last close may have removed them already
        os.replace(fresh, self.path)
        for path in self.set_aside(old):
            path.unlink(missing_ok=True)  # the copy holds all they held

    def in_use(self) -> int | None:
        """Another process that has the ledger open (its pid), if any."""
        return lock_holder(self.path.with_name(self.path.name + "-shm"), SHM_DMS_LOCK)

    def refuse_unreadable(self) -> None:
        """For the commands: a ledger this user may not open, said in one line."""
        try:
            found = os.stat(self.path)
        except FileNotFoundError:
            return
        except PermissionError:
            raise ConfigError(
                f"{self.path}: {_user(os.geteuid())} may not look into its folder; "
                "run this command as the user who runs the replicas"
            ) from None
        if not os.access(self.path, os.R_OK | os.W_OK):
            raise ConfigError(
                f"{self.path}: it is {_user(found.st_uid)}'s (mode "
                f"{stat.S_IMODE(found.st_mode):o}); run this command as {_user(found.st_uid)}"
            )

    # -- a ledger that was removed ---------------------------------------------------------

    def set_aside(self, companions: dict[Path, tuple[int, int]]) -> list[Path]:
        """Rename these companions (of a database that is gone), if still the same files,
        so that no new database at the path ever reads them as its own."""
        moved = []
        stamp = time.strftime("%Y%m%dT%H%M%S")
        for path, identity in companions.items():
            try:
                found = os.stat(path)
            except OSError:
                continue
            if (found.st_dev, found.st_ino) == identity:
                aside = path.with_name(f"{path.name}.removed-{stamp}")
                with contextlib.suppress(OSError):
                    os.rename(path, aside)
                    moved.append(aside)
        return moved

    def orphans(self) -> list[Path]:
        """Companions with no database beside them: left by a ledger that was removed."""
        if self.path.exists():
            return []
        return [path for path in self.companions if path.exists()]

    def write_lock_holder(self) -> int | None:
        """The process holding SQLite's WAL write lock (another one: ours are not seen)."""
        return lock_holder(self.path.with_name(self.path.name + "-shm"), WAL_WRITE_LOCK)

    # -- start-up and upkeep ---------------------------------------------------------------

    def set_aside_orphans(self) -> None:
        """A -wal or -shm with no ledger beside it belongs to a ledger that was removed:
        SQLite would read it into a new one. Wait while a process still has it open."""
        if not self.orphans():
            return
        pid = self.in_use()
        if pid is not None:
            raise Unavailable(
                f"{self.path} is missing but process {pid} still has the removed ledger "
                "open; waiting for it to end"
            )
        moved = self.set_aside(self.identities())
        log.warning(
            "%s was removed: set its -wal and -shm aside (%s); starting a new ledger",
            self.path,
            ", ".join(map(str, moved)),
        )

    def mend_loose(self, monotonic: Callable[[], float]) -> bool:
        """Ledger files an older version left open to others: copied into a new file
        while no process uses them (True), refused if one keeps them open (ConfigError)."""
        deadline = monotonic() + IN_USE_PATIENCE
        while loose := self.loose():
            pid = self.in_use()
            if pid is None:
                self.rewrite()
                log.warning(
                    "%s: other users could open the ledger (%s): copied it into a new file, "
                    "this user's alone (a descriptor opened on the old one reads nothing new)",
                    self.path,
                    ", ".join(f"{path.name} mode {mode:o}" for path, mode in loose),
                )
                return True
            if monotonic() > deadline:
                raise self.refuse_loose(loose, pid)
            waits.sleep(0.2)  # a replica starting beside this one may be closing it
        return False

    def incremental_vacuum_once(self, busy_timeout: float) -> None:
        """A ledger made before incremental vacuum, rewritten once (call with no replica
        up: the rewrite holds the write lock throughout)."""
        if not self.path.exists():
            return
        try:
            with contextlib.closing(self.raw(busy_timeout)) as conn:
                if conn.execute("PRAGMA page_count").fetchone()[0] == 0:
                    return
                if conn.execute("PRAGMA auto_vacuum").fetchone()[0] != 0:
                    return
                conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
                conn.execute("VACUUM")
        except sqlite3.Error as exc:
            log.warning("could not set the ledger up for incremental vacuum: %s", exc)
            return
        log.info("the ledger now gives pages it no longer needs back to the disk")

    def maintain(self) -> None:
        """Truncate the WAL and give back free pages, each waiting a moment at most: a
        long reader only makes this wait for the next time, and no claim waits for it."""
        try:
            with contextlib.closing(self.raw(timeout=0.1)) as conn:
                if conn.execute("PRAGMA auto_vacuum").fetchone()[0] == 2:
                    # executescript steps it to its end (execute frees a single page)
                    conn.executescript(f"PRAGMA incremental_vacuum({VACUUM_PAGES});")
                # Then the checkpoint, which also shortens the file by what was freed.
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        except sqlite3.Error as exc:
            log.debug("ledger upkeep skipped: %s", exc)

    def raw(self, timeout: float) -> sqlite3.Connection:
        conn = sqlite3.connect(self.uri(), uri=True, timeout=timeout, isolation_level=None)
        conn.execute(f"PRAGMA journal_size_limit={JOURNAL_SIZE_LIMIT}")
        return conn


def lock_holder(path: Path, offset: int) -> int | None:
    """The pid of a process holding a POSIX lock on byte `offset` of `path` (F_GETLK)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        query = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0)
        kind, _, _, _, pid = struct.unpack("hhqqi4x", fcntl.fcntl(fd, fcntl.F_GETLK, query))
    except OSError:
        return None
    finally:
        os.close(fd)
    return None if kind == fcntl.F_UNLCK else pid


def process_state(pid: int) -> str:
    """How a process is (stopped, running, ...), as /proc tells; '' if it cannot tell."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return ""
    return {
        "T": "stopped",
        "t": "stopped by a debugger",
        "D": "waiting for the disk",
        "Z": "a zombie",
        "R": "on a CPU",
        "S": "sleeping",
    }.get(state, state)


def _mode(path: Path) -> int | None:
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return None


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"
