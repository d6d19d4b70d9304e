"""Logging: `text` for people, `json` (one object per line) for log pipelines.

Records are formatted and written by one writer thread, many per write; a
line can also be queued as a function that builds it there (`defer`), off
the thread that has something to say (`scheduler.observers.runlog` does, for runs).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import queue
import sys
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TextIO

from scheduler.text import printable

GATHER = 0.05  # seconds the writer lets lines gather before it formats and writes them

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    """One record, one line: control characters in messages (a job's error, a name) are
    escaped, so nothing a job says can forge a log line or rewrite the terminal."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = printable(record.message)
        return super().formatMessage(record)

    def formatException(self, ei: Any) -> str:
        """Indented, so that no line of a traceback (an exception's message may hold
        newlines) can start like a log line."""
        lines = super().formatException(ei).splitlines()
        return "\n".join("  " + printable(line) for line in lines)


class _Writer:
    """The thread that formats log records and writes them to stderr.

    Records arrive on a queue; whatever has queued up within `GATHER` of the first
    is formatted and written in one write, so hundreds of lines a second cost a few
    writes and wake-ups (a line is written at most 50 ms after it was logged), and no
    thread that logs ever waits for the terminal or a pipe. Run lines arrive
    as events and become records here, off the threads that run jobs.
    """

    def __init__(self, stream: TextIO, formatter: logging.Formatter) -> None:
        self.stream = stream
        self.formatter = formatter
        self.queue: queue.SimpleQueue[Item | None] = queue.SimpleQueue()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="log-writer", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Write out everything queued, then end."""
        self.stopping.set()
        self.queue.put(None)
        self.thread.join(timeout=10)

    def _loop(self) -> None:
        while True:
            batch = [self.queue.get()]
            if batch[0] is not None:
                # Lines come a few at a time while runs start and end: gathered for a
                # moment, they cost one wake-up of this thread (and one turn at the
                # interpreter, taken from the threads starting runs) instead of dozens.
                # (An event's timed wait, not time.sleep: see scheduler.waits; `stop`
                # cuts it short.)
                self.stopping.wait(GATHER)
            with contextlib.suppress(queue.Empty):
                while len(batch) < 1000:
                    batch.append(self.queue.get_nowait())
            lines = []
            for item in batch:
                if item is None:
                    continue
                if isinstance(item, _Deferred):
                    try:
                        records = item.records()
                    except Exception:  # a broken line must not end the logging of the rest
                        lines.append(f"(could not build the log line for {item.what})")
                        continue
                else:
                    records = [item]
                for record in records:
                    try:
                        lines.append(self.formatter.format(record))
                    except Exception:
                        lines.append(f"(unformattable log record from {record.name})")
            if lines:
                try:
                    self.stream.write("\n".join(lines) + "\n")
                    self.stream.flush()
                except (OSError, ValueError):
                    pass  # stderr is gone: nothing better to do with a log line
            if None in batch:
                return


class _Deferred:
    """Log lines to be built by the writer thread (see `defer`)."""

    __slots__ = ("build", "what")

    def __init__(self, build: Callable[[], list[logging.LogRecord]], what: str) -> None:
        self.build, self.what = build, what

    def records(self) -> list[logging.LogRecord]:
        return self.build()


Item = logging.LogRecord | _Deferred


class _ToWriter(logging.Handler):
    def __init__(self, writer: _Writer) -> None:
        super().__init__()
        self.writer = writer

    def emit(self, record: logging.LogRecord) -> None:
        self.writer.queue.put(record)


_writer: _Writer | None = None


def setup_logging(fmt: str, level: int = logging.INFO, stream: TextIO | None = None) -> None:
    """Log to stderr from a writer thread, so a run's lines never wait for the terminal.

    `stop_logging` (registered at exit) writes out whatever is still queued.
    """
    global _writer
    stop_logging()
    formatter = JsonFormatter() if fmt == "json" else TextFormatter()
    _writer = _Writer(stream or sys.stderr, formatter)
    root = logging.getLogger()
    root.handlers[:] = [_ToWriter(_writer)]
    root.setLevel(level)
    logging.getLogger("apscheduler").setLevel(logging.WARNING)
    atexit.register(stop_logging)
    # Two lines per run add up at hundreds of runs a second. Neither format shows
    # the caller's file and line, thread or process, so the logging module need
    # not look them up for every record (the optimizations its HOWTO lists).
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False


def stop_logging() -> None:
    global _writer
    if _writer is not None:
        _writer.stop()  # writes every queued record first
        _writer = None


def defer(build: Callable[[], list[logging.LogRecord]], what: str) -> bool:
    """Have the writer thread build and write these lines; False if no writer runs."""
    writer = _writer
    if writer is None:
        return False
    writer.queue.put(_Deferred(build, what))
    return True
