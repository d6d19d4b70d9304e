"""Alerts: what each fleet notice says, to people (log, `text`) and to machines (webhook JSON).

Whether a notice is due is decided in the ledger, atomically, in the claim or
finish that changes the streak it is about, so exactly one notice is raised
per streak for the whole fleet; it is written to the outbox in the same
transaction and delivered by `scheduler.observers.notices`. Here a notice only becomes
words.

Events (the `event` field of the webhook body):

- ``job.skips_exceeded``: `skip_alert_after` consecutive ticks of a job found
  its previous run still going: the job is overrunning its schedule.
- ``job.recovered``: a run of the job ended before its next tick was due, and
  no tick was skipped behind it: it keeps up again.
- ``job.failures_exceeded``: `fail_alert_after` consecutive runs of a job failed.
- ``job.failures_recovered``: the job succeeded again after such a streak.
- ``job.paused`` / ``job.resumed``: someone paused the job for the whole fleet
  (`scheduler pause`), or resumed it.
- ``job.schedule_drift``: the live replicas have run different schedules for
  the job for longer than `schedule_drift_grace` (see `scheduler.fleet.agreement`).
- ``job.schedule_agreed``: they run one schedule again.
- ``job.timed_out``: a run passed the job's `timeout` (once per run).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from scheduler.text import printable

SKIPS_EXCEEDED = "job.skips_exceeded"
RECOVERED = "job.recovered"
FAILURES_EXCEEDED = "job.failures_exceeded"
FAILURES_RECOVERED = "job.failures_recovered"
JOB_PAUSED = "job.paused"
JOB_RESUMED = "job.resumed"
SCHEDULE_DRIFT = "job.schedule_drift"
SCHEDULE_AGREED = "job.schedule_agreed"
TIMED_OUT = "job.timed_out"

LEVELS = {
    SKIPS_EXCEEDED: logging.ERROR,
    FAILURES_EXCEEDED: logging.ERROR,
    SCHEDULE_DRIFT: logging.ERROR,
    TIMED_OUT: logging.ERROR,
    RECOVERED: logging.WARNING,
    FAILURES_RECOVERED: logging.WARNING,
}


def slack_text(text: str) -> str:
    """Text as Slack's message format reads it literally: a job's error or a pause reason
    that says `<!channel>` is shown, not obeyed (no mention, no link)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


@dataclass(frozen=True)
class Notice:
    """One row of the outbox."""

    id: int
    event: str
    job: str
    key: int
    scheduled_at: datetime | None
    facts: dict[str, Any]
    raised_by: str
    raised_at: datetime
    attempts: int

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Notice:
        try:
            facts = json.loads(row["facts"])
        except ValueError:
            facts = {}
        return cls(
            id=int(row["id"]),
            event=row["event"],
            job=row["job_name"],
            key=int(row["job_key"]),
            scheduled_at=row["scheduled_at"],
            facts=facts if isinstance(facts, dict) else {},
            raised_by=row["raised_by"],
            raised_at=row["raised_at"],
            attempts=int(row["attempts"]),
        )

    @property
    def level(self) -> int:
        return LEVELS.get(self.event, logging.WARNING)

    def text(self) -> str:
        """One human sentence (Slack shows it: the webhook body's `text`)."""
        f = self.facts
        if self.event == SKIPS_EXCEEDED:
            running = f.get("running_s")
            held = f" (running for {running:.0f} s)" if isinstance(running, int | float) else ""
            return (
                f"{self.job}: {f.get('consecutive_skips')} consecutive ticks skipped: the job is "
                f"overrunning its schedule; the run on {f.get('holder') or 'an unknown replica'} "
                f"is still going{held}"
            )
        if self.event == RECOVERED:
            return (
                f"{self.job}: keeping up again: a run on {f.get('instance')} ended before its "
                f"next tick, after {f.get('consecutive_skips')} skipped ticks"
            )
        if self.event == FAILURES_EXCEEDED and f.get("crashed"):
            why = f.get("error") or "its replica died or lost the job's lock"
            return (
                f"{self.job}: {f.get('consecutive_failures')} consecutive runs failed or "
                f"crashed; the last crashed ({why}), found by {f.get('instance')}"
            )
        if self.event == FAILURES_EXCEEDED:
            return (
                f"{self.job}: {f.get('consecutive_failures')} consecutive runs failed; "
                f"the last on {f.get('instance')}: {f.get('error')}"
            )
        if self.event == FAILURES_RECOVERED:
            return (
                f"{self.job}: succeeded again on {f.get('instance')} after "
                f"{f.get('consecutive_failures')} consecutive failed runs"
            )
        if self.event == JOB_PAUSED:
            why = f": {f.get('reason')}" if f.get("reason") else ""
            return f"{self.job}: paused for the fleet by {f.get('by')}{why}"
        if self.event == JOB_RESUMED:
            return (
                f"{self.job}: resumed by {f.get('by')} (paused by {f.get('paused_by')} "
                f"since {f.get('paused_at')})"
            )
        if self.event == TIMED_OUT:
            return (
                f"{self.job}: run {f.get('run_id')} on {f.get('instance')} passed its timeout"
                f" of {f.get('timeout')}; told to stop (ctx.timed_out), it keeps the job's lock"
                " until it returns, and is recorded failed"
            )
        if self.event in (SCHEDULE_DRIFT, SCHEDULE_AGREED):
            said = "; ".join(
                f"{v.get('schedule')} on {', '.join(v.get('instances') or [])}"
                for v in f.get("schedules") or []
                if isinstance(v, dict)
            )
            if self.event == SCHEDULE_AGREED:
                return f"{self.job}: the live replicas run one schedule again: {said}"
            return (
                f"{self.job}: the live replicas have run different schedules since "
                f"{f.get('since')}: {said}; every tick some live replica's schedule has runs once"
            )
        return f"{self.job}: {self.event}"

    def body(self) -> dict[str, Any]:
        """The webhook's JSON (Slack-compatible through `text`); `notice_id` tells repeats.

        Only `text` is escaped for Slack: the other fields are data, as they were said.
        """
        return {
            "event": self.event,
            "job": self.job,
            "key": self.key,
            **self.facts,
            "scheduled_at": self.scheduled_at.isoformat() if self.scheduled_at else None,
            "raised_by": self.raised_by,
            "notice_id": self.id,
            "text": slack_text(self.text()),
        }

    def log_line(self) -> str:
        return printable(f"ALERT {self.event}: {self.text()}")
