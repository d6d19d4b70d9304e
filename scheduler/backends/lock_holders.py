"""Who took an embedded lock file, as written into it, and whether that process lives.

A flock alone cannot say whether the run that held a job is over: its file may
have been removed and made again, or the run's own job may have closed the
replica's descriptor (which releases the flock while the run goes on). The
process that takes a lock writes who it is into the file; another one that
later finds the lock free asks `Holder.alive`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Holder:
    """Who took a lock file last, as written into it: enough to tell if that process lives."""

    instance: str
    pid: int
    start: str  # the process's start time (/proc/<pid>/stat): a reused pid is another process
    pidns: int  # its pid namespace: another namespace's pid means nothing here
    token: str  # the FileLocks session within that process
    # It gave the lock back on purpose, running nothing of the job: whatever `running`
    # row names it is a run that never went on (a claim whose reply was lost).
    released: bool = False

    def encode(self, **extra: object) -> bytes:
        fields = {
            "instance": self.instance,
            "pid": self.pid,
            "start": self.start,
            "pidns": self.pidns,
            "token": self.token,
            **extra,
        }
        return json.dumps(fields).encode()

    @classmethod
    def decode(cls, data: bytes) -> Holder | None:
        try:
            found = json.loads(data)
            return cls(
                str(found["instance"]),
                int(found["pid"]),
                str(found["start"]),
                int(found["pidns"]),
                str(found["token"]),
                found.get("released") is True,
            )
        except (ValueError, KeyError, TypeError):
            return None

    def alive(self) -> bool:
        """The process still runs (and, in this process, its FileLocks session is open).

        A pid of another pid namespace cannot be judged here: taken as gone, so the
        flock alone decides, as it always did.
        """
        me = _process()
        if self.pidns != me.pidns:
            return False
        if self.pid == me.pid and self.start == me.start:
            return self.token in _OPEN_SESSIONS
        return _process_start(self.pid) == self.start


@dataclass(frozen=True)
class _Process:
    pid: int
    start: str
    pidns: int


_OPEN_SESSIONS: set[str] = set()  # tokens of this process's FileLocks sessions now open
_ME: _Process | None = None


def me(instance: str, token: str) -> Holder:
    """This process, for the session `token` of `instance`."""
    found = _process()
    return Holder(instance, found.pid, found.start, found.pidns, token)


def open_session(token: str) -> None:
    _OPEN_SESSIONS.add(token)


def close_session(token: str) -> None:
    _OPEN_SESSIONS.discard(token)


def _process() -> _Process:
    global _ME
    if _ME is None or _ME.pid != os.getpid():
        pid = os.getpid()
        _ME = _Process(pid, _process_start(pid) or "", _pid_namespace())
    return _ME


def _process_start(pid: int) -> str | None:
    """The start time of a live process (clock ticks since boot), None if there is none.

    A zombie is none: it has exited and closed its files, only its parent has not
    reaped it yet (a web server's master busy pinging its other workers can take a
    minute), and it runs nothing of a job."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except FileNotFoundError:
        return None
    except OSError:
        fields = []
    if len(fields) > 19:
        return None if _exited(pid, fields[0]) else fields[19].decode()
    try:  # no /proc here: whether the pid exists, at least
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return ""


def _exited(pid: int, state: bytes) -> bool:
    """A zombie whose threads are all gone (a main thread that ended before the
    others shows the same state while they run on)."""
    if state not in (b"Z", b"X"):
        return False
    try:
        return len(os.listdir(f"/proc/{pid}/task")) <= 1
    except OSError:
        return True


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _forget_after_fork() -> None:
    """In a forked child: another process, and none of the parent's sessions."""
    global _ME
    _ME = None
    _OPEN_SESSIONS.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
