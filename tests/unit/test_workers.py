"""The worker threads: every task handed over runs, on no more threads than allowed."""

from __future__ import annotations

import threading

import pytest

from scheduler.gate.workers import Workers
from tests.support import wait_for


def test_a_batch_runs_on_as_many_threads_as_it_needs():
    workers = Workers(max_workers=8)
    release = threading.Event()
    started: list[int] = []
    lock = threading.Lock()

    def task(n: int) -> None:
        with lock:
            started.append(n)
        release.wait(30)

    workers.submit_all([(task, (n,)) for n in range(5)])
    wait_for(lambda: len(started) == 5, 10, "five tasks running")
    assert workers.threads == 5 and workers.busy == 5
    assert not workers.wait(timeout=0.05)  # still running
    release.set()
    assert workers.wait(timeout=10)
    assert workers.busy == 0
    # Idle threads are kept and reused: a second batch starts no new thread.
    done = threading.Event()
    workers.submit(done.set)
    assert done.wait(10)
    assert workers.threads == 5
    workers.shutdown()


def test_never_more_threads_than_max_workers():
    workers = Workers(max_workers=3)
    release = threading.Event()
    finished: list[int] = []
    lock = threading.Lock()

    def task(n: int) -> None:
        release.wait(30)
        with lock:
            finished.append(n)

    workers.submit_all([(task, (n,)) for n in range(10)])
    assert workers.threads == 3
    assert workers.busy == 10
    release.set()
    assert workers.wait(timeout=10)
    assert sorted(finished) == list(range(10))
    assert workers.threads == 3
    workers.shutdown()


def test_a_failing_task_costs_no_thread_and_no_other_task():
    workers = Workers(max_workers=1)
    ran = threading.Event()

    def boom() -> None:
        raise RuntimeError("boom")

    workers.submit(boom)
    workers.submit(ran.set)
    assert ran.wait(10)
    assert workers.wait(timeout=10)
    assert workers.threads == 1
    workers.shutdown()


def test_no_task_after_shutdown():
    workers = Workers(max_workers=2)
    workers.shutdown()
    with pytest.raises(RuntimeError):
        workers.submit(lambda: None)
    with pytest.raises(ValueError):
        Workers(max_workers=0)
