"""The embedded session's keeper: a thread that looks at the session's files twice a second.

Files on a shared host are not as steady as a server's session: a temp
cleaner removes them, a job closes descriptors it did not open. Each look:

- a lock file or folder removed under the session: made again and the lock
  taken back (`FileLocks.keep`); a lock whose new file another process holds
  is lost, and the gate is told as a lost session is (`fileno` becomes
  readable, `check_alive` raises SessionLost): its runs are told `lock_lost`,
  and the session starts over;
- a descriptor of ours closed under us, or the ledger file removed or
  replaced: the process can no longer be trusted with its locks, or would
  write to a ledger nobody else reads. It exits with EXIT_RESTART at once (no
  SQLite close: that could delete a new ledger's `-wal` by its name) so that
  its supervisor starts it again, rather than staying up idle;
- a step of the wall clock: said in the log (`clock_steps`);
- every MAINTAIN_EVERY, the WAL truncated and free pages given back.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from scheduler.backends.base import SessionLost
from scheduler.backends.clock_steps import ClockWatch
from scheduler.backends.filelocks import FileLocks, Kept
from scheduler.backends.ledger_file import LedgerFile
from scheduler.errors import one_line

log = logging.getLogger("scheduler.embedded")

EXIT_RESTART = 70  # the process cannot go on safely; its supervisor should start it again
MAINTAIN_EVERY = 600.0  # seconds between WAL truncations and incremental vacuums


class Keeper:
    def __init__(
        self,
        locks: FileLocks,
        file: LedgerFile,
        *,
        monotonic: Callable[[], float],
        wall: Callable[[], float],
        every: float,
        exit: Callable[[int], None],
    ) -> None:
        self.locks, self.file = locks, file
        self.monotonic, self.every, self.exit = monotonic, every, exit
        self.clock_watch = ClockWatch(wall, monotonic)
        self.broken: str | None = None  # why this process had to end (see `end`)
        self._wake: tuple[int, int] | None = None  # the pipe `fileno` reads, per session
        self._lost: str | None = None  # why the session's locks are lost
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None
        self._opened: tuple[int, int] | None = None  # the ledger file the session opened
        self._companions: dict[Path, tuple[int, int]] = {}  # its -wal and -shm, last seen
        self._maintained = monotonic()

    def start(self, opened: tuple[int, int]) -> None:
        """A session began on the ledger file `opened` (device, inode)."""
        self._opened, self._lost = opened, None
        self._wake = os.pipe()
        for fd in self._wake:
            os.set_blocking(fd, False)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(self._stop,), name="embedded-keeper", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        stop, thread = self._stop, self._thread
        self._stop = self._thread = None
        if stop is not None:
            stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        wake, self._wake = self._wake, None
        for fd in wake or ():
            with contextlib.suppress(OSError):
                os.close(fd)

    def fileno(self) -> int | None:
        """Readable when a lock could not be taken back (`check_alive` says which)."""
        return None if self._wake is None else self._wake[0]

    def check_alive(self) -> None:
        if self._wake is not None:
            with contextlib.suppress(OSError):
                os.read(self._wake[0], 4096)
        if self._lost is not None:
            raise SessionLost(self._lost)

    def _run(self, stop: threading.Event) -> None:
        said = None
        while not stop.wait(self.every):
            try:
                if not self.look():
                    return
            except Exception as exc:  # said once, not twice a second
                if one_line(exc) != said:
                    said = one_line(exc)
                    log.warning("the embedded keeper failed (trying again): %s", said)

    def look(self) -> bool:
        """One look (see the module's docstring); False once the session is done for."""
        kept = self.locks.keep()
        if kept.broken:
            self.descriptors_lost(", ".join(kept.broken))
            return False
        if not self._ledger_still_ours():
            return False
        if kept.news or kept.failed:
            self._tell(kept)
        if kept.failed or kept.lost:
            self._lose(
                kept.failed
                or "the lock file of job key(s) "
                + ", ".join(map(str, kept.lost))
                + " was replaced and another process holds the new one"
            )
            return False
        self.clock_watch.look()
        if self.monotonic() - self._maintained > MAINTAIN_EVERY:
            self._maintained = self.monotonic()
            self.file.maintain()
        return True

    def descriptors_lost(self, which: str) -> None:
        self.end(
            "file descriptors of this replica were closed under it (a job that closes "
            f"descriptors it did not open?): {which}; it can no longer tell which job locks "
            "it holds, and SQLite would write to whatever those numbers name now"
        )

    def end(self, reason: str) -> None:
        """The process cannot go on: say why, and exit at once for a supervisor."""
        self.broken = reason
        log.critical(
            "%s: exiting now with status %d so that a supervisor starts it again",
            reason,
            EXIT_RESTART,
        )
        self.exit(EXIT_RESTART)

    def _ledger_still_ours(self) -> bool:
        """The ledger at its path is the file this session opened (else the process ends)."""
        found = self.file.identity()
        if found == self._opened:
            self._companions = self.file.identities()
            return True
        moved = self.file.set_aside(self._companions)
        aside = f"; its -wal and -shm are set aside as {', '.join(map(str, moved))}" * bool(moved)
        self.end(
            f"{self.file.path}: the ledger was {'removed' if found is None else 'replaced'} "
            f"while this replica had it open{aside}: the replicas must all start again on one "
            "ledger, and SQLite must not open a new one beside the old one's -wal"
        )
        return False

    def _tell(self, kept: Kept) -> None:
        """In the log, and in the presence file for `status`: what had to be mended."""
        done = []
        if kept.remade_folder:
            done.append(f"the lock folder {self.locks.folder} had vanished: made it again")
        if kept.retaken:
            done.append(f"took back the locks of job key(s) {', '.join(map(str, kept.retaken))}")
        if kept.lost:
            done.append(f"lost the locks of job key(s) {', '.join(map(str, kept.lost))}")
        if kept.rejoined:
            done.append("made this replica's presence file again")
        if kept.failed:
            done.append(f"cannot make the lock folder again: {kept.failed}")
        text = "; ".join(done)
        log.warning("lock files removed under this replica (a temp cleaner?): %s", text)
        at = datetime.now(UTC).isoformat(timespec="seconds")
        self.locks.note(f"{at}: {text}")

    def _lose(self, reason: str) -> None:
        """Tell the gate as a lost session is told: its runs' lock_lost, then a new session."""
        log.error("%s: this replica's runs are told their locks are lost", reason)
        self._lost = reason
        if self._wake is not None:
            with contextlib.suppress(OSError):
                os.write(self._wake[1], b"!")
