"""Logging: `text` for people, `json` (one object per line) for log pipelines.

`RunLog` observes the gate and writes one line when a run starts, one when it
ends, one per skip, per missed tick and per lost session.
"""

from __future__ import annotations

import json
import logging
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


def setup_logging(fmt: str, level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("apscheduler").setLevel(logging.WARNING)


class RunLog:
    """The gate's outcomes as log lines."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self.log = logger or logging.getLogger("scheduler.runs")

    def __call__(self, event: events.Event) -> None:
        if isinstance(event, events.RunStarted):
            self.log.info(
                "run started: %s tick %s run_id %d (%.3f s late)",
                event.job,
                event.scheduled_at.isoformat(),
                event.run_id,
                event.lateness_s,
                extra=_fields(
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
                    extra=_fields(event, "job", "key"),
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
                extra=_fields(
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
                extra=_fields(
                    event, "job", "key", "scheduled_at", "instance", "holder", "consecutive_skips"
                ),
            )
        elif isinstance(event, events.TickMissed):
            self.log.warning(
                "tick missed: %s tick %s could not start within its misfire grace",
                event.job,
                event.scheduled_at.isoformat(),
                extra=_fields(event, "job", "key", "scheduled_at", "instance"),
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


def _fields(event: object, *names: str) -> dict[str, Any]:
    out = {}
    for name in names:
        value = getattr(event, name)
        out[name] = value.isoformat() if isinstance(value, datetime) else value
    return out
