"""Jobs on the same schedule share one APScheduler job; each still gets every tick."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

from scheduler.config.settings import JobConfig
from scheduler.daemon import GateExecutor, build_scheduler
from scheduler.registry.catalog import Catalog, CatalogJob, schedule_key
from scheduler.registry.jobs import JobSpec


def job(name: str, key: int, tz: str = "UTC", **schedule: object) -> CatalogJob:
    config = JobConfig(**schedule)
    spec = JobSpec(
        key=key, name=name, func=lambda: None, takes_context=False, is_async=False, source="t"
    )
    return CatalogJob(
        spec=spec,
        schedule=config,
        timezone=tz,
        skip_threshold=3,
        fail_threshold=3,
        misfire_grace=timedelta(seconds=30),
    )


class FakeGate:
    def __init__(self) -> None:
        self.submitted: list[tuple[list[str], datetime]] = []

    def submit_all(self, jobs: list[CatalogJob], tick: datetime) -> None:
        self.submitted.append(([j.name for j in jobs], tick))

    @contextlib.contextmanager
    def burst(self) -> Iterator[None]:
        yield


def test_equal_schedules_share_one_trigger_and_each_job_gets_the_tick():
    catalog = Catalog(
        (
            job("a", 1, interval="1s"),
            job("b", 2, interval=1),
            job("c", 3, cron="*/5 * * * *"),
            job("d", 4, cron="*/5  *  * * *"),  # the same cron, spelled with more spaces
            job("e", 5, cron="*/5 * * * *", timezone="Europe/Berlin", tz="Europe/Berlin"),
            job("f", 6, interval="1s", start="2024-01-01T00:00:00.5Z"),
        )
    )
    gate = FakeGate()
    scheduler = build_scheduler(catalog, gate)  # type: ignore[arg-type]
    groups = sorted(sorted(g) for g in _groups(scheduler).values())
    assert groups == [["a", "b"], ["c", "d"], ["e"], ["f"]]

    executor = scheduler._lookup_executor("default")
    assert isinstance(executor, GateExecutor)
    tick = datetime(2026, 1, 1, 12, 0, 5, tzinfo=UTC)
    aps_job = next(j for j in scheduler.get_jobs() if "a" in _groups(scheduler)[j.id])
    executor.submit_job(aps_job, [tick])
    assert gate.submitted == [(["a", "b"], tick)]


def test_a_naive_start_means_the_same_instant_in_the_jobs_zone():
    naive = JobConfig(interval="1h", start="2024-01-01T09:00:00")
    aware = JobConfig(interval="1h", start="2024-01-01T08:00:00+00:00")
    assert schedule_key(naive, "Europe/Berlin") == schedule_key(aware, "Europe/Berlin")
    assert schedule_key(naive, "UTC") != schedule_key(aware, "UTC")


def _groups(scheduler) -> dict[str, list[str]]:
    executor = scheduler._lookup_executor("default")
    return {name: [j.name for j in jobs] for name, jobs in executor.groups.items()}
