"""Reloading config.yaml in a running replica: on SIGHUP, or when the file changes.

What a reload changes: the `jobs:` section (schedules, time zones, thresholds,
grace, enabled) and the settings that are only defaults for it (`timezone`,
`skip_alert_after`, `fail_alert_after`, `misfire_grace`). Every other setting
(the database, the instance name, workers, ports, ...) and the job code are
what the replica started with: a change to them is logged as needing a
restart. Settings from the environment stay as they were, as the environment
does. An invalid file changes nothing: the error is the line `scheduler check`
prints, and the replica keeps its configuration.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from scheduler.catalog import Catalog, CatalogJob, build_catalog, schedule_text
from scheduler.config import Config, JobConfig, Settings, load_config
from scheduler.errors import ConfigError
from scheduler.registry import build_registry
from scheduler.schedules import format_duration
from scheduler.urls import redact_http_url

# Settings a reload applies: they only shape the jobs' schedules and thresholds.
APPLIED_ON_RELOAD = frozenset({"timezone", "skip_alert_after", "fail_alert_after", "misfire_grace"})


@dataclass(frozen=True)
class Reloaded:
    config: Config
    catalog: Catalog
    restart_needed: tuple[str, ...]  # settings that changed but apply at the next restart

    def changes(self, before: Catalog) -> list[str]:
        """What the reload changes for the jobs, one line per job, for the log: the schedule
        and thresholds ("old -> new"), then every other field that changed. A job that
        differs in any way is never said unchanged."""
        out = []
        for job in self.catalog:
            old = before.by_key(job.key)
            if old is None or old == job:
                continue
            said = [f"{_said(old)} -> {_said(job)}"] if _shape(old) != _shape(job) else []
            theirs, mine = _fields(old), _fields(job)
            said += [
                f"{name} {_value(name, theirs[name])} -> {_value(name, mine[name])}"
                for name in mine
                if theirs[name] != mine[name]
            ]
            out.append(f"{job.name}: {'; '.join(said) or 'changed'}")
        return out


def reread(config: Config, catalog: Catalog) -> Reloaded:
    """config.yaml as it is now, over the job code loaded at start; ConfigError if invalid."""
    settings = config.settings
    fresh = load_config(
        str(config.path), jobs_path=settings.jobs_path, http_port=settings.http_port
    )
    registry = build_registry(job.spec for job in catalog)
    try:
        new_catalog = build_catalog(fresh, registry)
    except ConfigError as exc:
        raise ConfigError(
            f"{exc} (job code is loaded at start: a new job needs a restart)"
        ) from None
    changed = tuple(
        name
        for name in Settings.model_fields
        if name not in APPLIED_ON_RELOAD
        and getattr(fresh.settings, name) != getattr(settings, name)
    )
    return Reloaded(fresh, new_catalog, changed)


class FileWatch:
    """Whether a file changed since the last look: its size, time or inode.

    A Kubernetes ConfigMap mount replaces the file by swapping a symbolic link;
    `stat` follows it, so the swap shows as a new inode.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen = self._look()

    def changed(self) -> bool:
        now = self._look()
        if now is None or now == self.seen:  # gone for a moment (an editor saving): wait
            return False
        self.seen = now
        return True

    def _look(self) -> tuple[int, int, int] | None:
        try:
            found = os.stat(self.path)
        except OSError:
            return None
        return (found.st_mtime_ns, found.st_size, found.st_ino)


def _shape(job: CatalogJob) -> tuple[object, ...]:
    return (
        schedule_text(job),
        job.skip_threshold,
        job.fail_threshold,
        job.misfire_grace,
        job.timezone,
    )


# What `_said` tells of a job; `_fields` is every other field of its entry in config.yaml.
SAID_BY_SHAPE = frozenset(
    {"cron", "interval", "start", "spread", "enabled", "timezone"}
    | {"skip_alert_after", "fail_alert_after", "misfire_grace"}
)
UNSET = {name: field.default for name, field in JobConfig.model_fields.items()}


def _fields(job: CatalogJob) -> dict[str, object]:
    entry = job.schedule.model_dump() if job.schedule is not None else dict(UNSET)
    entry.update(retries=job.retries, retry_delay=job.retry_delay)  # with their defaults
    entry.update(retry_delay_max=job.retry_delay_max)
    return {name: value for name, value in entry.items() if name not in SAID_BY_SHAPE}


def _value(name: str, value: object) -> str:
    """A field's value for the log; a URL by its scheme and host (its path is a secret)."""
    if value is None:
        return "unset"
    if isinstance(value, timedelta):
        return format_duration(value)
    if name.endswith("_url"):
        return redact_http_url(str(value))
    return str(value)


def _said(job: CatalogJob) -> str:
    grace = job.misfire_grace.total_seconds()
    return (
        f"{job.describe()} in {job.timezone}, alerts after {job.skip_threshold} skips"
        f" / {job.fail_threshold} failures, grace {grace:g} s"
    )
