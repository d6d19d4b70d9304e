"""The host lock: the processes of one host that share a file elect one active replica.

Web servers start several worker processes of one application; each may
start a replica. Only one of them per host needs a lock session and
workers: it holds an exclusive `flock` on the host lock's file, the others
try again every `POLL` seconds, with no database session. The kernel drops
a flock the instant its holder exits or dies (SIGKILL, OOM), so a standby
takes over within a second.

A forked child (gunicorn's `preload_app`, multiprocessing) inherits the
holder's descriptor, which would keep the lock held after the holder died:
the child closes its copy at once (`os.register_at_fork`).

Standbys announce themselves beside the lock (a folder `<lock>.standby/`, one
file per standby under a shared flock), so that `status` and the page of the
host's active replica name them; a file nobody holds is a standby gone.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
import tempfile
import threading
import weakref
import zlib
from pathlib import Path

from scheduler.config.settings import Settings
from scheduler.errors import ConfigError

POLL = 0.2  # seconds between a standby's tries: it takes over within a second
FOLDER_MODE = 0o700
FILE_MODE = 0o600


def default_file(settings: Settings, embedded_path: Path) -> Path:
    """A file in the system temporary folder named after the schema and the database.

    The folder is this user's own (`scheduler-<uid>`): another local user can
    neither hold the lock (keeping every replica of the host on standby) nor
    replace the file.
    """
    if settings.database_url is None:
        database, where = "embedded", str(embedded_path)
    else:
        url = settings.database_url.get_secret_value()
        where = re.sub(r"//[^@/]*@", "//", url.split("?", 1)[0])  # no user, no password
        database = where.rsplit("/", 1)[-1] or "postgres"
    name = re.sub(r"[^A-Za-z0-9._-]", "-", database)[:40]
    digest = f"{zlib.crc32(where.encode()):08x}"
    folder = Path(tempfile.gettempdir()) / f"scheduler-{os.getuid()}"
    return folder / f"{settings.schema_name}-{name}-{digest}.lock"


def host_standbys(settings: Settings) -> list[str]:
    """The replicas standing by behind this host's lock for these settings (none: no lock)."""
    from scheduler.backends import embedded_path

    path = settings.host_lock_file(default_file(settings, embedded_path(settings)))
    return [] if path is None else standbys(path)


def standbys(path: Path) -> list[str]:
    """The names announced beside the lock by live standbys; files of gone ones removed."""
    from scheduler.backends import presence  # only here: a replica imports this module light

    folder = _standby_folder(path)
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    return [name for name in names if presence.held(folder / name) is not None]


def _standby_folder(path: Path) -> Path:
    return path.with_name(path.name + ".standby")


class HostLock:
    """An exclusive flock on one file; `try_take` never waits."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._announced: tuple[Path, int, int] | None = None  # this standby's file, its inode
        self._guard = threading.Lock()
        _ALL.add(self)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def try_take(self) -> bool:
        """Take the lock if no other process holds it; a file we cannot use is a ConfigError."""
        with self._guard:
            if self._fd is not None:
                return True
            fd = _open(self.path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                    return False
                raise ConfigError(
                    f"host_lock {self.path}: cannot be locked ({exc.strerror})"
                ) from None
            self._fd = fd
        self.withdraw()  # active now: no longer standing by
        return True

    def release(self) -> None:
        with self._guard:
            fd, self._fd = self._fd, None
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        self.withdraw()

    def announce(self, instance: str) -> None:
        """Say `instance` stands by here, again if its file was removed; never raises."""
        path = _standby_folder(self.path) / instance
        if self._announced is not None:
            _, fd, ino = self._announced
            try:
                if os.stat(path, follow_symlinks=False).st_ino == ino:
                    return
            except OSError:
                pass
            self.withdraw()
        try:
            path.parent.mkdir(mode=FOLDER_MODE, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
        except OSError:
            return  # only `status` misses it
        fcntl.flock(fd, fcntl.LOCK_SH)  # a look by `standbys` holds it for an instant only
        self._announced = (path, fd, os.fstat(fd).st_ino)

    def withdraw(self) -> None:
        announced, self._announced = self._announced, None
        if announced is not None:
            path, fd, ino = announced
            try:
                if os.stat(path, follow_symlinks=False).st_ino == ino:
                    path.unlink()
            except OSError:
                pass
            os.close(fd)

    def _forget_after_fork(self) -> None:
        """In a forked child: close the inherited copy, not unlock (the lock is the parent's)."""
        fd, self._fd = self._fd, None
        announced, self._announced = self._announced, None
        self._guard = threading.Lock()
        for copy in (fd, announced[1] if announced else None):
            if copy is not None:
                os.close(copy)


def _open(path: Path) -> int:
    """The lock file, this user's alone, opened without following a link."""
    folder = path.parent
    if not folder.exists():
        try:
            folder.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"host_lock {path}: cannot make its folder ({exc.strerror})"
            ) from None
    if folder.name == f"scheduler-{os.getuid()}":  # the default folder: ours alone
        found = os.stat(folder, follow_symlinks=False)
        if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid():
            raise ConfigError(
                f"host_lock {path}: the folder {folder} belongs to another user; remove it, or"
                " set host_lock to a file of your own"
            )
        if stat.S_IMODE(found.st_mode) != FOLDER_MODE:
            os.chmod(folder, FOLDER_MODE)
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags, FILE_MODE)
    except OSError as exc:
        raise ConfigError(f"host_lock {path}: cannot be opened ({exc.strerror})") from None


_ALL: weakref.WeakSet[HostLock] = weakref.WeakSet()


def _forget_all_after_fork() -> None:
    for lock in list(_ALL):
        lock._forget_after_fork()


os.register_at_fork(after_in_child=_forget_all_after_fork)
