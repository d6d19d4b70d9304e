"""Reloading config.yaml in a running replica: on SIGHUP, or when the file changes.

What a reload changes: the `jobs:` section (schedules, time zones, thresholds,
grace, enabled) and the settings that are only defaults for it (`timezone`,
`skip_alert_after`, `fail_alert_after`, `misfire_grace`). Every other setting
(the database, the instance name, workers, ports, ...) and the job code are
what the replica started with: a change to them is logged as needing a
restart. Settings from the environment stay as they were, as the environment
does. An invalid file changes nothing: the error is the line `scheduler check`
prints, and the replica keeps its configuration.

A file being written is no configuration: a watched file is read once it has
stayed the same for `SETTLE_S`; a file that changes while it is read is read
again (`Unsettled`); and a file that names no job (empty, cut short, without
`jobs:`) is refused unless it says `jobs: {}`. A reload that could not be
applied for a passing reason (the ledger did not answer, the file was being
written) is tried again, with backoff, until it applies or the file changes
again (`PendingReload`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import yaml

from scheduler.config.schedules import format_duration
from scheduler.config.settings import MAX_CONFIG_BYTES, Config, JobConfig, Settings, load_config
from scheduler.config.urls import redact_http_url
from scheduler.errors import ConfigError
from scheduler.gate import Backoff
from scheduler.registry.catalog import Catalog, CatalogJob, build_catalog, schedule_text
from scheduler.registry.jobs import build_registry

# Settings a reload applies: they only shape the jobs' schedules and thresholds.
APPLIED_ON_RELOAD = frozenset({"timezone", "skip_alert_after", "fail_alert_after", "misfire_grace"})
SETTLE_S = 0.5  # a watched file is read once it has stayed the same this long
RETRY_FIRST_S = 1.0  # a reload that could not be applied is tried again after this,
RETRY_MOST_S = 30.0  # doubling up to this


class Unsettled(Exception):
    """config.yaml changed while it was read: it is being written. Read it again later."""


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
    """config.yaml as it is now, over the job code loaded at start; ConfigError if invalid,
    Unsettled if it changed while it was read."""
    settings = config.settings
    written = _contents(config.path)
    fresh = load_config(
        str(config.path), jobs_path=settings.jobs_path, http_port=settings.http_port
    )
    if _contents(config.path) != written:
        raise Unsettled(f"{config.path}: changed while it was read (being written?)")
    if not fresh.jobs and not _no_jobs_on_purpose(written):
        raise ConfigError(
            f"{config.path}: names no job (empty, cut short, or no jobs: section), as a file"
            " being written would; to unschedule every job on purpose, write jobs: {}"
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


def _contents(path: Path) -> bytes | None:
    try:
        with path.open("rb") as file:
            return file.read(MAX_CONFIG_BYTES + 1)
    except OSError:
        return None


def _no_jobs_on_purpose(written: bytes | None) -> bool:
    """Whether the file says `jobs: {}` (load_config has read the same bytes: safe YAML)."""
    try:
        document = yaml.safe_load(written or b"")
    except yaml.YAMLError:
        return False
    return isinstance(document, dict) and document.get("jobs", None) == {}


class FileWatch:
    """Whether a file changed since the last look: its size, time or inode.

    A change counts once the file has stayed the same for `settle` seconds: an
    editor that truncates and then writes is not seen in between. A Kubernetes
    ConfigMap mount replaces the file by swapping a symbolic link; `stat`
    follows it, so the swap shows as a new inode.
    """

    def __init__(
        self, path: Path, clock: Callable[[], float] = time.monotonic, settle: float = SETTLE_S
    ) -> None:
        self.path = path
        self.clock = clock
        self.settle = settle
        self.seen = self._look()  # the file as it was last reported (or found at the start)
        self._last, self._since = self.seen, clock()  # as it was at the last look, since when

    def changed(self) -> bool:
        now = self._look()
        if now is None:  # gone for a moment (an editor saving): wait
            return False
        if now != self._last:  # changed since the last look: being written, perhaps
            self._last, self._since = now, self.clock()
            return False
        if now == self.seen or self.clock() - self._since < self.settle:
            return False
        self.seen = now
        return True

    def _look(self) -> tuple[int, int, int] | None:
        try:
            found = os.stat(self.path)
        except OSError:
            return None
        return (found.st_mtime_ns, found.st_size, found.st_ino)


class PendingReload:
    """A reload asked for (SIGHUP, or the file changed) and not applied yet.

    It stays asked for until it applies or the file is refused for what it
    says; one that failed for a passing reason is tried again, at once and
    then after 1, 2, 4, ... up to 30 seconds. A new ask starts over.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.why: str | None = None
        self._due = 0.0
        self._backoff = Backoff(RETRY_FIRST_S, RETRY_MOST_S)
        self._said: str | None = None  # the last failure logged

    def ask(self, why: str) -> None:
        self.why, self._said = why, None
        self._backoff.reset()
        self._due = self.clock() + self._backoff.next_delay()  # at once

    def due(self) -> str | None:
        """Why a reload is due now, if one is."""
        return self.why if self.why is not None and self.clock() >= self._due else None

    def failed(self, why: str, error: str) -> bool:
        """Try again later; True when this failure is news (log it), not a repeat."""
        self.why = why
        self._due = self.clock() + self._backoff.next_delay()
        news, self._said = error != self._said, error
        return news

    def settled(self) -> None:
        """Applied, or refused for what the file says: nothing more to try."""
        self.why = None


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
