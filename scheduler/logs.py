"""Logging: `text` for people, `json` (one object per line) for log pipelines.

`RunLog` observes the gate and writes one line when a run starts, one when it
ends, one per skip, per missed tick and per lost session.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import queue
import sys
import threading
import time
from datetime import UTC, datetime
from typing import Any, TextIO

from scheduler import events
from scheduler.statuses import Status
from scheduler.text import printable

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

    Records arrive on a queue; whatever has queued up is formatted and written
    in one write, so hundreds of lines a second cost a few writes, and no
    thread that logs ever waits for the terminal or a pipe. Run lines arrive
    as events and become records here, off the threads that run jobs.
    """

    def __init__(self, stream: TextIO, formatter: logging.Formatter) -> None:
        self.stream = stream
        self.formatter = formatter
        self.queue: queue.SimpleQueue[Item | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="log-writer", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Write out everything queued, then end."""
        self.queue.put(None)
        self.thread.join(timeout=10)

    def _loop(self) -> None:
        while True:
            batch = [self.queue.get()]
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
                        lines.append(f"(could not build the log line for {item.event!r})")
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
    """Log lines to be built by the writer thread (see `RunLog`)."""

    __slots__ = ("created", "event", "run_log")

    def __init__(self, run_log: RunLog, event: events.Event, created: float) -> None:
        self.run_log, self.event, self.created = run_log, event, created

    def records(self) -> list[logging.LogRecord]:
        return self.run_log.records(self.event, self.created)


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
    logging._srcfile = None  # type: ignore[attr-defined]
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False


def stop_logging() -> None:
    global _writer
    if _writer is not None:
        _writer.stop()  # writes every queued record first
        _writer = None


class RunLog:
    """The gate's outcomes as log lines.

    With `structured`, each line also carries the event's fields (for JSON
    logs); text logs say everything in the message and skip building them.
    When `setup_logging` runs the writer thread, the lines are built there:
    the thread that starts or finishes a run only queues the event.
    """

    def __init__(self, logger: logging.Logger | None = None, structured: bool = False) -> None:
        self.log = logger or logging.getLogger("scheduler.runs")
        self.structured = structured

    def __call__(self, event: events.Event) -> None:
        writer = _writer
        if writer is not None and self.log.propagate and not self.log.handlers:
            writer.queue.put(_Deferred(self, event, time.time()))
            return
        for record in self.records(event, time.time()):
            self.log.handle(record)

    def records(self, event: events.Event, created: float) -> list[logging.LogRecord]:
        """The lines for one event, stamped with the time it happened."""
        out: list[logging.LogRecord] = []

        def add(level: int, msg: str, *args: object, extra: dict[str, Any] | None) -> None:
            if self.log.isEnabledFor(level):
                record = self.log.makeRecord(
                    self.log.name, level, "(unknown file)", 0, msg, args, None, extra=extra
                )
                record.created = created
                record.msecs = (created - int(created)) * 1000
                out.append(record)

        if isinstance(event, events.RunStarted):
            add(
                logging.INFO,
                "run started: %s tick %s run_id %d (%.3f s late)",
                event.job,
                event.scheduled_at.isoformat(),
                event.run_id,
                event.lateness_s,
                extra=self._fields(
                    event,
                    "job",
                    "key",
                    "scheduled_at",
                    "run_id",
                    "instance",
                    "lateness_s",
                    "manual",
                ),
            )
            if event.crashed:
                add(
                    logging.WARNING,
                    "%s: %d earlier run(s) recorded crashed (their replica died or lost the lock)",
                    event.job,
                    event.crashed,
                    extra=self._fields(event, "job", "key"),
                )
        elif isinstance(event, events.RunFinished):
            level = logging.INFO if event.status == Status.SUCCEEDED else logging.WARNING
            note = "" if event.recorded else " (not recorded: the run had lost its lock)"
            if event.told:
                note += f" (told: {event.told})"
            add(
                level,
                "run %s: %s tick %s run_id %d in %.3f s%s%s",
                event.status,
                event.job,
                event.scheduled_at.isoformat(),
                event.run_id,
                event.duration_s,
                f": {event.error}" if event.error else "",
                note,
                extra=self._fields(
                    event,
                    "job",
                    "key",
                    "scheduled_at",
                    "run_id",
                    "instance",
                    "status",
                    "duration_s",
                    "error",
                    "recorded",
                    "lock_lost",
                    "told",
                ),
            )
        elif isinstance(event, events.TickSkipped):
            since = f" since {event.holder_since.isoformat()}" if event.holder_since else ""
            add(
                logging.WARNING,
                "tick skipped: %s tick %s, previous run still going on %s%s "
                "(%d consecutive skip(s))",
                event.job,
                event.scheduled_at.isoformat(),
                event.holder or "?",
                since,
                event.consecutive_skips,
                extra=self._fields(
                    event, "job", "key", "scheduled_at", "instance", "holder", "consecutive_skips"
                ),
            )
        elif isinstance(event, events.TickMissed):
            add(
                logging.WARNING,
                "tick missed: %s tick %s could not start within its misfire grace",
                event.job,
                event.scheduled_at.isoformat(),
                extra=self._fields(event, "job", "key", "scheduled_at", "instance"),
            )
        elif isinstance(event, events.SessionUp):
            add(
                logging.INFO,
                "lock session up (%s)",
                event.backend,
                extra={"instance": event.instance},
            )
        elif isinstance(event, events.SessionLost):
            add(
                logging.ERROR,
                "lock session lost: %s; lock_lost set on %s",
                event.reason,
                ", ".join(event.runs) or "no running job",
                extra={"instance": event.instance, "lost_runs": list(event.runs)},
            )
        return out

    def _fields(self, event: object, *names: str) -> dict[str, Any] | None:
        if not self.structured:
            return None
        out = {}
        for name in names:
            value = getattr(event, name)
            out[name] = value.isoformat() if isinstance(value, datetime) else value
        return out
