"""The gate's outcomes as log lines: one when a run starts, one when it ends, one per
skipped, missed or paused tick, one when the lock session is up or lost.

With `structured`, each line also carries the event's fields (for JSON logs);
text logs say everything in the message and skip building them. While the
log writer thread runs (`logs.setup_logging`), the lines are built there:
the thread that starts or finishes a run only queues the event.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime
from typing import Any

from scheduler import logs
from scheduler.observers import events
from scheduler.statuses import Status


class RunLog(events.Observer):
    def __init__(self, logger: logging.Logger | None = None, structured: bool = False) -> None:
        self.log = logger or logging.getLogger("scheduler.runs")
        self.structured = structured

    def __call__(self, event: events.Event) -> None:
        created = time.time()
        own_handlers = not self.log.propagate or self.log.handlers
        if not own_handlers and logs.defer(
            lambda: self.records(event, created), type(event).__name__
        ):
            return
        for record in self.records(event, created):
            self.log.handle(record)

    def records(self, event: events.Event, created: float) -> list[logging.LogRecord]:
        """The lines for one event, stamped with the time it happened."""
        lines = _Lines(self, created)
        lines(event)
        return lines.out


class _Lines(events.Observer):
    """Builds the records of one event (one method per kind of event)."""

    def __init__(self, run_log: RunLog, created: float) -> None:
        self.log, self.structured, self.created = run_log.log, run_log.structured, created
        self.out: list[logging.LogRecord] = []

    def add(self, level: int, msg: str, *args: object, extra: dict[str, Any] | None) -> None:
        if self.log.isEnabledFor(level):
            record = self.log.makeRecord(
                self.log.name, level, "(unknown file)", 0, msg, args, None, extra=extra
            )
            record.created = self.created
            record.msecs = (self.created - int(self.created)) * 1000
            self.out.append(record)

    def fields(self, event: object, *names: str) -> dict[str, Any] | None:
        if not self.structured:
            return None
        out = {}
        for name in names:
            value = getattr(event, name)
            out[name] = value.isoformat() if isinstance(value, datetime) else value
        return out

    def run_started(self, event: events.RunStarted) -> None:
        self.add(
            logging.INFO,
            "run started: %s tick %s run_id %d (%.3f s late)",
            event.job,
            event.scheduled_at.isoformat(),
            event.run_id,
            event.lateness_s,
            extra=self.fields(
                event, "job", "key", "scheduled_at", "run_id", "instance", "lateness_s", "manual"
            ),
        )
        if event.crashed:
            self.add(
                logging.WARNING,
                "%s: %d earlier run(s) recorded crashed (their replica died or lost the lock)",
                event.job,
                event.crashed,
                extra=self.fields(event, "job", "key"),
            )

    def run_finished(self, event: events.RunFinished) -> None:
        level = logging.INFO if event.status == Status.SUCCEEDED else logging.WARNING
        note = "" if event.recorded else " (not recorded: the run had lost its lock)"
        if event.told:
            note += f" (told: {event.told})"
        if event.retry_in_s is not None:
            note += f" (attempt {event.attempt}; the next is due in {event.retry_in_s:g} s)"
        elif event.attempt > 1:
            note += f" (attempt {event.attempt})"
        self.add(
            level,
            "run %s: %s tick %s run_id %d in %.3f s%s%s",
            event.status,
            event.job,
            event.scheduled_at.isoformat(),
            event.run_id,
            event.duration_s,
            f": {event.error}" if event.error else "",
            note,
            extra=self.fields(
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
                "attempt",
            ),
        )

    def tick_skipped(self, event: events.TickSkipped) -> None:
        since = f" since {event.holder_since.isoformat()}" if event.holder_since else ""
        self.add(
            logging.WARNING,
            "tick skipped: %s tick %s, previous run still going on %s%s (%d consecutive skip(s))",
            event.job,
            event.scheduled_at.isoformat(),
            event.holder or "?",
            since,
            event.consecutive_skips,
            extra=self.fields(
                event, "job", "key", "scheduled_at", "instance", "holder", "consecutive_skips"
            ),
        )

    def tick_missed(self, event: events.TickMissed) -> None:
        self.add(
            logging.WARNING,
            "tick missed: %s tick %s could not start within its misfire grace",
            event.job,
            event.scheduled_at.isoformat(),
            extra=self.fields(event, "job", "key", "scheduled_at", "instance"),
        )

    def run_timed_out(self, event: events.RunTimedOut) -> None:
        self.add(
            logging.WARNING,
            "run timed out: %s tick %s (run %d) passed its timeout of %gs; told (ctx.timed_out),"
            " it keeps the lock until it returns",
            event.job,
            event.scheduled_at.isoformat(),
            event.run_id,
            event.timeout_s,
            extra=self.fields(event, "job", "key", "scheduled_at", "run_id", "instance"),
        )

    def tick_paused(self, event: events.TickPaused) -> None:
        """DEBUG: a paused job has one such line per tick; the pause itself is the news."""
        self.add(
            logging.DEBUG,
            "tick paused: %s tick %s recorded paused (the job is paused for the fleet)",
            event.job,
            event.scheduled_at.isoformat(),
            extra=self.fields(event, "job", "key", "scheduled_at", "instance"),
        )

    def lock_session_up(self, event: events.LockSessionUp) -> None:
        self.add(
            logging.INFO, "lock session up (%s)", event.backend, extra={"instance": event.instance}
        )

    def lock_session_lost(self, event: events.LockSessionLost) -> None:
        self.add(
            logging.ERROR,
            "lock session lost: %s; lock_lost set on %s",
            event.reason,
            ", ".join(event.runs) or "no running job",
            extra={"instance": event.instance, "lost_runs": list(event.runs)},
        )

    def locks_released(self, event: events.LocksReleased) -> None:
        jobs = ", ".join(name or f"key {key}" for key, name in event.jobs)
        if event.after is None:
            self.add(
                logging.ERROR,
                "stray lock(s) released: %s held with no run in flight on this replica",
                jobs,
                extra={"instance": event.instance, "jobs": [key for key, _ in event.jobs]},
            )
        else:
            self.add(
                logging.WARNING,
                "gave back lock(s) of %s left by a failed %s",
                jobs,
                event.after,
                extra={"instance": event.instance, "jobs": [key for key, _ in event.jobs]},
            )
