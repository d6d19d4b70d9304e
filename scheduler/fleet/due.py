"""Which ticks of a job were due: the one place that walks a job's schedule over time.

A tick of a job was due if, at that instant, a schedule of the job was in
force and every schedule in force contained it. The schedules in force are
those the replicas registered (scheduler.ledger.registrations): each from its `since`
to its `until`. A replica that changes a job's schedule (a reload, a restart
with another config.yaml) ends the old one there, and the old one keeps
judging the ticks from before; a replica that is gone keeps its schedule in
force until a live replica runs another, so the ticks of a fleet that was down
are judged by the schedule it had. A tick when no schedule was in force, or
that a schedule in force did not contain, was never due and never gets a row.

The sweep (missed ticks), catch-up (`latest` and `all`), a reload (where a
changed schedule starts) and the next ticks shown all ask here; nothing else
walks a schedule (tests/unit/test_due.py keeps it so).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta

from apscheduler.triggers.base import BaseTrigger

from scheduler.config.schedules import next_tick, next_ticks, tick_after, ticks_between
from scheduler.ledger.registrations import Registration
from scheduler.registry.catalog import CatalogJob, trigger_of

_MICROSECOND = timedelta(microseconds=1)
# Ticks of one schedule a look walks at most: schedules that differ (or one that never
# fires) may leave few due ticks among many; beyond this, fewer are answered, never more.
WALK_LIMIT = 100_000


class InForce:
    """The schedules of one job in force over time, as its replicas registered them."""

    def __init__(self, registered: Iterable[Registration]) -> None:
        self.registered = sorted(registered, key=lambda r: (r.since, r.instance))
        self.triggers: dict[str, BaseTrigger | None] = {}
        for r in self.registered:
            if r.schedule is not None and r.schedule not in self.triggers:
                self.triggers[r.schedule] = trigger_of(r.schedule)

    def between(self, after: datetime, until: datetime, limit: int) -> list[datetime]:
        """The latest `limit` ticks in (after, until] that were due, oldest first.

        Each schedule is walked over its own time in force, newest first, as far as
        needed: further when schedules that differ leave fewer due ticks than asked.
        """
        asked = limit
        while limit > 0:
            candidates: set[datetime] = set()
            horizon = None  # below it, a walk that stopped at `asked` may have left ticks
            for r in self.registered:
                trigger = self.triggers.get(r.schedule) if r.schedule is not None else None
                start = max(after, r.since - _MICROSECOND)
                end = until if r.until is None else min(until, r.until)
                if trigger is None or start >= end:
                    continue
                found = ticks_between(trigger, start, end, asked)
                candidates.update(found)
                if len(found) == asked:
                    horizon = max(horizon or found[0], found[0])
            due = sorted(t for t in candidates if self.was_due(t))
            if horizon is None:
                return due[-limit:]
            trusted = [t for t in due if t >= horizon]
            if len(trusted) >= limit or asked >= WALK_LIMIT:
                return trusted[-limit:]
            asked = min(asked * 4, WALK_LIMIT)
        return []

    def was_due(self, tick: datetime) -> bool:
        in_force = [
            r for r in self.registered if r.since <= tick and (r.until is None or tick <= r.until)
        ]
        return bool(in_force) and all(
            r.schedule is not None and _contains(self.triggers.get(r.schedule), tick)
            for r in in_force
        )

    def upcoming(self, live: set[str], start: datetime, n: int) -> list[datetime] | None:
        """The next `n` ticks from `start` on that the live replicas fire: each replica its
        own schedule's, each tick run once. None if no live replica registered the job."""
        running = [r for r in self.registered if r.instance in live and r.until is None]
        if not running:
            return None
        ticks: set[datetime] = set()
        for r in running:
            trigger = self.triggers.get(r.schedule) if r.schedule is not None else None
            if trigger is not None:
                ticks.update(next_ticks(trigger, start - _MICROSECOND, n))
        return sorted(ticks)[:n]


def upcoming(
    job: CatalogJob, registered: Iterable[Registration], live: set[str], start: datetime, n: int
) -> list[datetime]:
    """The job's next `n` ticks from `start` on, as the live replicas fire them; this
    config.yaml's own while no live replica has registered the job."""
    found = InForce(r for r in registered if r.key == job.key).upcoming(live, start, n)
    if found is not None:
        return found
    if not job.scheduled or job.trigger is None:
        return []
    return next_ticks(job.trigger, start - _MICROSECOND, n)


def first_from(job: CatalogJob, since: datetime) -> datetime | None:
    """Where a schedule that comes in force at `since` starts: its first tick at or after
    it (the ticks before were judged by the schedule in force then)."""
    if job.trigger is None:
        return None
    return next_tick(job.trigger, since)


def _contains(trigger: BaseTrigger | None, tick: datetime) -> bool:
    return trigger is not None and tick_after(trigger, tick - _MICROSECOND) == tick
