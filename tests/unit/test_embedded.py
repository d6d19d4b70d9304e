"""The embedded backend's file locks: this user's alone, exact, and safe across fork."""

from __future__ import annotations

import os
import stat
import time

import pytest

from scheduler.backends import filelocks
from scheduler.backends.base import Unavailable
from scheduler.backends.embedded import EmbeddedBackend


def replica(tmp_path, name: str) -> EmbeddedBackend:
    backend = EmbeddedBackend(tmp_path / "scheduler.db", instance=name, namespace=4242)
    backend.migrate()
    backend.connect()
    return backend


def test_lock_files_are_this_users_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "umask", os.umask)
    old = os.umask(0)  # the most permissive umask: the modes must not depend on it
    try:
        a = replica(tmp_path, "a")
        assert a.locks.try_lock(7)
    finally:
        os.umask(old)
    folder = a.locks.folder
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE((folder / "instances").stat().st_mode) == 0o700
    assert stat.S_IMODE(a.locks.path(7).stat().st_mode) == 0o600
    assert stat.S_IMODE((folder / "instances" / "a.lock").stat().st_mode) == 0o600
    a.close()


def test_a_lock_folder_others_can_write_to_is_refused(tmp_path):
    folder = tmp_path / "scheduler.db.locks"
    folder.mkdir()
    folder.chmod(0o777)
    backend = EmbeddedBackend(tmp_path / "scheduler.db", instance="a", namespace=4242)
    backend.migrate()
    with pytest.raises(Unavailable, match="other users may write to it"):
        backend.connect()


def test_a_link_planted_at_a_lock_path_is_not_followed(tmp_path):
    a = replica(tmp_path, "a")
    target = tmp_path / "elsewhere"
    target.write_text("")
    a.locks.path(9).symlink_to(target)
    with pytest.raises(OSError):
        a.locks.try_lock(9)
    assert target.read_text() == ""
    a.close()


def test_a_presence_file_unlinked_before_it_is_locked_is_made_again(tmp_path, monkeypatch):
    """`status` sweeps presence files nobody holds: it may unlink ours between open and flock."""
    a = replica(tmp_path, "a")
    a.close()
    real_flock = filelocks.fcntl.flock
    raced = []

    def flock(fd, operation):
        if operation == filelocks.fcntl.LOCK_SH and not raced:
            raced.append(True)
            (a.locks.folder / "instances" / "b.lock").unlink()  # the sweep got there first
        return real_flock(fd, operation)

    monkeypatch.setattr(filelocks.fcntl, "flock", flock)
    b = replica(tmp_path, "b")
    monkeypatch.setattr(filelocks.fcntl, "flock", real_flock)
    assert raced
    assert [i["name"] for i in b.live_instances(None)] == ["b"]
    b.close()


def test_a_forked_child_does_not_keep_a_lock_its_parent_gave_up(tmp_path):
    """multiprocessing's fork start method copies every descriptor into the child."""
    a, b = replica(tmp_path, "a"), replica(tmp_path, "b")
    assert a.locks.try_lock(11)
    child = os.fork()
    if child == 0:  # the child lives on a while, as a worker process would
        time.sleep(1)
        os._exit(0)
    try:
        a.locks.unlock(11)
        assert b.locks.try_lock(11), "the child's copy of the descriptor kept the lock"
    finally:
        os.waitpid(child, 0)
        a.close()
        b.close()
