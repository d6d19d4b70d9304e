"""A job's schedule in words, and as written in config.yaml.

The words cover the common shapes (every N units; a time every day, every
hour, on weekdays); any other cron expression is said as "on a cron
schedule", and the expression as written is always shown beside it.
"""

from __future__ import annotations

from datetime import timedelta

from scheduler.config.schedules import format_duration
from scheduler.registry.catalog import CatalogJob

UNITS = (("day", 86400), ("hour", 3600), ("minute", 60), ("second", 1))
DAYS = {"*": "every day", "1-5": "on weekdays", "0,6": "on weekends", "6,0": "on weekends"}


def as_written(job: CatalogJob) -> str:
    schedule = job.schedule
    if schedule is None:
        return "(no schedule in config.yaml)"
    if schedule.interval is not None:
        text = f"interval: {format_duration(schedule.interval)}"
        if schedule.start is not None:
            text += f", start: {schedule.start.isoformat()}"
    else:
        text = f"cron: {schedule.cron}"
    if schedule.spread is not None:
        text += f", spread: {format_duration(schedule.spread)}"
    return text if schedule.enabled else f"{text}, enabled: false"


def in_words(job: CatalogJob) -> str:
    schedule = job.schedule
    if schedule is None:
        return "not scheduled: runs only when asked"
    if schedule.interval is not None:
        text = every(schedule.interval)
    else:
        text = cron_words(schedule.cron or "")
    if not schedule.enabled:
        text += " (disabled)"
    return text


def every(delta: timedelta) -> str:
    seconds = delta.total_seconds()
    for unit, size in UNITS:
        if seconds >= size and seconds % size == 0:
            count = int(seconds // size)
            return f"every {unit}" if count == 1 else f"every {count} {unit}s"
    return f"every {format_duration(delta)}"


def cron_words(expr: str) -> str:
    fields = expr.split()
    if len(fields) != 5:
        return "on a cron schedule (with seconds)"
    minute, hour, day, month, weekday = fields
    if day != "*" or month != "*" or weekday not in DAYS:
        return "on a cron schedule"
    when = DAYS[weekday]
    if minute == "*" and hour == "*":
        return "every minute" if weekday == "*" else f"every minute {when}"
    if minute.startswith("*/") and minute[2:].isdigit() and hour == "*":
        return f"every {minute[2:]} minutes" + ("" if weekday == "*" else f" {when}")
    if minute.isdigit() and hour == "*":
        return f"every hour at minute {int(minute)}" + ("" if weekday == "*" else f" {when}")
    if minute.isdigit() and hour.isdigit():
        return f"{when} at {int(hour):02d}:{int(minute):02d}"
    return "on a cron schedule"
