"""The walk of one tick, measured by tracing it: which files of the package it enters.

    .venv/bin/python bench/tick_walk.py [TREE]   (default: this checkout)

The walk: one tick of one job on PostgreSQL, from `Gate.submit` to its finish
recorded (claim, run on a worker thread, finish), as the dispatcher steps. A
profiler on every thread records each call from one file of `scheduler/` into
another. Printed: the files entered; the moves (distinct hops from a function
of one file into a function of another); and the callbacks up into the gate
(hops from another file into a method of `Gate`, which a helper makes when
it calls back instead of returning what to do; the wake-up pipe beside it is
the dispatcher's door, not a callback).

Run on another tree (a worktree of an earlier commit, say), it imports that
tree's package: `code_measures.py` prints both side by side.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

TREE = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent
sys.path[:0] = [str(TREE), str(Path(__file__).resolve().parent)]

from fleet import SERVER, Server  # noqa: E402

PACKAGE = str(TREE / "scheduler") + "/"
GATE = "gate/__init__.py"


def short(filename: str) -> str | None:
    return filename[len(PACKAGE) :] if filename.startswith(PACKAGE) else None


class Trace:
    """Hops between files of the package, from every thread's calls."""

    def __init__(self) -> None:
        self.hops: set[tuple[str, str, str]] = set()
        self.files: set[str] = set()
        self.on = False

    def __call__(self, frame: Any, event: str, arg: object) -> None:
        if event != "call" or not self.on:
            return
        callee = short(frame.f_code.co_filename)
        if callee is None:
            return
        self.files.add(callee)
        caller = frame.f_back
        while caller is not None and short(caller.f_code.co_filename) is None:
            caller = caller.f_back  # through the standard library (a queue, a thread)
        where = short(caller.f_code.co_filename) if caller is not None else None
        if where is not None and where != callee:
            self.hops.add((where, callee, frame.f_code.co_qualname))


def events_module() -> Any:
    """The tree's own events (an editable install may answer for a module it lacks)."""
    if (TREE / "scheduler" / "observers").is_dir():
        from scheduler.observers import events
    else:  # a tree from before the observers/ folder
        from scheduler import events  # type: ignore[no-redef]
    return events


def walk(url: str) -> Trace:
    from scheduler.backends.postgres import PostgresBackend
    from scheduler.gate import Gate
    from tests.support import make_job

    events = events_module()
    finished = threading.Event()

    def listen(event: object) -> None:
        if isinstance(event, events.RunFinished):
            finished.set()

    backend = PostgresBackend(url, instance="walk", namespace=5, holder_timeout=30)
    backend.migrate()
    gate = Gate(backend, instance="walk", max_workers=2, holder_timeout=30, listeners=[listen])
    job = make_job(1, lambda ctx: None, name="walked")
    trace = Trace()
    try:
        gate.step()  # the lock session comes up before the walk
        tick = gate.clock().replace(microsecond=0)
        threading.setprofile(trace)
        sys.setprofile(trace)
        trace.on = True
        gate.submit(job, tick)
        deadline = time.monotonic() + 30
        while not finished.is_set() or gate.running_jobs():
            gate.step()
            if time.monotonic() > deadline:
                raise SystemExit("the walked tick did not finish within 30 s")
            time.sleep(0.01)
        gate.step()  # the finish is recorded at the next step
        trace.on = False
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        backend.close()
    return trace


def main() -> None:
    server = Server(SERVER)
    database = server.create("walk")
    try:
        trace = walk(server.database_url(database))
    finally:
        server.drop(database)
    callbacks = sorted(
        {name for _, callee, name in trace.hops if callee == GATE and name.startswith("Gate.")}
    )
    print(
        json.dumps(
            {
                "files": len(trace.files),
                "moves": len(trace.hops),
                "callbacks into the gate": len(callbacks),
                "callback names": callbacks,
                "file names": sorted(trace.files),
            }
        )
    )


if __name__ == "__main__":
    main()
