"""Fleet chores, each done by one replica at a time: stale runs, missed ticks, retention.

They run on the replica's second session (never the lock session, so a long
prune cannot delay a claim), and one replica per period wins the right to do
them (`ledger.elect`): the work does not grow with the number of replicas.

- Stale runs: a `running` row whose job lock nobody holds belongs to a
  replica that died; it is marked `crashed` even when the job's next tick is
  hours away.
- Missed ticks: a tick that no replica claimed within its misfire grace (the
  database was unreachable, or no replica was up) gets a `missed` row, at
  most `MISSED_LIMIT` per job per sweep.
- Retention: rows older than `retention_days` are deleted in batches.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from sqlalchemy import Connection

from scheduler import ledger
from scheduler.catalog import Catalog
from scheduler.config import Settings
from scheduler.errors import one_line
from scheduler.schedules import ticks_between

if TYPE_CHECKING:
    from scheduler.backends import Backend

log = logging.getLogger("scheduler.housekeeping")

SWEEP_EVERY = 30.0  # seconds between sweeps, fleet-wide
PRUNE_EVERY = 3600.0
MISSED_LIMIT = 100  # missed rows recorded per job per sweep, at most
MISSED_MARGIN = timedelta(seconds=5)  # beyond the grace: no claim can still be in flight
CRASHED = "replica died while the run was in progress (found by the sweep)"


class Housekeeping:
    def __init__(
        self,
        backend: Backend,
        catalog: Catalog,
        settings: Settings,
        on_streaks: Callable[[dict[str, int]], None] | None = None,
    ) -> None:
        self.backend = backend
        self.catalog = catalog
        self.settings = settings
        self.on_streaks = on_streaks
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def track_jobs(self) -> None:
        """Every job gets a state row; `tracked_since` restarts when its schedule changes."""
        with self.backend.ledger_engine.begin() as conn:
            now = self.backend.now(conn)
            entries = [(job.key, job.name, job.describe()) for job in self.catalog]
            ledger.track_jobs(conn, entries, now)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="housekeeping", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(SWEEP_EVERY):
            try:
                self.run_once()
            except Exception as exc:
                log.warning("housekeeping failed (will retry): %s", one_line(exc))

    def run_once(self) -> dict[str, int]:
        """Do whichever chores this replica wins; returns what was done.

        An idle replica spends one transaction per period here: the election,
        the streaks for the metrics, and (if it won) the sweeps, together.
        """
        done: dict[str, int] = {}
        engine = self.backend.ledger_engine
        with engine.begin() as conn:
            now = self.backend.now_expression()
            sweep = ledger.elect(conn, "sweep", now, SWEEP_EVERY)
            prune = ledger.elect(conn, "prune", now, PRUNE_EVERY)
            states = ledger.job_states(conn)
            if sweep is not None:
                previous, now = sweep
                done["crashed"] = self.sweep_crashed(conn, now)
                done["missed"] = self.sweep_missed(conn, states, previous, now)
        if self.on_streaks:
            names = {job.key: job.name for job in self.catalog}
            self.on_streaks(
                {
                    names[key]: int(state["consecutive_skips"])  # type: ignore[call-overload]
                    for key, state in states.items()
                    if key in names
                }
            )
        if prune is not None:
            cutoff = prune[1] - timedelta(days=self.settings.retention_days)
            done["pruned"] = 0
            while True:
                with engine.begin() as conn:
                    removed = ledger.prune_batch(conn, cutoff)
                done["pruned"] += removed
                if not removed:
                    break
        return done

    def sweep_crashed(self, conn: Connection, now: datetime) -> int:
        """Running rows whose job lock nobody holds: their replica is gone."""
        stale = ledger.running(conn)
        if not stale:
            return 0
        free = self.backend.free_locks(conn, sorted({row.key for row in stale}))
        marked = 0
        for row in stale:
            if row.key in free and row.run_id is not None:
                marked += ledger.mark_crashed(conn, row.key, row.run_id, CRASHED, now)
        if marked:
            log.warning("marked %d run(s) crashed: their replica is gone", marked)
        return marked

    def sweep_missed(
        self,
        conn: Connection,
        states: dict[int, dict[str, object]],
        previous: datetime,
        now: datetime,
    ) -> int:
        """Ticks of enabled jobs that nobody claimed in time, since the previous sweep.

        Each sweep looks at the ticks that left their grace since the previous
        sweep (or since the job was tracked, bounded per job), so its cost
        follows the number of ticks, not the size of the ledger.
        """
        expected = self._expected(states, previous, now)
        if not expected:
            return 0
        have = ledger.existing_ticks(conn, expected)
        by_job: dict[int, list[datetime]] = {}
        for key, tick in expected:
            if (key, tick) not in have:
                by_job.setdefault(key, []).append(tick)
        recorded = 0
        for key, missing in by_job.items():
            job = self.catalog.by_key(key)
            assert job is not None
            recorded += ledger.record_missed(
                conn, key, job.name, self.settings.instance_name, missing
            )
        if recorded:
            log.warning("recorded %d missed tick(s): no replica claimed them in time", recorded)
        return recorded

    def _expected(
        self, states: dict[int, dict[str, object]], previous: datetime, now: datetime
    ) -> list[tuple[int, datetime]]:
        expected: list[tuple[int, datetime]] = []
        for job in self.catalog.scheduled:
            state = states.get(job.key)
            if state is None or job.trigger is None:
                continue
            since = state["tracked_since"]
            assert isinstance(since, datetime)
            start = max(since, previous - job.misfire_grace - MISSED_MARGIN)
            until = now - job.misfire_grace - MISSED_MARGIN
            if until <= start:
                continue
            for tick in ticks_between(job.trigger, start, until, MISSED_LIMIT):
                expected.append((job.key, tick))
        return expected
