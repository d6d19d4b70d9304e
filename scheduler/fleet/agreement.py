"""Whether the live replicas agree on each job's schedule, and when to say they do not.

Each replica registers, for each job, the canonical text of what decides its
ticks (`catalog.schedule_text`: interval and start, or cron and zone; none
when the job is disabled or unscheduled) in its registrations
(scheduler.ledger.registrations). Replicas that register different texts fire
different ticks: normal for the length of a rolling deploy or of a reload not yet
sent to all. Once a disagreement has lasted `schedule_drift_grace`, the fleet is
told once (`job.schedule_drift`), and once more when it ends (`job.schedule_agreed`).
Pure decisions here; the housekeeping sweep keeps the state in the ledger.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta

from scheduler.config.schedules import format_duration
from scheduler.ledger.registrations import Registration
from scheduler.observers import alerts


@dataclass(frozen=True)
class Variant:
    """One schedule of a job, and the live replicas that run it."""

    schedule: str | None  # canonical text (catalog.schedule_text)
    instances: tuple[str, ...]

    def as_json(self) -> dict[str, object]:
        return {"schedule": words(self.schedule), "instances": list(self.instances)}


def live_schedules(registered: list[Registration], live: set[str]) -> dict[int, list[Variant]]:
    """Job key -> the schedules its live replicas run now (one when they agree)."""
    by_job: dict[int, dict[str | None, list[str]]] = {}
    for r in registered:
        if r.instance in live and r.until is None:
            by_job.setdefault(r.key, {}).setdefault(r.schedule, []).append(r.instance)
    return {
        key: sorted(
            (Variant(text, tuple(sorted(names))) for text, names in variants.items()),
            key=lambda v: v.instances,
        )
        for key, variants in by_job.items()
    }


def words(text: str | None) -> str:
    """A registered schedule as people read it: every 5m, cron 0 2 * * * in Europe/Berlin."""
    if text is None:
        return "not scheduled (disabled, or no schedule)"
    try:
        body = json.loads(text)
        offset = float(body.get("offset") or 0)
        shift = f" +{format_duration(timedelta(seconds=offset))}" if offset else ""
        if "interval" in body:
            every = format_duration(timedelta(seconds=float(body["interval"])))
            start = body.get("start")
            return f"every {every}" + (f" from {start}" if start else "") + shift
        return f"cron {body['cron']} in {body['timezone']}{shift}"
    except (ValueError, TypeError, KeyError, AttributeError):
        return f"unreadable ({text[:80]})"  # written by another version


@dataclass(frozen=True)
class Drift:
    """A job's disagreement as the ledger keeps it (scheduler_jobs)."""

    since: datetime | None = None  # when the live replicas were first seen to disagree
    alerted: bool = False  # job.schedule_drift was raised for it


def step(state: Drift, differ: bool, now: datetime, grace: timedelta) -> tuple[Drift, str | None]:
    """The next state, and the notice it raises (if any)."""
    if differ:
        since = state.since or now
        if not state.alerted and now - since >= grace:
            return Drift(since, True), alerts.SCHEDULE_DRIFT
        return Drift(since, state.alerted), None
    if state.since is None:
        return state, None
    return Drift(), alerts.SCHEDULE_AGREED if state.alerted else None
