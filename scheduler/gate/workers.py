"""The threads that run jobs: handing a run over costs the dispatcher one queue put.

Why not `concurrent.futures.ThreadPoolExecutor`: its `submit` builds a Future
and goes through a Python-level semaphore and condition, about 30 µs of the
dispatcher's time per run. In a burst of hundreds of runs, the workers woken
by the first hand-overs take the interpreter from the dispatcher long before
it has handed over the rest (measured: 5 ms of work spread over 50 to 120 ms),
and the last runs of the burst start late. Here a hand-over is a put on a
`queue.SimpleQueue` (implemented in C), so a whole burst is handed over
before the first worker gets going. Nothing needs a Future: a run reports
its own end to the gate.

Threads are started only while every existing thread is busy, up to
`max_workers`, and are kept. Runs handed over beyond them wait in the queue:
runs won ahead of a free worker (gate/ahead.py), which a worker checks before
it starts one (`RunTable.begin`).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("scheduler.workers")

Task = tuple[Callable[..., None], tuple[Any, ...]]


class Workers:
    def __init__(self, max_workers: int, name: str = "run") -> None:
        if max_workers < 1:
            raise ValueError("max_workers must be at least 1")
        self.max_workers = max_workers
        self.name = name
        self._queue: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._all_done = threading.Condition(self._lock)
        self._threads = 0
        self._busy = 0  # handed over and not yet returned
        self._closed = False

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` on a worker thread."""
        self.submit_all([(fn, args)])

    def submit_all(self, tasks: list[Task]) -> None:
        """Hand a whole batch over at once: one lock, then only queue puts.

        Never blocks once the threads exist; a thread started here (while the
        pool grows) is started after the batch is queued.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("workers are shut down")
            self._busy += len(tasks)
            first = self._threads + 1
            self._threads = max(self._threads, min(self._busy, self.max_workers))
            new = range(first, self._threads + 1)
        put = self._queue.put
        for task in tasks:
            put(task)
        for number in new:
            threading.Thread(target=self._work, name=f"{self.name}-{number}", daemon=True).start()

    @property
    def busy(self) -> int:
        return self._busy

    @property
    def threads(self) -> int:
        return self._threads

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every task handed over has returned; False if `timeout` ran out."""
        with self._all_done:
            return self._all_done.wait_for(lambda: self._busy == 0, timeout)

    def shutdown(self) -> None:
        """Idle threads end; busy ones end after their task (they cannot be interrupted)."""
        with self._lock:
            self._closed = True
            threads = self._threads
        for _ in range(threads):
            self._queue.put(None)

    def _work(self) -> None:
        while (task := self._queue.get()) is not None:
            fn, args = task
            try:
                fn(*args)
            except BaseException:  # a task's failure must not cost the pool a thread
                log.exception("worker task failed")
            finally:
                del task, fn, args
                with self._lock:
                    self._busy -= 1
                    if self._busy == 0:
                        self._all_done.notify_all()
