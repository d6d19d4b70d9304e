"""Logging: `text` for people, `json` (one object per line) for log pipelines.

`RunLog` observes the gate and writes one line when a run starts, one when it
ends, one per skip, per missed tick and per lost session.
"""

from __future__ import annotations

import atexit
import json
import logging
import logging.handlers
import queue
import sys
from datetime import UTC, datetime
from typing import Any

from scheduler import events

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
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")


class _InProcessQueueHandler(logging.handlers.QueueHandler):
    """Hands records to the writer thread as they are: formatting happens there too."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        return record


_listener: logging.handlers.QueueListener | None = None


def setup_logging(fmt: str, level: int = logging.INFO) -> None:
    """Log to stderr from a writer thread, so a run's lines never wait for the terminal.

    `stop_logging` (registered at exit) writes out whatever is still queued.
    """
    global _listener
    stop_logging()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    _listener = logging.handlers.QueueListener(records, handler)
    _listener.start()
    root = logging.getLogger()
    root.handlers[:] = [_InProcessQueueHandler(records)]
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
    global _listener
    if _listener is not None:
        _listener.stop()  # writes every queued record first
        _listener = None


class RunLog:
    """The gate's outcomes as log lines.

    With `structured`, each line also carries the event's fields (for JSON
    logs); text logs say everything in the message and skip building them.
    """

    def __init__(self, logger: logging.Logger | None = None, structured: bool = False) -> None:
        self.log = logger or logging.getLogger("scheduler.runs")
        self.structured = structured

    def __call__(self, event: events.Event) -> None:
        if isinstance(event, events.RunStarted):
            self.log.info(
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
                self.log.warning(
                    "%s: %d earlier run(s) recorded crashed (their replica died or lost the lock)",
                    event.job,
                    event.crashed,
                    extra=self._fields(event, "job", "key"),
                )
        elif isinstance(event, events.RunFinished):
            level = logging.INFO if event.status == "succeeded" else logging.WARNING
            note = "" if event.recorded else " (not recorded: the run had lost its lock)"
            self.log.log(
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
                ),
            )
        elif isinstance(event, events.TickSkipped):
            since = f" since {event.holder_since.isoformat()}" if event.holder_since else ""
            self.log.warning(
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
            self.log.warning(
                "tick missed: %s tick %s could not start within its misfire grace",
                event.job,
                event.scheduled_at.isoformat(),
                extra=self._fields(event, "job", "key", "scheduled_at", "instance"),
            )
        elif isinstance(event, events.SessionUp):
            self.log.info("lock session up (%s)", event.backend, extra={"instance": event.instance})
        elif isinstance(event, events.SessionLost):
            self.log.error(
                "lock session lost: %s; lock_lost set on %s",
                event.reason,
                ", ".join(event.runs) or "no running job",
                extra={"instance": event.instance, "lost_runs": list(event.runs)},
            )

    def _fields(self, event: object, *names: str) -> dict[str, Any] | None:
        if not self.structured:
            return None
        out = {}
        for name in names:
            value = getattr(event, name)
            out[name] = value.isoformat() if isinstance(value, datetime) else value
        return out
