"""Job locks of the embedded backend: an exclusive `flock` on one file per job key.

The kernel releases a flock the instant the process dies, as PostgreSQL
releases a dead session's advisory locks. Shared flocks on presence files
mark the live instances.

A flock belongs to a file, not to a path: a file removed under its holder
(a temp cleaner, `rm -rf`) keeps the holder's lock while a new file at the
same path can be locked by anyone. So:

- a lock is taken on the file that is at its path (its inode checked after
  the `flock`), and the keeper (`keep`, twice a second) takes a held lock
  back on whatever file is at the path now, or reports it lost;
- the process that takes a lock writes who it is into the file (`stamp`);
- a lock proves a job's earlier run is over only if that run's holder is
  gone (`proves_over`): the file names a process that has died, or the file
  has been at its path longer than any live holder needs to take it back.
  A job that closes descriptors it did not open releases its replica's
  flock, but the file still names a live process, so nobody else starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import stat
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from scheduler import waits
from scheduler.backends import lock_holders as holders
from scheduler.backends import presence
from scheduler.backends.lock_holders import Holder

# A lock file younger than this may have replaced, at its path, one a live run still
# holds: that run's keeper takes the new file within KEEP_EVERY, far sooner.
SETTLE_S = 5.0
KEEP_EVERY = 0.5  # seconds between the keeper's looks (EmbeddedBackend runs it)
RETAKE_TRIES = 10  # a claim elsewhere may hold the new file for a moment: try again
RETAKE_PAUSE = 0.02
STAMP_MAX = 4096  # bytes of a lock or presence file read back


@dataclass
class _Held:
    fd: int
    dev: int
    ino: int
    prior: Holder | None = None  # who the file named when we took it
    age: float = 0.0  # how long the file had been at its path then


@dataclass
class Kept:
    """What one look of the keeper found and did."""

    broken: list[str] = field(default_factory=list)  # descriptors closed under us
    remade_folder: bool = False
    retaken: list[int] = field(default_factory=list)  # keys taken back on a new file
    lost: list[int] = field(default_factory=list)  # keys whose new file another holds
    rejoined: bool = False  # the presence file was made again
    failed: str | None = None  # the folder cannot be made again (why)

    @property
    def news(self) -> bool:
        return bool(self.remade_folder or self.retaken or self.lost or self.rejoined)


class FileLocks:
    """Exclusive `flock`s on one file per job key; shared ones mark live instances.

    The folder is this user's alone (0700, files 0600, opened without following
    links): another local user must not be able to take or hold a job's lock.
    Files left by an older version with looser modes are replaced, which also
    takes their power from descriptors others opened before. A lock is
    released with LOCK_UN before its descriptor is closed, so a child made
    with `fork` (multiprocessing) that inherited the descriptor cannot keep
    the lock after this process lets it go; forked children also close their
    copies at once.
    """

    def __init__(
        self,
        folder: Path,
        namespace: int,
        instance: str = "",
        *,
        wall: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.folder = folder
        self.namespace = namespace
        self.instance = instance
        self.wall = wall
        self.monotonic = monotonic
        self._guard = threading.RLock()  # the dispatcher and the keeper
        self._held: dict[int, _Held] = {}
        self._presence: _Held | None = None
        self._token = ""
        self._note = ""  # what the presence file says happened (status shows it)
        self._since = 0.0  # when the session began (wall clock, for `status`)
        self._first_seen: dict[tuple[int, int, int], float] = {}
        self._folder_remade = False  # a file was opened after the folder vanished
        _ALL.add(self)

    def path(self, key: int) -> Path:
        return self.folder / f"{self.namespace}-{key}.lock"

    @property
    def presence_path(self) -> Path:
        return self.folder / "instances" / f"{self.instance}.lock"

    # -- the folder ---------------------------------------------------------------------

    def make_folder(self) -> list[str]:
        """The lock folders, this user's alone; returns what had to be repaired."""
        return make_folders(self.folder)

    def folder_present(self) -> bool:
        return os.path.isdir(self.folder)

    # -- job locks ----------------------------------------------------------------------

    def try_lock(self, key: int) -> bool:
        """The job's flock, on the file that is at its path now (made, with its folder,
        if missing). Who the file named before is kept for `proves_over`."""
        with self._guard:
            if key in self._held:
                return False  # never stack: the gate asks only for keys it does not run
            held = self._take(self.path(key))
            if held is None:
                return False
            self._held[key] = held
            return True

    def stamp(self, key: int) -> None:
        """Write who holds the lock into its file (after the claim decided to keep it)."""
        with self._guard:
            held = self._held.get(key)
            if held is not None:
                _write(held.fd, self._holder().encode())

    def proves_over(self, key: int, runs_of: Iterable[str]) -> bool:
        """Whether the lock just taken proves that the job's runs on `runs_of` (instances
        whose ledger rows say the job runs there) are over: the file names the process
        of such a run and it has died, or else the file has settled at its path."""
        holders = set(runs_of)
        held = self._held.get(key)
        if held is None:
            return False
        if not holders:
            return True
        if held.prior is not None and held.prior.instance in holders:
            return held.prior.released or not held.prior.alive()
        return held.age >= SETTLE_S

    def unlock(self, key: int) -> None:
        """Let the lock go, the file still naming its holder: a run under it may go on."""
        with self._guard:
            held = self._held.pop(key, None)
            if held is not None:
                _release(held.fd)

    def give_back(self, key: int) -> None:
        """Let the lock go saying so in its file: nothing of the job runs here, so a row
        that names this replica as running the job is over (`proves_over`). Every path
        that lets a lock go on purpose comes here; `unlock` says nothing (a lock taken but not
        kept, or let go at shutdown with runs still going)."""
        with self._guard:
            held = self._held.get(key)
            if held is None:
                return
            with contextlib.suppress(OSError):  # unsaid, the lock only proves less
                _write(held.fd, self._holder().encode(released=True))
            self.unlock(key)

    def vacant(self, key: int, runs_of: Iterable[str]) -> bool:
        """Probe for the crash sweep (inside its write transaction): the lock is free and
        proves those runs over. A missing file is made, so that it can settle."""
        with self._guard:
            if key in self._held:
                return False
            if not self.try_lock(key):
                return False
            try:
                return self.proves_over(key, runs_of)
            finally:
                self.unlock(key)

    def held_now(self, keys: Iterable[int]) -> set[int] | None:
        """Which of these jobs' lock files someone holds, read from /proc/locks without
        taking any lock (a probe that took one could make a claim elsewhere fail).
        None where /proc/locks cannot tell (no such file, or it names other devices)."""
        try:
            fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            return set()
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a lock we know of, to find
            locked = _flocked()
            folder = os.fstat(fd)
        except OSError:
            return None
        finally:
            _release(fd)
        if locked is None or (folder.st_dev, folder.st_ino) not in locked:
            return None
        held = set()
        for key in keys:
            try:
                found = os.stat(self.path(key), follow_symlinks=False)
            except OSError:
                continue
            if (found.st_dev, found.st_ino) in locked:
                held.add(key)
        return held

    def free_now(self, key: int) -> bool:
        """A plain probe (where /proc/locks cannot tell): nobody holds the file at its path."""
        with self._guard:
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

    @contextlib.contextmanager
    def alone(self, name: str) -> Iterator[None]:
        """An exclusive flock on a file of the folder (made first), for a step no two
        processes may take at once (mending the ledger at start-up)."""
        fd = self._open(self.folder / f".{name}")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            _release(fd)

    def held_keys(self) -> set[int]:
        with self._guard:
            return set(self._held)

    # -- presence -----------------------------------------------------------------------

    def join(self, instance: str | None = None) -> None:
        """Hold a shared lock on our presence file while we are up; a session begins."""
        with self._guard:
            if instance is not None:
                self.instance = instance
            self._token = secrets.token_hex(8)
            self._since = self.wall()
            holders.open_session(self._token)
            self._presence = self._join()

    def _join(self) -> _Held:
        """A sweep of dead instances may unlink the file between our open and our flock;
        then we would hold a lock on a file nobody can see. So after the flock, check
        that the path is still our file, and start over if not."""
        path = self.presence_path
        while True:
            fd = self._open(path)
            fcntl.flock(fd, fcntl.LOCK_SH)
            found = _same(path, fd)
            if found is not None:
                _write(fd, self._presence_text())
                return _Held(fd, found.st_dev, found.st_ino)
            _release(fd)

    def note(self, text: str) -> None:
        """What `status` shows beside this instance (what the keeper had to mend)."""
        with self._guard:
            self._note = text
            if self._presence is not None:
                with contextlib.suppress(OSError):
                    _write(self._presence.fd, self._presence_text())

    def _presence_text(self) -> bytes:
        return self._holder().encode(since=self._since, note=self._note)

    def _holder(self) -> Holder:
        return holders.me(self.instance, self._token)

    def release_all(self) -> None:
        with self._guard:
            for key in list(self._held):
                self.unlock(key)
            if self._presence is not None:
                _release(self._presence.fd)
                self._presence = None
            holders.close_session(self._token)

    # -- the keeper ---------------------------------------------------------------------

    def presence_intact(self) -> bool:
        """The presence descriptor is still ours: a cheap sign, before each ledger statement,
        that no job has closed this process's descriptors (whose numbers SQLite would
        otherwise go on writing to, whatever they name now)."""
        presence = self._presence
        return presence is None or _still(presence)

    def keep(self) -> Kept:
        """Check every descriptor and every path we hold; take back what moved.

        A descriptor closed under us (a job that closes what it did not open)
        is `broken`: this process can no longer tell which of its locks hold.
        """
        kept = Kept()
        with self._guard:
            mine = [("presence", self._presence)] if self._presence else []
            mine += [(f"lock of job key {key}", held) for key, held in self._held.items()]
            for what, held in mine:
                if not _still(held):
                    kept.broken.append(f"{what} (descriptor {held.fd})")
            if kept.broken or not mine:
                return kept
            if not self.folder_present():
                try:
                    self.make_folder()
                except OSError as exc:
                    kept.failed = str(exc)
                    kept.lost = sorted(self._held)
                    return kept
                kept.remade_folder = True
            if self._folder_remade:  # a claim found it gone and made it before we looked
                kept.remade_folder, self._folder_remade = True, False
            for key, held in list(self._held.items()):
                if _same(self.path(key), held.fd) is None:
                    if self._retake(key):
                        kept.retaken.append(key)
                    else:
                        kept.lost.append(key)
            presence = self._presence
            if presence is not None and _same(self.presence_path, presence.fd) is None:
                try:
                    self._presence = self._join()
                except OSError as exc:  # a full disk, say: this replica is not seen as live
                    kept.failed = f"cannot make the presence file again: {exc}"
                    return kept
                _release(presence.fd)
                kept.rejoined = True
        return kept

    def _retake(self, key: int) -> bool:
        """Our lock's file left its path: hold the file there now, stamped as ours."""
        for _ in range(RETAKE_TRIES):
            try:
                held = self._take(self.path(key))
            except OSError:
                held = None
            if held is not None:
                _write(held.fd, self._holder().encode())
                _release(self._held[key].fd)  # a lock on a file nobody can reach
                self._held[key] = held
                return True
            waits.sleep(RETAKE_PAUSE)
        return False

    # -- plumbing -----------------------------------------------------------------------

    def _take(self, path: Path) -> _Held | None:
        """Flock the file at `path`; None if another holds it. Verified by inode after the
        flock (a file replaced meanwhile is let go and the new one tried)."""
        for _ in range(5):
            fd = self._open(path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return None
            found = _same(path, fd)
            if found is not None:
                return _Held(fd, found.st_dev, found.st_ino, _read_holder(fd), self._age(found))
            _release(fd)
        raise OSError(f"{path}: replaced again and again while being locked")

    def _open(self, path: Path) -> int:
        """Open (or make) a file of the folder; the folder is made again if it vanished."""
        try:
            return _open(path)
        except FileNotFoundError:
            self.make_folder()
            self._folder_remade = True  # said by the next `keep`, as if it had found it gone
            return _open(path)

    def _age(self, found: os.stat_result) -> float:
        """How long the file has been at its path: by its change time, or since this
        process first saw it (a clock stepped back makes change times lie)."""
        now = self.monotonic()
        seen = self._first_seen.setdefault((found.st_dev, found.st_ino, found.st_ctime_ns), now)
        if len(self._first_seen) > 10_000:
            self._first_seen.clear()
        return max(self.wall() - found.st_ctime, now - seen)

    def _forget_after_fork(self) -> None:
        """In a forked child: these descriptors are the parent's, not ours."""
        held = [*self._held.values(), *([self._presence] if self._presence else [])]
        for taken in held:
            with contextlib.suppress(OSError):
                os.close(taken.fd)
        self._held.clear()
        self._presence = None
        self._guard = threading.RLock()


_ALL: weakref.WeakSet[FileLocks] = weakref.WeakSet()


def make_folders(root: Path) -> list[str]:
    """The lock folders, this user's alone; returns what had to be repaired.

    Refuses (OSError) a folder others could write to or that is not this
    user's, and a file in it that is not this user's; a folder others could
    read becomes 0700, a file others could open is replaced by a new one.
    """
    repaired = []
    for folder in (root, root / "instances"):
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        found = os.stat(folder, follow_symlinks=False)
        if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.geteuid():
            raise OSError(f"{folder}: not a folder of this user's; remove it")
        mode = stat.S_IMODE(found.st_mode)
        if mode & 0o022:
            raise OSError(
                f"{folder}: other users may write to it (mode {mode:o}): "
                "any of them could hold a job's lock; remove it or chmod 700 it"
            )
        if mode & 0o077:
            os.chmod(folder, 0o700, follow_symlinks=False)
            repaired.append(f"{folder} {mode:o} -> 700")
        repaired += _repair_files(folder)
    return repaired


def _repair_files(folder: Path) -> list[str]:
    repaired = []
    for path in sorted(folder.glob("*.lock")):
        try:
            found = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(found.st_mode) or found.st_uid != os.geteuid():
            raise OSError(f"{path}: not a file of this user's; remove it")
        mode = stat.S_IMODE(found.st_mode)
        if mode & 0o077:
            _replace(path)
            repaired.append(f"{path.name} {mode:o} -> a new file, 600")
    return repaired


def presence_of(folder: Path, instance: str) -> dict[str, object] | None:
    """What a live instance of this name says of itself; None if none is up."""
    found = presence.held(folder / "instances" / f"{instance}.lock", STAMP_MAX)
    return None if found is None else _said(found)


def live_instances(root: Path) -> list[dict[str, object]]:
    """Instances whose presence file is held; each with what its file says."""
    folder = root / "instances"
    live = []
    for path in sorted(folder.glob("*.lock")) if _is_dir(folder) else []:
        found = presence.held(path, STAMP_MAX)  # None: gone, and its file removed
        if found is not None:
            live.append({"name": path.stem, **_said(found)})
    return live


def _forget_all_after_fork() -> None:
    for locks in list(_ALL):
        locks._forget_after_fork()


os.register_at_fork(after_in_child=_forget_all_after_fork)


def _open(path: Path, create: bool = True) -> int:
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    return os.open(path, flags, 0o600)


def _replace(path: Path) -> None:
    """A new 0600 file at `path`, atomically: descriptors of the old one lose their power."""
    fresh = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(fresh, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    os.close(fd)
    os.chmod(fresh, 0o600)
    os.replace(fresh, path)


def _same(path: Path, fd: int) -> os.stat_result | None:
    """The file at `path`, if it is the one open as `fd`."""
    try:
        at_path = os.stat(path, follow_symlinks=False)
        opened = os.fstat(fd)
    except OSError:
        return None
    same = (at_path.st_dev, at_path.st_ino) == (opened.st_dev, opened.st_ino)
    return at_path if same else None


def _still(held: _Held) -> bool:
    """The descriptor is still open on the file we opened (not closed, not reused)."""
    try:
        found = os.fstat(held.fd)
    except OSError:
        return False
    return (found.st_dev, found.st_ino) == (held.dev, held.ino)


def _flocked() -> set[tuple[int, int]] | None:
    """(device, inode) of every file someone holds a flock on, from /proc/locks."""
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    found = set()
    for line in lines:
        parts = line.split()
        if len(parts) < 6 or parts[1] != "FLOCK":  # "->": a waiter, who holds nothing
            continue
        try:
            major, minor, inode = parts[5].split(":")
            found.add((os.makedev(int(major, 16), int(minor, 16)), int(inode)))
        except ValueError:
            continue
    return found


def _is_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.stat(path).st_mode)
    except FileNotFoundError:
        return False


def _write(fd: int, data: bytes) -> None:
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))


def _read_holder(fd: int) -> Holder | None:
    with contextlib.suppress(OSError):
        return Holder.decode(os.pread(fd, STAMP_MAX, 0))
    return None


def _said(data: bytes) -> dict[str, object]:
    """What a presence file says: since when, and what its keeper had to mend."""
    try:
        found = json.loads(data)
    except ValueError:
        return {}
    if not isinstance(found, dict):
        return {}
    out: dict[str, object] = {}
    if isinstance(found.get("since"), int | float):
        out["since"] = found["since"]
    if isinstance(found.get("pid"), int):
        out["pid"] = found["pid"]
    if isinstance(found.get("note"), str) and found["note"]:
        out["note"] = found["note"][:500]
    return out


def _release(fd: int) -> None:
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)  # also for a forked child's copy of the descriptor
    with contextlib.suppress(OSError):  # closed under us already (see FileLocks.keep)
        os.close(fd)
