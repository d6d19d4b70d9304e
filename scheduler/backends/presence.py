"""Presence files: a process says it is alive by holding a flock on a file of its own.

The kernel drops a flock the instant its holder exits or dies (SIGKILL, OOM), so a look
that can take a file's lock (exclusively, without waiting) knows its holder is gone, and
removes the file. The embedded backend's live instances and the host lock's standbys are
told so.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


def held(path: Path, read: int = 0) -> bytes | None:
    """The first `read` bytes of the file at `path` if a process holds a flock on it
    (b"" if they cannot be read); None if nobody holds it (the file is then removed,
    under the look's own lock) or if no file can be opened there (gone meanwhile, a link).

    A flock the look cannot take for another reason than its being held says nothing
    of the holder: the file is taken for held, and left alone.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return _head(fd, read)
    else:
        path.unlink(missing_ok=True)
        return None
    finally:
        os.close(fd)


def _head(fd: int, size: int) -> bytes:
    try:
        return os.pread(fd, size, 0) if size else b""
    except OSError:
        return b""
