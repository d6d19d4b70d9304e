"""Presence files: a file whose flock is held names a live process; one nobody holds goes.
(A second open of a file in one process is locked apart from the first, as another
process's would be, so one process plays both parts.)"""

from __future__ import annotations

import fcntl
import os

from scheduler.backends.presence import held


def hold(path, text: bytes = b"") -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.write(fd, text)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def test_a_held_file_is_read_and_kept_and_a_free_one_is_removed(tmp_path):
    path = tmp_path / "a.lock"
    fd = hold(path, b'{"since": 1}')
    try:
        assert held(path, 4096) == b'{"since": 1}'
        assert held(path, 3) == b'{"s'
        assert held(path) == b""  # held; nothing asked to be read
        assert path.exists()
    finally:
        os.close(fd)  # its holder is gone
    assert held(path, 4096) is None
    assert not path.exists()


def test_no_file_or_a_link_is_nobody(tmp_path):
    assert held(tmp_path / "missing.lock") is None
    target = tmp_path / "target"
    target.write_text("kept")
    (tmp_path / "link.lock").symlink_to(target)
    assert held(tmp_path / "link.lock") is None
    assert target.read_text() == "kept"
