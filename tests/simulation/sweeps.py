"""Housekeeping's sweep in a simulated fleet: a replica's pass, on the world's clock, and
the registrations it judges ticks by, written as the world records them.

Every grace of the simulated jobs is a year long, so that claims (judged by the
database's own clock, weeks after the ticks) never find a tick late. The sweep
runs on the world's clock and sees each job with no misfire grace (`swept`): a
tick nobody claimed is, in its eyes, missed `MISSED_MARGIN` after it fell due,
so the missed-tick window follows the world's time. A `catch_up: all` job keeps
its catch-up window (a year and a day), and so its ticks, to catch up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine, insert, update

from scheduler.config.settings import Settings
from scheduler.fleet.housekeeping import MISSED_MARGIN, Housekeeping
from scheduler.ledger import tables
from scheduler.ledger.job_states import track_jobs
from scheduler.ledger.registrations import Registration
from scheduler.registry.catalog import Catalog, CatalogJob

RETAINED = 3 * 365  # days: retention is not what is simulated


class SweepClock:
    """A replica's backend as its housekeeping sees it: the clock is the sweep's."""

    def __init__(self, real: Any, clock: Callable[[], datetime]) -> None:
        self._real = real
        self._clock = clock

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def now_expression(self) -> datetime:
        return self._clock()

    def now(self, conn: object) -> datetime:
        return self._clock()


def keeper(
    real: Any, catalog: dict[int, CatalogJob], clock: Callable[[], datetime]
) -> Housekeeping:
    """One replica's housekeeping, over its own backend (its second session)."""
    settings = Settings.model_construct(instance_name=real.instance, retention_days=RETAINED)
    jobs = Catalog(tuple(swept(job) for job in catalog.values()))
    return Housekeeping(SweepClock(real, clock), jobs, settings)  # type: ignore[arg-type]


def swept(job: CatalogJob) -> CatalogJob:
    """The job as the sweep sees it: late as soon as it is due."""
    return replace(job, misfire_grace=timedelta(0))


def missed_bound(job: CatalogJob, sweep_now: datetime) -> datetime:
    """The newest tick of `job` a sweep at `sweep_now` records missed if it has no row."""
    return sweep_now - swept(job).missed_after - MISSED_MARGIN


def write_registrations(engine: Engine, made: list[Registration]) -> None:
    if not made:
        return
    rows = [
        {
            "instance": r.instance,
            "job_key": r.key,
            "job_name": r.name,
            "schedule": r.schedule,
            "since": r.since,
            "until": r.until,
        }
        for r in made
    ]
    with engine.begin() as conn:
        conn.execute(insert(tables.registrations), rows)


def end_registrations(engine: Engine, instance: str, until: datetime) -> None:
    """A replica's schedules end where the world says its process ended."""
    r = tables.registrations
    with engine.begin() as conn:
        conn.execute(
            update(r).where(r.c.instance == instance, r.c.until.is_(None)).values(until=until)
        )


def track(engine: Engine, catalog: dict[int, CatalogJob], since: datetime) -> None:
    """Each job is known to the ledger from when the first fleet ran it."""
    entries = [(job.key, job.name, job.describe()) for job in catalog.values()]
    track_jobs(engine, entries, since)
