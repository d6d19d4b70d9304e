"""A replica started before a fork does not run as a copy in the child: the child's copy is
stopped (active False, no daemon), it keeps no hold on the host lock, and `start()` there
starts a replica of the child's own."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection

from scheduler import Replica
from scheduler.fleet.host_lock import HostLock
from tests.support import wait_for
from tests.unit.test_replica import project, ticks


def test_the_childs_copy_is_stopped_and_holds_no_lock(tmp_path, monkeypatch):
    lock = tmp_path / "host.lock"
    replica = Replica(config=project(tmp_path, monkeypatch), host_lock=str(lock)).start()
    try:
        assert replica.active
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report, then live on while the parent lets go
            os.close(read)
            copy = (replica.active, replica.standby, replica.daemon is None)
            replica.stop()  # touches nothing of the parent's
            os.write(write, b"ok" if copy == (False, False, True) else repr(copy).encode())
            time.sleep(3)
            os._exit(0)
        os.close(write)
        assert os.read(read, 100) == b"ok"
        os.close(read)
        assert replica.active  # the child's stop did not stop the parent
        seen = len(ticks(tmp_path))
        wait_for(lambda: len(ticks(tmp_path)) > seen, 5, "the parent to go on ticking")
    finally:
        replica.stop()
        os.waitpid(pid, 0)


FORKS_THEN_DIES = """
import os, sys, time
from scheduler import Replica

replica = Replica(config=sys.argv[1], host_lock=sys.argv[2]).start()
if os.fork() == 0:
    time.sleep(30)  # the child lives on, with its copy of the parent's descriptors
    os._exit(0)
print(os.getpid(), flush=True)
time.sleep(30)
"""


def test_a_child_keeps_no_hold_on_the_host_lock_when_its_parent_dies(tmp_path, monkeypatch):
    """A flock belongs to the open file, which a fork shares: the child closes its copy, or a
    parent killed (no unlock) would leave the lock held by a child that runs no replica."""
    lock = tmp_path / "host.lock"
    config = project(tmp_path, monkeypatch)
    parent = subprocess.Popen(
        [sys.executable, "-c", FORKS_THEN_DIES, str(config), str(lock)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert parent.stdout is not None
        assert parent.stdout.readline().strip() == str(parent.pid)
        assert not HostLock(lock).try_take()  # the parent's replica holds it
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        wait_for(lambda: HostLock(lock).try_take(), 10, "the lock to be free", every=0.05)
    finally:
        os.killpg(parent.pid, signal.SIGKILL)  # the child too
        parent.wait(10)
        assert parent.stdout is not None
        parent.stdout.close()


def _child(replica: Replica, pipe: Connection) -> None:
    pipe.send((replica.active, replica.daemon is None))
    replica.start()  # afresh: a replica of this process, behind the parent's host lock
    assert replica.config is not None
    pipe.send((replica.standby, replica.config.settings.instance_name))
    pipe.recv()  # the parent stopped its replica
    wait_for(lambda: replica.active, 15, "the child to take over", every=0.02)
    pipe.send(True)
    replica.stop()


def test_start_in_a_multiprocessing_child_starts_a_replica_of_its_own(tmp_path, monkeypatch):
    replica = Replica(config=project(tmp_path, monkeypatch), host_lock=str(tmp_path / "h.lock"))
    replica.start()
    ours, theirs = multiprocessing.get_context("fork").Pipe()
    child = multiprocessing.get_context("fork").Process(target=_child, args=(replica, theirs))
    child.start()
    try:
        assert ours.recv() == (False, True)
        standby, name = ours.recv()
        assert standby and name.endswith(f"-{child.pid}")  # its own name, from its own pid
        replica.stop()
        ours.send("stopped")
        assert ours.poll(10) and ours.recv() is True
    finally:
        replica.stop()
        child.join(20)
    assert child.exitcode == 0
