"""The simulated fleet's jobs: catalog entries whose runs the simulation plays itself.

Ticks lie around a DST change of 2026 in Europe/Berlin (autumn or spring, by
the seed), weeks before the database's clock: every grace is a year long, so
nothing is missed by lateness, and every outcome comes from the protocol.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from scheduler.config.settings import JobConfig
from scheduler.registry.catalog import CatalogJob
from scheduler.registry.jobs import JobSpec

YEAR = timedelta(days=365)
# Autumn: 20 s into the repeated hour (02:00:20 CET, after 02:59 CEST), where every
# replica's walk starts. Spring: 30 s before 01:59:59 CET is followed by 03:00 CEST.
AUTUMN = datetime(2026, 10, 25, 1, 0, 20, tzinfo=UTC)
SPRING = datetime(2026, 3, 29, 0, 59, 30, tzinfo=UTC)

FAST, SLOW, BERLIN, NIGHT = 7001, 7002, 7003, 7004
KEYS = (FAST, SLOW, BERLIN, NIGHT)


def _never(_ctx: object) -> None:
    raise AssertionError("simulated runs are played by the simulation, never called")


def _job(key: int, name: str, schedule: JobConfig, **policy: object) -> CatalogJob:
    spec = JobSpec(
        key=key, name=name, func=_never, takes_context=True, is_async=False, source="simulation"
    )
    return CatalogJob(
        spec=spec,
        schedule=schedule,
        timezone=schedule.timezone or "UTC",
        skip_threshold=schedule.skip_alert_after or 3,
        fail_threshold=schedule.fail_alert_after or 3,
        misfire_grace=YEAR,
        **policy,  # type: ignore[arg-type]
    )


def catalog(variant: int) -> dict[int, CatalogJob]:
    """The jobs of one configuration; variants differ as a rolling deploy's would."""
    fast_every = ("5s", "10s", "5s")[variant % 3]
    slow_every = ("11s", "13s", "11s")[variant % 3]
    jobs = [
        _job(
            FAST,
            "fast",
            JobConfig(interval=fast_every, skip_alert_after=2, timeout="20s"),
            retries=2,
            retry_delay=timedelta(seconds=30),
        ),
        _job(
            SLOW,
            "slow",
            JobConfig(interval=slow_every, skip_alert_after=3, catch_up="all").model_copy(
                # Past the 7 days config.yaml allows, and a day past the grace: the sweep
                # (sweeps.swept) leaves its ticks to catch up.
                update={"catch_up_window": YEAR + timedelta(days=1)}
            ),
        ),
        _job(
            BERLIN,
            "berlin",
            JobConfig(cron="*/20 * * * * *", timezone="Europe/Berlin", skip_alert_after=2),
        ),
    ]
    if variant != 2:  # the third configuration has no night job
        jobs.append(
            _job(
                NIGHT,
                "night",
                JobConfig(cron="*/1 2 * * *", timezone="Europe/Berlin", skip_alert_after=1),
            )
        )
    return {job.key: job for job in jobs}


# Before the world starts, the fleet ran configuration 1 until it went down: the ticks
# of `slow` it missed are what catch-up passes plan from the registrations.
DOWN_FOR = timedelta(minutes=1)
RAN_FOR = timedelta(minutes=5)


def with_threshold(job: CatalogJob, threshold: int) -> CatalogJob:
    """The job after a reload that changed its skip_alert_after."""
    assert job.schedule is not None
    schedule = job.schedule.model_copy(update={"skip_alert_after": threshold})
    return replace(job, schedule=schedule, skip_threshold=threshold)
