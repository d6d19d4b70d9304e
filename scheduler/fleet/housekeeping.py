"""Fleet chores, each done by one replica at a time: stale runs, missed ticks, retention.

They run on the replica's second session (never the lock session, so a long
prune cannot delay a claim), and one replica per period wins the right to do
them (scheduler.ledger.election): the work does not grow with the number of replicas.

- Stale runs: a `running` row whose job lock nobody holds belongs to a
  replica that died; it is marked `crashed` even when the job's next tick is
  hours away.
- Missed ticks: a tick that was due (scheduler.fleet.due) and that no replica
  claimed within its misfire grace (the database was unreachable, or no
  replica was up) gets a `missed` row (or `paused`, if the job is paused since
  before it), at most `MISSED_LIMIT` per job per sweep.
- Orphaned retries: a retry pending for a job that no live replica has any
  more ends (after `ORPHANED_RETRY_GRACE`): the row becomes final, and prunable.
- Retention: rows older than `retention_days` are deleted in batches.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection

from scheduler.backends.base import Crashes
from scheduler.config.settings import Settings
from scheduler.errors import ConfigError, one_line
from scheduler.fleet import agreement
from scheduler.fleet.due import InForce
from scheduler.ledger.election import Chore, Election, elect
from scheduler.ledger.history import TickRow, running
from scheduler.ledger.job_states import job_states, set_drift, track_jobs
from scheduler.ledger.missed import (
    existing_ticks,
    missed_watermark,
    paused_since,
    record_missed,
    set_missed_watermark,
)
from scheduler.ledger.orphans import end_retry, mark_crashed, pending_retries
from scheduler.ledger.outbox import add_notice, adopt_notices
from scheduler.ledger.registrations import (
    Registration,
    by_job,
    mark_seen,
    names_in_force,
    reassert,
    recently_seen,
    register,
    registrations_of,
    seen_at,
    supersede,
    take_turns,
)
from scheduler.ledger.retention import prune_batch, prune_registrations
from scheduler.ledger.run_now import requests_unsettled, settle_ended_requests
from scheduler.ledger.times import iso
from scheduler.registry.catalog import Catalog, schedule_text
from scheduler.statuses import CRASHED_FOUND_BY_SWEEP

if TYPE_CHECKING:
    from scheduler.backends.base import LedgerStore
    from scheduler.observers.notices import Notices

log = logging.getLogger("scheduler.housekeeping")

SWEEP_EVERY = 30.0  # seconds between sweeps, fleet-wide
# A replica seen alive this recently (each pass marks it, and its registration) is not
# gone, live or not: it may be starting, its lock session not up yet.
SEEN_RECENTLY = 2 * SWEEP_EVERY
PRUNE_EVERY = 3600.0
MISSED_LIMIT = 100  # missed rows recorded per job per sweep, at most
MISSED_MARGIN = timedelta(seconds=5)  # beyond the grace: no claim can still be in flight
# How long past its time a retry of a job no live replica has waits before it ends.
ORPHANED_RETRY_GRACE = timedelta(minutes=10)
NAMED_IN_A_LINE = 5  # runs or retries a log line names; the rest are counted


@dataclass(frozen=True)
class _Found:
    """What a pass's first transaction found: the chores won, and which have work."""

    sweep: Election | None
    prune: Election | None
    states: dict[int, dict[str, object]]
    registered: list[Registration] = field(default_factory=list)
    # Notices leased to this replica (adopted, or raised by the sweep): handed to the
    # deliverer only once committed, as its reads need the lease (Notices.deliver).
    deliver: list[int] = field(default_factory=list)
    settle: bool = False  # run-now requests taken and not settled
    judge: bool = False  # ticks due in the missed-tick window


class NameInUse(ConfigError):
    """A live session uses this replica's instance name: a second replica of that name, or
    this one's earlier session, still ending after a quick restart (the daemon waits)."""


def not_gone(conn: Connection, live: set[str], now: datetime) -> set[str]:
    """The live replicas and those seen alive lately: whose registrations no replica
    takes over or ends.

    One seen lately may be starting (registered, its lock session not up yet). With 100
    replicas of 1,000 jobs starting together, each starter took over the rows of every
    one not yet up, and each of those put its 1,000 back at its first pass, all under the
    writers' table lock. A replica that is gone indeed keeps its schedules in force a
    minute longer: the fleet did run them until then.
    """
    return live | recently_seen(conn, now - timedelta(seconds=SEEN_RECENTLY))


class Housekeeping:
    def __init__(
        self,
        backend: LedgerStore,
        catalog: Catalog,
        settings: Settings,
        on_streaks: Callable[[dict[str, int]], None] | None = None,
        on_drift: Callable[[dict[str, bool]], None] | None = None,
        notices: Notices | None = None,
        going_here: Callable[[], set[int]] = set,
    ) -> None:
        self.backend = backend
        self.catalog = catalog
        self.settings = settings
        self.on_streaks = on_streaks
        self.on_drift = on_drift
        self.notices = notices
        # The run ids of this replica's runs still going or not yet recorded (the gate's).
        self.going_here = going_here
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def track_jobs(self) -> None:
        """Register this replica's jobs and schedules, refusing what would mix two fleets.

        A replica whose name a live replica already uses (NameInUse), or whose job
        key a live replica runs under another job name (two projects on one
        schema), does not start: ConfigError, exit 2, naming both.
        """
        engine = self.backend.ledger_engine
        me = self.settings.instance_name
        with engine.begin() as conn:
            take_turns(conn)  # first: who is live, and what is registered, as it stands then
            now = self.backend.now(conn)
            live = {i["name"]: i for i in self.backend.live_instances(conn)}
            if me in live:
                since = live[me].get("since")
                raise NameInUse(
                    f"instance_name {me!r} is in use by a live replica"
                    + (f" (up since {since})" if since else "")
                    + ": give each replica its own name (SCHEDULER_INSTANCE_NAME)"
                )
            self._register(conn, self.catalog, set(live), now)
        track_jobs(engine, [(job.key, job.name, job.describe()) for job in self.catalog], now)

    def reregister(self, catalog: Catalog) -> datetime:
        """After a reload: the jobs and schedules this replica runs from now on; returns
        the instant (the ledger's) from which a changed schedule is in force.

        The clash check still applies (a reloaded file may name a key another
        way); this replica's own name is, of course, live.
        """
        engine = self.backend.ledger_engine
        with engine.begin() as conn:
            take_turns(conn)
            now = self.backend.now(conn)
            live = {i["name"] for i in self.backend.live_instances(conn)}
            self._register(conn, catalog, live - {self.settings.instance_name}, now)
        self.catalog = catalog
        track_jobs(engine, [(job.key, job.name, job.describe()) for job in catalog], now)
        return now

    def _register(
        self, conn: Connection, catalog: Catalog, others: set[str], now: datetime
    ) -> None:
        me = self.settings.instance_name
        self._refuse_clashes(catalog, names_in_force(conn, others))
        mark_seen(conn, me, now)
        others = not_gone(conn, others, now) - {me}
        register(conn, me, entries(catalog), others, now)
        supersede(conn, {*others, me}, now)

    def _refuse_clashes(self, catalog: Catalog, found: list[tuple[int, str, str]]) -> None:
        """`found`: (job key, job name, a live replica) of the live replicas' schedules."""
        for key, name, instance in found:
            job = catalog.by_key(key)
            if job is None:
                continue
            if name != job.name:
                apart = (
                    "its own folder (config.yaml, and the scheduler.db beside it)"
                    if self.settings.embedded
                    else "its own schema (setting `schema`)"
                )
                raise ConfigError(
                    f"job key {key} is {job.name!r} here ({job.spec.source}) but "
                    f"{name!r} on the live replica {instance}: two fleets (or two versions "
                    f"of one) share this ledger. Give each fleet {apart}, or rename the job "
                    "once no replica runs the old name"
                )

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="housekeeping", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        wait = 1.0  # the first pass soon after start: this replica's schedules in force
        while not self._stop.wait(wait):
            wait = SWEEP_EVERY
            try:
                self.run_once()
            except Exception as exc:
                log.warning("housekeeping failed (will retry): %s", one_line(exc))

    def run_once(self) -> dict[str, int]:
        """Do whichever chores this replica wins; returns what was done.

        One session for the pass: a replica that wins no chore spends two transactions
        per period here (the session's settings; the election, the streaks for the
        metrics and its registrations reasserted), one that wins the sweep one more for
        each chore that finds work (run-now requests to settle, ticks to judge missed).
        """
        me = self.settings.instance_name
        # One session for the whole pass (opened for it, closed after), a transaction
        # for each part.
        with self.backend.ledger_engine.connect() as conn:
            return self._pass(conn, me)

    def _pass(self, conn: Connection, me: str) -> dict[str, int]:
        done: dict[str, int] = {}
        with conn.begin():
            found = self._elect_and_sweep(conn, me, done)
        if found.deliver and self.notices is not None:  # committed: deliver them now
            self.notices.schedule(found.deliver)
        sweep = found.sweep
        if sweep is not None and found.settle:  # requests whose taker never said how it ended
            with conn.begin():
                done["requests"] = settle_ended_requests(conn, sweep.at)
        # Missed ticks are new rows, and new rows come before updates in the one order
        # every transaction takes its row locks in (postgres.sql): a transaction apart,
        # which moves its own watermark, so a sweep cut short here loses no window. The
        # window is the fleet's: only a replica that has every job a live replica runs
        # (and so its grace) moves it; another leaves it to one that does. A window with
        # no tick due in it (as read, unlocked, in the sweep) is left to grow: the next
        # sweep that finds a tick judges it whole, as this one would have.
        if sweep is not None and found.judge:
            with conn.begin():
                since = missed_watermark(conn)
                done["missed"] = self.sweep_missed(
                    conn, found.states, since, sweep.at, found.registered
                )
                set_missed_watermark(conn, max(since, sweep.at))
        report_states(self.catalog, found.states, self.on_streaks, self.on_drift)
        if found.prune is not None:
            cutoff = found.prune.at - timedelta(days=self.settings.retention_days)
            done["pruned"] = prune_before(conn, cutoff)
        return done

    def _elect_and_sweep(self, conn: Connection, me: str, done: dict[str, int]) -> _Found:
        """The pass's first transaction: the elections, this replica's liveness and
        registrations, and, if it won the sweep, the chores that update rows."""
        now = self.backend.now_expression()
        sweep = elect(conn, Chore.SWEEP, now, SWEEP_EVERY)
        prune = elect(conn, Chore.PRUNE, now, PRUNE_EVERY)
        mark_seen(conn, me, now)
        states = job_states(conn)
        adopted = adopt_notices(conn, me, now) if self.notices is not None else []
        if adopted:
            done["notices"] = len(adopted)
        if sweep is None:
            reassert(conn, me, entries(self.catalog), now)
            return _Found(None, prune, states, deliver=adopted)
        # Row locks in the one order (postgres.sql): tick rows, registrations, job rows.
        live = {i["name"] for i in self.backend.live_instances(conn)}
        done["retries_ended"] = self.end_orphaned_retries(conn, sweep.at, live | {me})
        crashed = self.sweep_crashed(conn, sweep.at, live | {me})
        done["crashed"] = len(crashed)
        reassert(conn, me, entries(self.catalog), now)
        supersede(conn, not_gone(conn, live, sweep.at), sweep.at)
        registered = registrations_of(conn)
        raised = self.count_crashes(conn, crashed)
        drifting = self.sweep_drift(conn, states, registered, live, sweep.at)
        done["drift"] = len(drifting)
        judges = judges_every_job(self.catalog, registered, live | {me})
        window = missed_watermark(conn, lock=False), sweep.at
        return _Found(
            sweep,
            prune,
            states,
            registered,
            adopted + raised + drifting,
            settle=requests_unsettled(conn),
            # Stops at the first job with a tick due: a busy fleet's window is judged in
            # full once, in the transaction apart, not twice.
            judge=judges and any(due_ticks(self.catalog, states, *window, registered)),
        )

    def sweep_drift(
        self,
        conn: Connection,
        states: dict[int, dict[str, object]],
        registered: list[Registration],
        live: set[str],
        now: datetime,
    ) -> list[int]:
        """Jobs whose live replicas disagree on the schedule: one notice when it has lasted
        `schedule_drift_grace`, one when it ends (scheduler.fleet.agreement). Job rows in key order.
        """
        grace = timedelta(seconds=self.settings.schedule_drift_grace)
        variants = agreement.live_schedules(registered, live)
        raised = []
        for key, state in sorted(states.items()):
            since = state.get("drift_since")
            before = agreement.Drift(
                since if isinstance(since, datetime) else None, bool(state.get("drift_alerted"))
            )
            found = variants.get(key, [])
            after, event = agreement.step(before, len(found) > 1, now, grace)
            if after != before:
                set_drift(conn, key, after.since, after.alerted)
            if event is not None:
                facts = {
                    "schedules": [v.as_json() for v in found],
                    "since": iso(before.since or now),
                    "grace_s": grace.total_seconds(),
                }
                me = self.settings.instance_name
                name = str(state["job_name"])
                raised.append(
                    add_notice(conn, event, key, name, facts, raised_by=me, now=now, deliverer=me)
                )
        return raised

    def sweep_crashed(
        self, conn: Connection, now: datetime, live: set[str] | None = None
    ) -> list[TickRow]:
        """Running rows whose job lock nobody holds: their replica is gone. Returns them.

        A run whose replica is gone is known to have lasted until that replica was
        last seen alive (`mark_seen`): that is recorded as its duration, a lower bound.
        """
        stale = running(conn)
        if not stale:
            return []
        if live is None:
            live = {i["name"] for i in self.backend.live_instances(conn)}
        free = self.backend.free_locks(conn, sorted({row.key for row in stale}))
        gone = sorted({r.instance for r in stale if r.instance and r.instance not in live})
        seen = seen_at(conn, gone)
        # A run of this replica whose lock went with a lost session still goes on here, or
        # has ended and waits for its finish: that finish records how it ended (told its
        # lock was lost, it may have stopped: `interrupted`). Only other replicas, which
        # cannot know, find it crashed.
        me, going = self.settings.instance_name, self.going_here()
        marked = []
        for row in sorted(stale, key=lambda r: (r.scheduled_at, r.key)):  # the common order
            if row.instance == me and row.run_id in going:
                continue
            if row.key in free and row.run_id is not None:
                lasted = known_to_last(row, seen.get(row.instance or ""), live)
                if mark_crashed(conn, row.key, row.run_id, CRASHED_FOUND_BY_SWEEP, now, lasted):
                    marked.append(row)
        if marked:
            log.warning(
                "marked %d run(s) crashed, their replica gone: %s",
                len(marked),
                named(
                    [f"{r.job} tick {r.scheduled_at.isoformat()} on {r.instance}" for r in marked]
                ),
            )
        return marked

    def count_crashes(self, conn: Connection, marked: list[TickRow]) -> list[int]:
        """The runs the sweep marked crashed count as failures, as a claim's would
        (`count_crashes` of the backend); returns the alerts raised."""
        crashes: dict[int, Crashes] = {}
        for row in marked:
            job = self.catalog.by_key(row.key)
            threshold = job.fail_threshold if job else self.settings.fail_alert_after
            found = crashes.get(row.key)
            crashes[row.key] = Crashes(
                row.job,
                threshold,
                (found.count if found else 0) + 1,
                max(row.scheduled_at, found.newest) if found else row.scheduled_at,
            )
        return list(self.backend.count_crashes(conn, crashes).values()) if crashes else []

    def end_orphaned_retries(self, conn: Connection, now: datetime, live: set[str]) -> int:
        """Retries of jobs that no live replica has: nobody would ever take them.

        Only once overdue by `ORPHANED_RETRY_GRACE` (a replica that has the job may be
        on its way: a rolling deploy); the row stays `failed`, now final.
        """
        pending = pending_retries(conn, now - ORPHANED_RETRY_GRACE)
        if not pending:
            return 0
        keys = sorted({p.key for p in pending})
        kept = {
            r.key for r in registrations_of(conn, keys) if r.instance in live and r.until is None
        }
        ended = [
            p
            for p in pending
            if p.key not in kept
            and end_retry(conn, p, "not retried: no live replica runs this job")
        ]
        if ended:
            log.warning(
                "ended %d pending retr%s of jobs no live replica runs: %s",
                len(ended),
                "y" if len(ended) == 1 else "ies",
                named([f"{p.job} tick {p.scheduled_at.isoformat()}" for p in ended]),
            )
        return len(ended)

    def sweep_missed(
        self,
        conn: Connection,
        states: dict[int, dict[str, object]],
        previous: datetime,
        now: datetime,
        registered: list[Registration] | None = None,
    ) -> int:
        """Ticks of enabled jobs that nobody claimed in time, since the previous sweep.

        Those of a job paused at that tick are recorded `paused`, not `missed`
        (the count returned is of the missed ones).

        Each sweep looks at the ticks that left their grace since the previous
        sweep (or since the job was tracked, bounded per job), so its cost
        follows the number of ticks, not the size of the ledger. Only ticks that
        were due are recorded (`scheduler.fleet.due`: by the schedules in force then).
        """
        if registered is None:
            registered = registrations_of(conn)
        # Never past the ledger's clock as it reads now: a `now` from a clock that has
        # since stepped back would name ticks that are not due yet.
        now = min(now, self.backend.now(conn))
        expected = list(due_ticks(self.catalog, states, previous, now, registered))
        if not expected:
            return 0
        have = existing_ticks(conn, expected)
        names = {job.key: job.name for job in self.catalog}
        missing = sorted((tick, key) for key, tick in expected if (key, tick) not in have)
        recorded = record_missed(
            conn,
            [(key, names[key], tick) for tick, key in missing],
            self.settings.instance_name,
            paused_since(conn),
        )
        if recorded:
            log.warning("recorded %d missed tick(s): no replica claimed them in time", recorded)
        return recorded


def due_ticks(
    catalog: Catalog,
    states: dict[int, dict[str, object]],
    previous: datetime,
    now: datetime,
    registered: list[Registration],
) -> Iterator[tuple[int, datetime]]:
    """The ticks (key, instant) that left their grace since the sweep `previous`: by the
    schedules in force then, at most `MISSED_LIMIT` per job, one job after another."""
    grouped = by_job(registered)
    for job in catalog.scheduled:
        state = states.get(job.key)
        if state is None:
            continue
        since = state["tracked_since"]
        assert isinstance(since, datetime)
        start = max(since, previous - job.missed_after - MISSED_MARGIN)
        until = now - job.missed_after - MISSED_MARGIN  # never a tick still in its grace
        if until <= start:
            continue
        for tick in InForce(grouped.get(job.key, [])).between(start, until, MISSED_LIMIT):
            yield job.key, tick


def entries(catalog: Catalog) -> list[tuple[int, str, str | None]]:
    """What a replica registers: each job's key, name and schedule."""
    return [(job.key, job.name, schedule_text(job)) for job in catalog]


def judges_every_job(catalog: Catalog, registered: list[Registration], live: set[str]) -> bool:
    """Whether a replica with `catalog` schedules every job a live replica has a schedule of
    (so that it knows every job's grace, and may move the fleet's missed-tick window)."""
    mine = {job.key for job in catalog.scheduled}
    return all(
        r.key in mine
        for r in registered
        if r.instance in live and r.until is None and r.schedule is not None
    )


def report_states(
    catalog: Catalog,
    states: dict[int, dict[str, Any]],
    on_streaks: Callable[[dict[str, int]], None] | None,
    on_drift: Callable[[dict[str, bool]], None] | None,
) -> None:
    """The skip streaks and drifting schedules of this replica's jobs, for the metrics."""
    names = {job.key: job.name for job in catalog}
    mine = {names[key]: state for key, state in states.items() if key in names}
    if on_streaks:
        on_streaks({name: int(state["consecutive_skips"]) for name, state in mine.items()})
    if on_drift:
        on_drift({name: state.get("drift_since") is not None for name, state in mine.items()})


def prune_before(conn: Connection, cutoff: datetime) -> int:
    """Retention: registrations, then tick rows, older than `cutoff`, in small batches (a
    transaction each, so no lock is held long). Returns the tick rows removed."""
    with conn.begin():
        prune_registrations(conn, cutoff)
    pruned = 0
    while True:
        with conn.begin():
            removed = prune_batch(conn, cutoff)
        pruned += removed
        if not removed:
            return pruned


def known_to_last(row: TickRow, seen: datetime | None, live: set[str]) -> float | None:
    """How long a crashed run is known to have gone on: until its replica, gone, was last
    seen alive (None: not known; a live replica that lost the lock may still run it)."""
    if row.started_at is None or row.instance in live:
        return None
    alive = max(row.started_at, seen) if seen is not None else row.started_at
    return round((alive - row.started_at).total_seconds(), 6)


def named(items: list[str]) -> str:
    """At most `NAMED_IN_A_LINE` of them, then how many more: a log line stays a line."""
    shown = ", ".join(items[:NAMED_IN_A_LINE])
    rest = len(items) - NAMED_IN_A_LINE
    return f"{shown} and {rest} more" if rest > 0 else shown
