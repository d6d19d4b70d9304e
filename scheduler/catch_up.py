"""Catch-up after downtime: the ticks a fleet that was down did not run.

`catch_up: latest` hands the gate the most recent past tick within the misfire
grace, once, at start. `catch_up: all` looks back over the job's
`catch_up_window` each time this replica's lock session comes up (start-up,
or back from a database outage): the newest `catch_up_limit` ticks that have
no row are claimed one at a time, oldest first, lock first (`Gate.catch_up`),
so every replica may do this at once and each tick still runs once for the
fleet, in order; older ticks of the window without a row are recorded
`missed` at once. The sweep leaves the window's ticks to this pass.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime

from sqlalchemy import Engine, select

from scheduler import events, ledger
from scheduler.backends.base import Outcome
from scheduler.catalog import Catalog, CatalogJob
from scheduler.gate import Gate
from scheduler.schedules import ticks_between

log = logging.getLogger("scheduler.catch_up")

HELD_RETRY = 1.0  # seconds before a tick whose lock was held (an older one runs) is tried again


def latest(catalog: Catalog, gate: Gate, now: datetime) -> None:
    """`catch_up: latest`: the most recent past tick, if within grace, goes to the gate.

    If a replica already ran it, the claim is simply lost.
    """
    for job in catalog.scheduled:
        if job.schedule is None or job.schedule.catch_up != "latest" or job.trigger is None:
            continue
        found = ticks_between(job.trigger, now - job.misfire_grace, now, limit=1)
        if found:
            gate.submit(job, found[-1])


def plan(
    job: CatalogJob, now: datetime, have: set[datetime], tracked_since: datetime | None
) -> tuple[list[datetime], list[datetime]]:
    """(to run, oldest first; to record missed): the window's ticks that have no row."""
    assert job.schedule is not None and job.trigger is not None
    limit = job.schedule.catch_up_limit
    start = now - job.catch_up_window
    if tracked_since is not None:
        start = max(start, tracked_since)
    candidates = ticks_between(job.trigger, start, now, limit=limit + len(have))
    missing = [tick for tick in candidates if tick not in have]
    return missing[-limit:], missing[:-limit]


class CatchUp:
    """`catch_up: all` for one replica: a pass per lock session that comes up.

    A listener of the gate's events (it only starts passes); each job's pass
    runs on a thread of its own, so one long run never holds up another
    job's catching up.
    """

    def __init__(
        self,
        gate: Gate,
        engine: Engine,
        catalog: Callable[[], Catalog],
        *,
        instance: str,
        clock: Callable[[], datetime],
    ) -> None:
        self.gate = gate
        self.engine = engine
        self.catalog = catalog
        self.instance = instance
        self.clock = clock
        self.stopped = threading.Event()
        self._mutex = threading.Lock()
        self._passes: dict[int, threading.Thread] = {}  # job key -> its pass now

    def __call__(self, event: events.Event) -> None:
        if isinstance(event, events.LockSessionUp) and not self.stopped.is_set():
            self.start_passes()

    def start_passes(self) -> None:
        for job in self.catalog().scheduled:
            if job.schedule is None or job.schedule.catch_up != "all":
                continue
            with self._mutex:
                running = self._passes.get(job.key)
                if running is not None and running.is_alive():
                    continue  # the pass under way looks at the window as it is now
                thread = threading.Thread(
                    target=self._pass, args=(job,), name=f"catch-up-{job.key}", daemon=True
                )
                self._passes[job.key] = thread
            thread.start()

    def stop(self) -> None:
        self.stopped.set()

    def _pass(self, job: CatalogJob) -> None:
        try:
            to_run, missed = self._plan(job)
            if missed:
                self._record_missed(job, missed)
            if to_run:
                log.info(
                    "%s: catching up %d tick(s) missed while the fleet was down, from %s",
                    job.name,
                    len(to_run),
                    to_run[0].isoformat(),
                )
            for tick in to_run:
                if self.stopped.is_set():
                    return
                self._one(job, tick)
        except Exception:
            log.exception("%s: catching up failed; the sweep records what was not run", job.name)

    def _plan(self, job: CatalogJob) -> tuple[list[datetime], list[datetime]]:
        now = self.clock()
        t = ledger.ticks
        with self.engine.connect() as conn:
            have = set(
                conn.execute(
                    select(t.c.scheduled_at).where(
                        t.c.job_key == job.key, t.c.scheduled_at >= now - job.catch_up_window
                    )
                ).scalars()
            )
            since = conn.execute(
                select(ledger.jobs.c.tracked_since).where(ledger.jobs.c.job_key == job.key)
            ).scalar()
        return plan(job, now, have, since)

    def _record_missed(self, job: CatalogJob, ticks: list[datetime]) -> None:
        with self.engine.begin() as conn:
            recorded = ledger.record_missed(
                conn,
                [(job.key, job.name, tick) for tick in ticks],
                self.instance,
                ledger.paused_since(conn),
            )
        if recorded:
            log.warning(
                "%s: recorded %d missed tick(s): beyond catch_up_limit (%d)",
                job.name,
                recorded,
                job.schedule.catch_up_limit if job.schedule else 0,
            )

    def _one(self, job: CatalogJob, tick: datetime) -> None:
        """Claim the tick until it runs (here or elsewhere) or leaves the window."""
        while not self.stopped.is_set():
            result = self.gate.catch_up(job, tick)
            # held: an older tick still runs; error: the claim failed, nothing was decided
            if result.outcome not in (Outcome.HELD, Outcome.ERROR):
                return
            self.stopped.wait(HELD_RETRY)
