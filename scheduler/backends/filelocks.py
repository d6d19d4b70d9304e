"""Job locks of the embedded backend: an exclusive `flock` on one file per job key.

The kernel releases a flock the instant the process dies, as PostgreSQL
releases a dead session's advisory locks. Shared flocks on presence files
mark the live instances.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import weakref
from pathlib import Path


class FileLocks:
    """Exclusive `flock`s on one file per job key; shared ones mark live instances.

    The folder is this user's alone (0700, files 0600, opened without following
    links): another local user must not be able to take or hold a job's lock.
    A lock is released with LOCK_UN before its descriptor is closed, so a child
    made with `fork` (multiprocessing) that inherited the descriptor cannot keep
    the lock after this process lets it go; forked children also close their
    copies at once.
    """

    def __init__(self, folder: Path, namespace: int) -> None:
        self.folder = folder
        self.namespace = namespace
        self._held: dict[int, int] = {}
        self._presence: int | None = None
        _ALL.add(self)

    def path(self, key: int) -> Path:
        return self.folder / f"{self.namespace}-{key}.lock"

    def make_folder(self) -> None:
        """The lock folders, this user's alone; refuse one that others could write to."""
        for folder in (self.folder, self.folder / "instances"):
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            found = os.stat(folder, follow_symlinks=False)
            if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid():
                raise OSError(f"{folder}: not a folder of this user's; remove it")
            if found.st_mode & 0o022:
                raise OSError(
                    f"{folder}: other users may write to it (mode {found.st_mode & 0o777:o}): "
                    "any of them could hold a job's lock; remove it or chmod 700 it"
                )

    def try_lock(self, key: int) -> bool:
        if key in self._held:
            return False  # never stack: the gate asks only for keys it does not run
        fd = _open(self.path(key))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._held[key] = fd
        return True

    def unlock(self, key: int) -> None:
        fd = self._held.pop(key, None)
        if fd is not None:
            _release(fd)

    def held(self) -> set[int]:
        """The job keys locked here now."""
        return set(self._held)

    def is_free(self, key: int) -> bool:
        """Probe without keeping the lock (status, and the crash sweep)."""
        if key in self._held:
            return False
        try:
            fd = _open(self.path(key), create=False)
        except FileNotFoundError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        finally:
            os.close(fd)
        return True

    def join(self, instance: str) -> None:
        """Hold a shared lock on our presence file while we are up.

        A sweep of dead instances may unlink the file between our open and our
        flock; then we would hold a lock on a file nobody can see. So after the
        flock, check that the path is still our file, and start over if not.
        """
        path = self.folder / "instances" / f"{instance}.lock"
        while True:
            fd = _open(path)
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                same = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self._presence = fd
                return
            _release(fd)

    def release_all(self) -> None:
        for key in list(self._held):
            self.unlock(key)
        if self._presence is not None:
            _release(self._presence)
            self._presence = None

    def live_instances(self) -> list[str]:
        folder = self.folder / "instances"
        live = []
        for path in sorted(folder.glob("*.lock")) if folder.is_dir() else []:
            try:
                fd = _open(path, create=False)
            except OSError:  # gone meanwhile, a dangling link, not ours
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                live.append(path.stem)
            else:
                path.unlink(missing_ok=True)  # under our exclusive lock: nobody holds it
            finally:
                os.close(fd)
        return live

    def _forget_after_fork(self) -> None:
        """In a forked child: these descriptors are the parent's, not ours."""
        for fd in [*self._held.values(), *([self._presence] if self._presence else [])]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._held.clear()
        self._presence = None


_ALL: weakref.WeakSet[FileLocks] = weakref.WeakSet()


def _forget_all_after_fork() -> None:
    for locks in list(_ALL):
        locks._forget_after_fork()


os.register_at_fork(after_in_child=_forget_all_after_fork)


def _open(path: Path, create: bool = True) -> int:
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    return os.open(path, flags, 0o600)


def _release(fd: int) -> None:
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)  # also for a forked child's copy of the descriptor
    os.close(fd)
