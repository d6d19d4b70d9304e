"""The catalog: every registered job joined with its schedule from config.yaml.

What `scheduler jobs` prints and what the daemon loads into APScheduler. A
leaf like its inputs: no database code.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from apscheduler.triggers.base import BaseTrigger

from scheduler.config.schedules import (
    Schedule,
    Shifted,
    cron_trigger,
    format_duration,
    interval_trigger,
    next_tick,
    next_ticks,
    spread_offset,
    zone,
)
from scheduler.config.settings import Config, JobConfig
from scheduler.errors import ConfigError
from scheduler.registry.jobs import JobSpec, Registry, build_registry, discover, import_modules


@dataclass(frozen=True)
class CatalogJob:
    spec: JobSpec
    schedule: JobConfig | None
    timezone: str
    skip_threshold: int
    fail_threshold: int
    misfire_grace: timedelta
    retries: int = 0  # more attempts of a failed tick
    retry_delay: timedelta = timedelta(seconds=10)  # before the first retry, then doubling
    retry_delay_max: timedelta = timedelta(minutes=10)
    # Derived from the schedule: jobs with equal keys fire at exactly the same
    # ticks (see `schedule_key`), and the trigger computes them.
    schedule_key: tuple[object, ...] | None = field(init=False)
    trigger: BaseTrigger | None = field(init=False, compare=False)
    # Copied from the spec (read for every tick, so plain attributes).
    name: str = field(init=False)
    key: int = field(init=False)
    log: logging.Logger = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        key = schedule_key(self.schedule, self.timezone, self.spec.key) if self.schedule else None
        object.__setattr__(self, "schedule_key", key)
        object.__setattr__(self, "trigger", trigger_for(key) if key else None)
        object.__setattr__(self, "name", self.spec.name)
        object.__setattr__(self, "key", self.spec.key)
        object.__setattr__(self, "log", logging.getLogger(f"scheduler.job.{self.spec.name}"))

    @property
    def enabled(self) -> bool:
        return self.schedule is not None and self.schedule.enabled

    @property
    def scheduled(self) -> bool:
        """Fires on its own: scheduled in config.yaml and enabled."""
        return self.enabled and self.trigger is not None

    def retry_in(self, attempt: int) -> timedelta | None:
        """How long after failed attempt `attempt` (1: the first) the next is due; None: no
        attempt is left."""
        if attempt > self.retries:
            return None
        factor: int = 2 ** min(attempt - 1, 30)
        return min(self.retry_delay * factor, self.retry_delay_max)

    @property
    def catch_up_window(self) -> timedelta:
        """How far back `catch_up: all` looks (default: the misfire grace)."""
        window = self.schedule.catch_up_window if self.schedule else None
        return window or self.misfire_grace

    @property
    def missed_after(self) -> timedelta:
        """How late a tick without a row is recorded missed by the sweep: a `catch_up: all`
        job's ticks stay catchable for its whole window."""
        if self.schedule is not None and self.schedule.catch_up == "all":
            return max(self.misfire_grace, self.catch_up_window)
        return self.misfire_grace

    @property
    def timeout(self) -> timedelta | None:
        return self.schedule.timeout if self.schedule else None

    @property
    def ping_url(self) -> str | None:
        return self.schedule.ping_url if self.schedule else None

    def describe(self) -> str:
        if self.schedule is None:
            return "unscheduled"
        if self.schedule.interval is not None:
            text = f"every {format_duration(self.schedule.interval)}"
        else:
            text = f"cron {self.schedule.cron}"
        if self.schedule.spread and self.schedule_key is not None:
            offset = self.schedule_key[3]
            assert isinstance(offset, timedelta)
            shift = format_duration(offset) if offset else "0s"
            text += f", spread {format_duration(self.schedule.spread)} (+{shift})"
        return text if self.schedule.enabled else f"{text} (disabled)"

    def next_tick(self, now: datetime) -> datetime | None:
        """The first tick at or after `now` (UTC), if the job fires on its own."""
        if not self.scheduled or self.trigger is None:
            return None
        return next_tick(self.trigger, now)

    def next_ticks(self, after: datetime, n: int) -> list[datetime]:
        """The next `n` ticks strictly after `after` (UTC); none if it does not fire on its own."""
        if not self.scheduled or self.trigger is None:
            return []
        return next_ticks(self.trigger, after, n)

    def local(self, tick: datetime) -> str:
        """A tick as ISO-8601 in the job's time zone, with its offset at that instant."""
        return tick.astimezone(zone(self.timezone)).isoformat()

    def as_json(self, now: datetime) -> dict[str, object]:
        """What `scheduler jobs` and `scheduler status` say of every job."""
        tick = self.next_tick(now)
        return {
            "name": self.name,
            "key": self.key,
            "schedule": self.describe(),
            "timezone": self.timezone,
            "enabled": self.enabled,
            "next_tick": self.local(tick) if tick else None,
        }


@dataclass(frozen=True)
class Catalog:
    jobs: tuple[CatalogJob, ...]
    # Indexes (a gate asks by key for every request and retry; thousands of jobs).
    _by_key: dict[int, CatalogJob] = field(init=False, repr=False, compare=False)
    _by_name: dict[str, CatalogJob] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_key", {job.key: job for job in self.jobs})
        object.__setattr__(self, "_by_name", {job.name: job for job in self.jobs})

    def __iter__(self) -> Iterator[CatalogJob]:
        return iter(self.jobs)

    def __len__(self) -> int:
        return len(self.jobs)

    def by_name(self, name: str) -> CatalogJob | None:
        return self._by_name.get(name)

    def by_key(self, key: int) -> CatalogJob | None:
        return self._by_key.get(key)

    @property
    def scheduled(self) -> tuple[CatalogJob, ...]:
        return tuple(job for job in self.jobs if job.scheduled)


def schedule_key(schedule: JobConfig, timezone: str, job_key: int = 0) -> tuple[object, ...]:
    """What decides a schedule's ticks, and nothing else: (kind, value, where, offset).

    Jobs whose keys are equal fire at the same instants, so the daemon gives
    them one APScheduler job: a thousand jobs on one grid cost APScheduler
    one job, not a thousand, and reach the gate as one burst. A `spread`
    gives each job its own offset (from its key), and so its own instants.
    """
    offset = spread_offset(job_key, schedule.spread) if schedule.spread else timedelta(0)
    if schedule.interval is not None:
        start = schedule.start
        if start is not None and start.tzinfo is None:
            start = start.replace(tzinfo=zone(timezone))
        return ("interval", schedule.interval, start.astimezone(UTC) if start else None, offset)
    assert schedule.cron is not None
    return ("cron", " ".join(schedule.cron.split()), timezone, offset)


def trigger_for(key: tuple[object, ...]) -> BaseTrigger:
    """The trigger of a schedule, from its `schedule_key`."""
    kind, value, where, offset = key
    base: Schedule
    if kind == "interval":
        assert isinstance(value, timedelta) and (where is None or isinstance(where, datetime))
        base = interval_trigger(value, where)
    else:
        assert isinstance(value, str) and isinstance(where, str)
        base = cron_trigger(value, zone(where))
    assert isinstance(offset, timedelta)
    return Shifted(base, offset) if offset else base


def schedule_text(job: CatalogJob) -> str | None:
    """The job's schedule as the replicas write it down and compare it (JSON, canonical).

    None for a job that does not fire on its own (unscheduled or disabled). Two
    replicas fire a job at the same ticks exactly when their texts are equal.
    """
    if not job.scheduled or job.schedule_key is None:
        return None
    kind, value, where, offset = job.schedule_key
    if kind == "interval":
        assert isinstance(value, timedelta) and (where is None or isinstance(where, datetime))
        body: dict[str, object] = {
            "interval": value.total_seconds(),
            "start": where.isoformat() if where else None,
        }
    else:
        body = {"cron": value, "timezone": where}
    if offset:  # absent without a spread: texts stay those of earlier versions
        assert isinstance(offset, timedelta)
        body["offset"] = offset.total_seconds()
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


def trigger_of(text: str) -> BaseTrigger | None:
    """The trigger a replica's written-down schedule stands for; None if it cannot be read
    (written by another version): such a schedule is never taken to contain a tick."""
    try:
        body = json.loads(text)
        offset = timedelta(seconds=float(body.get("offset") or 0))
        if "interval" in body:
            start = datetime.fromisoformat(body["start"]) if body["start"] else None
            return trigger_for(("interval", timedelta(seconds=body["interval"]), start, offset))
        return trigger_for(("cron", body["cron"], body["timezone"], offset))
    except (ValueError, TypeError, KeyError, AssertionError, OverflowError):
        return None


def build_trigger(schedule: JobConfig, timezone: str, job_key: int = 0) -> BaseTrigger:
    return trigger_for(schedule_key(schedule, timezone, job_key))


def build_catalog(config: Config, registry: Registry) -> Catalog:
    """Join jobs and schedules; a schedule for a job that does not exist is an error."""
    settings = config.settings
    missing = sorted(set(config.jobs) - set(registry.jobs))
    if missing:
        known = ", ".join(sorted(registry.jobs)) or "none"
        raise ConfigError(
            f"{config.path}: jobs.{missing[0]}: no job named {missing[0]!r} in "
            f"{settings.resolved_jobs_path}/ (jobs found: {known})"
        )
    jobs = []
    for spec in sorted(registry.jobs.values(), key=lambda s: s.name):
        schedule = config.jobs.get(spec.name)
        tz = settings.job_timezone(schedule) if schedule else settings.timezone
        retries, retry_delay, retry_delay_max = settings.retry_policy(schedule)
        jobs.append(
            CatalogJob(
                spec=spec,
                schedule=schedule,
                timezone=tz,
                skip_threshold=settings.skip_threshold(schedule),
                fail_threshold=settings.fail_threshold(schedule),
                misfire_grace=settings.grace(schedule),
                retries=retries,
                retry_delay=retry_delay,
                retry_delay_max=retry_delay_max,
            )
        )
    return Catalog(tuple(jobs))


def load_catalog(config: Config) -> Catalog:
    """The jobs folder's jobs and those of the `modules` setting, with their schedules.

    With `modules` and no `jobs_path` set, a missing `jobs/` folder is no error:
    an application's jobs live in its own package.
    """
    settings = config.settings
    folder = settings.resolved_jobs_path
    specs: list[JobSpec] = []
    if settings.jobs_path is not None or not settings.modules or folder.is_dir():
        specs.extend(discover(folder).jobs.values())
    specs.extend(import_modules(settings.modules))
    return build_catalog(config, build_registry(specs))
