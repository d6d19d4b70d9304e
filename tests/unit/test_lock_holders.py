"""Whether the process named in a lock file lives: the one test every `proves_over` asks."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from scheduler.backends import lock_holders
from scheduler.backends.lock_holders import Holder


def _holder_of(pid: int) -> Holder:
    me = lock_holders.me("vm-test", "token")
    start = lock_holders._process_start(pid)
    assert start, pid
    return Holder("vm-other", pid, start, me.pidns, "token")


def _state(pid: int) -> bytes:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()[0]


def _wait_state(pid: int, state: bytes) -> None:
    deadline = time.monotonic() + 30
    while _state(pid) != state:
        assert time.monotonic() < deadline, (pid, _state(pid))
        time.sleep(0.01)


def test_a_killed_process_not_yet_reaped_is_not_alive() -> None:
    """SIGKILLed under a parent that has not reaped it (a web server's master busy
    elsewhere): a zombie, whose lock's runs are over."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        holder = _holder_of(child.pid)
        assert holder.alive()
        child.kill()
        _wait_state(child.pid, b"Z")
        assert not holder.alive()
    finally:
        child.kill()
        child.wait()
    assert not holder.alive()


def test_a_process_whose_main_thread_ended_first_is_alive() -> None:
    """The main thread gone while another runs on: the same state letter as a zombie,
    but the process still runs (and may run a job)."""
    code = (
        "import ctypes, threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,)).start()\n"
        "ctypes.CDLL(None).pthread_exit(None)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        holder = _holder_of(child.pid)
        _wait_state(child.pid, b"Z")
        assert len(os.listdir(f"/proc/{child.pid}/task")) == 2
        assert holder.alive()
    finally:
        child.kill()
        child.wait()
