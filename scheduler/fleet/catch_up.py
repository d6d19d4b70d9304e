"""Catch-up after downtime: the due ticks a fleet that was down did not run.

Which ticks were due is `scheduler.fleet.due`'s answer: those of the schedules in
force then, not of this replica's schedule today. `catch_up: latest` hands the
gate the most recent due tick within the misfire grace, once, at start.
`catch_up: all` looks back over the job's `catch_up_window` each time this
replica's lock session comes up (start-up, or back from a database outage): of
the ticks that fell due before the fleet's live replicas came up (later ones
are theirs to fire), the newest `catch_up_limit` that have no row are claimed
one at a time, oldest first, lock first (`Gate.catch_up`), so every replica may
do this at once and each tick still runs once for the fleet, in order; up to
`MISSED_LIMIT` older ticks of the window without a row are recorded `missed`
at once (older ones by the sweep, once they leave the window). Every pass
looks at the same ticks, whenever it starts: the newest `catch_up_limit` plus
`MISSED_LIMIT` due ticks before the fleet came up, so no pass records missed a
tick another pass is about to run, nor runs one older than another pass ran.
(The embedded backend does not know when a replica came up: there, up to now.)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime

from sqlalchemy import Engine, select
from sqlalchemy.exc import SQLAlchemyError

from scheduler.backends.base import LedgerStore, Outcome
from scheduler.errors import one_line
from scheduler.fleet.due import InForce
from scheduler.fleet.housekeeping import MISSED_LIMIT
from scheduler.gate import Gate
from scheduler.ledger import tables
from scheduler.ledger.missed import paused_since, record_missed
from scheduler.ledger.registrations import Registration, registered_instances, registrations_of
from scheduler.observers import events
from scheduler.registry.catalog import Catalog, CatalogJob

log = logging.getLogger("scheduler.catch_up")

HELD_RETRY = 1.0  # seconds before a tick whose lock was held (an older one runs) is tried again


def submit_latest(catalog: Catalog, gate: Gate, engine: Engine, now: datetime) -> None:
    """`catch_up: latest`: the most recent due tick, if within grace, goes to the gate.

    If a replica already ran it, the claim is simply lost.
    """
    jobs = [
        job
        for job in catalog.scheduled
        if job.schedule is not None and job.schedule.catch_up == "latest"
    ]
    if not jobs:
        return
    try:
        with engine.connect() as conn:
            registered = registrations_of(conn, [job.key for job in jobs])
    except SQLAlchemyError as exc:
        log.warning("catch_up: latest skipped: the ledger did not answer (%s)", one_line(exc))
        return
    for job in jobs:
        found = InForce(r for r in registered if r.key == job.key).between(
            now - job.misfire_grace, now, 1
        )
        if found:
            gate.submit(job, found[-1])


def plan(
    job: CatalogJob,
    registered: list[Registration],
    now: datetime,
    end: datetime,
    have: set[datetime],
) -> tuple[list[datetime], list[datetime]]:
    """(to run, oldest first; to record missed): of the window's newest due ticks up to
    `end` (when the fleet came up), those that have no row (`have`: the rows)."""
    assert job.schedule is not None
    limit = job.schedule.catch_up_limit
    due = InForce(registered).between(now - job.catch_up_window, end, limit + MISSED_LIMIT)
    missing = [tick for tick in due if tick not in have]
    return missing[-limit:], missing[:-limit]


def fleet_up(
    now: datetime,
    live: list[dict[str, object]],
    registered: list[Registration],
    registering: set[str],
) -> datetime:
    """When the first live replica that fires the job came up (its lock session), or `now`:
    the ticks due since then are that replica's to fire, not catch-up's.

    `registered`: the job's registrations; `registering`: the replicas that have some
    registration in force. A live replica with none (another took its rows over while it
    started, until its first housekeeping pass) is taken to fire the job.
    """
    fires = {r.instance for r in registered if r.until is None and r.schedule is not None}
    starts = [
        i["since"]
        for i in live
        if (i["name"] in fires or i["name"] not in registering) and isinstance(i["since"], datetime)
    ]
    return min([now, *starts])


class CatchUp:
    """`catch_up: all` for one replica: a pass per lock session that comes up.

    A listener of the gate's events (it only starts passes); each job's pass
    runs on a thread of its own, so one long run never holds up another
    job's catching up.
    """

    def __init__(
        self,
        gate: Gate,
        backend: LedgerStore,
        catalog: Callable[[], Catalog],
        *,
        instance: str,
    ) -> None:
        self.gate = gate
        self.backend = backend
        self.engine = backend.ledger_engine
        self.catalog = catalog
        self.instance = instance
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
        t = tables.ticks
        with self.engine.connect() as conn:
            now = self.backend.now(conn)
            registered = registrations_of(conn, [job.key])
            live = self.backend.live_instances(conn)
            end = fleet_up(now, live, registered, registered_instances(conn))
            have = set(
                conn.execute(
                    select(t.c.scheduled_at).where(
                        t.c.job_key == job.key,
                        t.c.scheduled_at > now - job.catch_up_window,
                        t.c.scheduled_at <= end,
                    )
                ).scalars()
            )
        return plan(job, registered, now, end, have)

    def _record_missed(self, job: CatalogJob, ticks: list[datetime]) -> None:
        with self.engine.begin() as conn:
            recorded = record_missed(
                conn,
                [(job.key, job.name, tick) for tick in ticks],
                self.instance,
                paused_since(conn),
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
