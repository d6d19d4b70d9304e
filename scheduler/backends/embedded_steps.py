"""The claim and finish of the embedded backend, step by step, by the names of postgres.sql.

Each step runs inside one `BEGIN IMMEDIATE` transaction (SQLite has one
writer at a time, so nothing here can deadlock) and does for the SQLite
ledger and the file locks what the SQL function of the same name does for
PostgreSQL; read them side by side. The protocol is told in `scheduler.gate`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from sqlalchemy import Connection, delete, select, update
from sqlalchemy.dialects.sqlite import insert

from scheduler.backends.base import (
    ClaimAnswer,
    ClaimRequest,
    ClaimResult,
    Crashes,
    FinishRequest,
    FinishResult,
    Intent,
    Outcome,
    Recheck,
    Retries,
    TickRef,
)
from scheduler.backends.filelocks import FileLocks
from scheduler.ledger import history, tables
from scheduler.ledger.outbox import add_notice
from scheduler.statuses import CRASHED_LOST_LOCK, Status

# What a claim has decided for a tick so far: a row status, or an outcome without a row.
Fate = Status | Outcome
UNRECORDED = (Outcome.LOST, Outcome.YIELDED, Outcome.DEFERRED)  # answered as ticks alone


class Streak(NamedTuple):
    """A job's skip streak as a claim left it, for one tick's answer."""

    streak: int  # a skip: the streak, this skip included; a run: the streak it ends
    alert: bool  # this skip made the streak reach its threshold
    notice: int | None  # the alert's notice in the outbox


# (key, tick) -> the skip's streak; (key, None) -> the streak a run of the job ends.
Streaks = dict[tuple[int, datetime | None], Streak]
NO_STREAK = Streak(0, False, None)


class Recorded(NamedTuple):
    """A finish as record_finishes left it."""

    request: FinishRequest
    now: bool  # this call recorded it
    earlier: bool  # an earlier call recorded it (its answer was lost)
    finished_at: datetime | None

    def result(self, settled: Settled | None) -> FinishResult:
        """The finish's answer, with what it did to the job's streaks if anything."""
        r, recorded = self.request, self.now or self.earlier
        if settled is None:
            return FinishResult(r.key, r.scheduled_at, recorded, self.finished_at)
        return FinishResult(
            r.key,
            r.scheduled_at,
            recorded,
            self.finished_at,
            settled.failures,
            settled.alert,
            settled.recovered,
            settled.skips_recovered,
            settled.notices,
        )


class Settled(NamedTuple):
    """What a finish did to its job's streaks (scheduler_finish_streaks)."""

    failures: int | None  # failed: the streak, this failure included; succeeded: the one ended
    alert: bool
    recovered: bool
    skips_recovered: bool
    notices: tuple[int, ...]


@dataclass(frozen=True)
class Tick:
    """A tick on its way through a claim, as `scheduler_tick` in postgres.sql."""

    request: ClaimRequest
    fate: Fate
    run_id: int | None = None
    started_at: datetime | None = None
    holder: str | None = None
    holder_since: datetime | None = None
    by_hand: bool = False  # skipped: the run holding the lock is one a person asked for

    @property
    def key(self) -> int:
        return self.request.key


class _Shared:
    """One transaction: its connection, the locks it took (`taken`, given back if it fails),
    and the helpers every step uses."""

    def __init__(self, conn: Connection, locks: FileLocks, instance: str, now: datetime) -> None:
        self.conn, self.locks, self.instance, self.now = conn, locks, instance, now
        self.taken: list[int] = []
        # Job key -> (instance, tick) of its running rows, read once, by the first lock
        # taken (each lock leaves its own tick out; this transaction is the only writer).
        self._running: dict[int, list[tuple[str | None, datetime]]] | None = None

    # -- shared -------------------------------------------------------------------------

    def _lock(self, key: int, tick: datetime) -> bool:
        """The job's lock, kept only if it proves the job's other running rows stale.

        Every path that takes a job's lock comes here. A flock alone is not that
        proof: its file may have replaced one a live run still holds, or that run's
        job may have closed its replica's descriptor (`FileLocks.proves_over`);
        then the job counts as held, as it is.
        """
        if not self.locks.try_lock(key):
            return False
        if self._running is None:  # read once: this transaction is the only writer
            self._running = {}
            for row in history.running(self.conn):
                self._running.setdefault(row.key, []).append((row.instance, row.scheduled_at))
        others = {i or "" for i, at in self._running.get(key, []) if at != tick}
        if not self.locks.proves_over(key, others):
            self.locks.unlock(key)
            return False
        self.locks.stamp(key)
        self.taken.append(key)
        return True

    def _crash_others(
        self, tick: TickRef, message: str, *, name: str, fail_threshold: int
    ) -> Crashes:
        """With the job's lock in hand for `tick`, its other `running` rows are stale:
        crashed. They count against the job's failure streak (`name`, `fail_threshold`)."""
        t = tables.ticks
        marked = self.conn.execute(
            update(t)
            .where(
                t.c.job_key == tick.key,
                t.c.status == Status.RUNNING,
                t.c.scheduled_at != tick.scheduled_at,
            )
            .values(status=Status.CRASHED, finished_at=self.now, error=message)
            .returning(t.c.scheduled_at)
        ).all()
        newest = max((row.scheduled_at for row in marked), default=tick.scheduled_at)
        return Crashes(name, fail_threshold, len(marked), newest)

    def _has_row(self, key: int, tick: datetime) -> bool:
        t = tables.ticks
        query = select(t.c.job_key).where(t.c.job_key == key, t.c.scheduled_at == tick)
        return self.conn.execute(query).first() is not None

    def _paused(self, keys: set[int]) -> set[int]:
        if not keys:
            return set()
        p = tables.pauses
        query = select(p.c.job_key).where(p.c.job_key.in_(sorted(keys)))
        return {row.job_key for row in self.conn.execute(query)}

    def _holder(self, key: int, exclude: set[tuple[int, datetime]]) -> tuple[str | None, Any, bool]:
        """Whose run holds the job now: its newest `running` row not in `exclude`, and
        whether a person asked for it."""
        t = tables.ticks
        rows = self.conn.execute(
            select(t.c.instance, t.c.started_at, t.c.scheduled_at, t.c.manual)
            .where(t.c.job_key == key, t.c.status == Status.RUNNING)
            .order_by(t.c.scheduled_at.desc())
        )
        row = next((row for row in rows if (key, row.scheduled_at) not in exclude), None)
        return (row.instance, row.started_at, bool(row.manual)) if row else (None, None, False)

    def _next_run_id(self) -> int:
        c = tables.counters
        bump = update(c).where(c.c.name == "run_id").values(value=c.c.value + 1)
        return int(self.conn.execute(bump.returning(c.c.value)).scalar_one())

    def _job_name(self, r: FinishRequest) -> str:
        t = tables.ticks
        query = select(t.c.job_name).where(t.c.job_key == r.key, t.c.scheduled_at == r.scheduled_at)
        return str(self.conn.execute(query).scalar_one())

    def _ensure_job(self, key: int, name: str) -> None:
        statement = insert(tables.jobs).values(job_key=key, job_name=name, tracked_since=self.now)
        self.conn.execute(statement.on_conflict_do_nothing())

    def _skip_alert(self, tick: Tick, streak: int, threshold: int) -> int:
        since = tick.holder_since
        r = tick.request
        return self._notice(
            "job.skips_exceeded",
            TickRef(r.key, r.scheduled_at),
            r.name,
            consecutive_skips=streak,
            threshold=threshold,
            holder=tick.holder,
            holder_since=since.isoformat() if since else None,
            running_s=(self.now - since).total_seconds() if since else None,
        )

    def _notice(self, event: str, tick: TickRef, name: str, **facts: Any) -> int:
        """Write a notice to the outbox, leased to this replica (`scheduler.observers.notices`)."""
        return add_notice(
            self.conn,
            event,
            tick.key,
            name,
            facts,
            raised_by=self.instance,
            now=self.now,
            scheduled_at=tick.scheduled_at,
            deliverer=self.instance,
        )

    def count_crashes(self, crashes: Mapping[int, Crashes]) -> dict[int, int]:
        """Crashed runs count as failures (scheduler_count_crashes): key -> its alert, if any.

        The failure streak grows by the runs crashed, and alerts once when it first
        reaches the threshold in force; the notice says the runs crashed.
        """
        j = tables.jobs
        alerts = {}
        for key in sorted(crashes):
            found = crashes[key]
            self._ensure_job(key, found.name)
            row = self.conn.execute(select(j).where(j.c.job_key == key)).one()
            failures = row.consecutive_failures + found.count
            threshold = found.fail_threshold
            alerting = not row.fail_alerted and failures >= threshold
            self.conn.execute(
                update(j)
                .where(j.c.job_key == key)
                .values(consecutive_failures=failures, fail_alerted=row.fail_alerted or alerting)
            )
            if alerting:
                alerts[key] = self._notice(
                    "job.failures_exceeded",
                    TickRef(key, found.newest),
                    found.name,
                    consecutive_failures=failures,
                    threshold=threshold,
                    instance=self.instance,
                    crashed=found.count,
                )
        return alerts


class _Decide(_Shared):
    # -- scheduler_decide ---------------------------------------------------------------

    def choose(self, requests: Sequence[ClaimRequest], capacity: int) -> list[Tick]:
        out, room = [], capacity
        paused = self._paused({r.key for r in requests if r.intent is not Intent.MANUAL})
        for r in sorted(requests, key=lambda r: (r.scheduled_at, r.key)):
            fate: Fate
            if r.key in paused and r.intent is not Intent.MANUAL:
                fate = Status.PAUSED
            elif r.intent is Intent.SKIP:
                fate = Status.SKIPPED
            elif r.intent is Intent.MANUAL:
                fate = Status.RUNNING
            elif self.now - r.scheduled_at > timedelta(seconds=r.grace_s):
                fate = Status.MISSED
            elif r.intent is Intent.CATCH_UP:
                fate = Status.RUNNING  # its lock is taken first (lock_manual)
            elif self._has_row(r.key, r.scheduled_at):
                fate = Outcome.LOST
            elif room > 0:
                fate, room = Status.RUNNING, room - 1
            else:
                fate = Outcome.DEFERRED  # no free worker for it in this batch
            out.append(Tick(r, fate))
        return out

    def lock_manual(self, ticks: list[Tick]) -> list[Tick]:
        out = []
        for tick in ticks:
            intent = tick.request.intent
            first = intent is Intent.MANUAL or (
                intent is Intent.CATCH_UP and tick.fate is Status.RUNNING
            )
            if first and not self._lock(tick.key, tick.request.scheduled_at):
                instance, since, _ = self._holder(tick.key, exclude=set())
                tick = replace(tick, fate=Outcome.HELD, holder=instance, holder_since=since)
            out.append(tick)
        return out

    def insert_ticks(self, ticks: list[Tick]) -> list[Tick]:
        out = []
        for tick in ticks:
            if isinstance(tick.fate, Status):
                r = tick.request
                run_id = self._next_run_id() if tick.fate is Status.RUNNING else None
                started = self.now if run_id is not None else None
                statement = insert(tables.ticks).values(
                    job_key=r.key,
                    scheduled_at=r.scheduled_at,
                    job_name=r.name,
                    status=tick.fate,
                    instance=self.instance,
                    run_id=run_id,
                    started_at=started,
                    manual=r.intent is Intent.MANUAL,
                    caught_up=r.intent is Intent.CATCH_UP and run_id is not None,
                )
                if self.conn.execute(statement.on_conflict_do_nothing()).rowcount:
                    tick = replace(tick, run_id=run_id, started_at=started)
                else:
                    if r.key in self.taken and r.intent in (Intent.MANUAL, Intent.CATCH_UP):
                        self.locks.give_back(r.key)
                        self.taken.remove(r.key)
                    tick = replace(tick, fate=Outcome.LOST)
            out.append(tick)
        return out

    def take_locks(self, ticks: list[Tick]) -> list[Tick]:
        out = []
        for tick in ticks:
            wanted = tick.fate is Status.RUNNING and tick.request.intent is Intent.RUN
            if wanted and not self._lock(tick.key, tick.request.scheduled_at):
                tick = replace(tick, fate=Status.SKIPPED)
            out.append(tick)
        return out

    def record_skips(self, ticks: list[Tick]) -> list[Tick]:
        t = tables.ticks
        # Rows this claim inserted (a tick it lost is another replica's run).
        own = {
            (tick.key, tick.request.scheduled_at)
            for tick in ticks
            if tick.fate in (Status.RUNNING, Status.SKIPPED)
        }
        out = []
        for tick in ticks:
            if tick.fate is Status.SKIPPED:
                instance, since, by_hand = self._holder(tick.key, exclude=own)
                self.conn.execute(
                    update(t)
                    .where(t.c.job_key == tick.key, t.c.scheduled_at == tick.request.scheduled_at)
                    .values(status=Status.SKIPPED, run_id=None, started_at=None, holder=instance)
                )
                tick = replace(
                    tick,
                    run_id=None,
                    started_at=None,
                    holder=instance,
                    holder_since=since,
                    by_hand=by_hand,
                )
            out.append(tick)
        return out

    def crash_stale(self, ticks: list[Tick]) -> dict[int, Crashes]:
        found = {
            tick.key: self._crash_others(
                TickRef(tick.key, tick.request.scheduled_at),
                CRASHED_LOST_LOCK,
                name=tick.request.name,
                fail_threshold=tick.request.fail_threshold,
            )
            for tick in ticks
            if tick.fate is Status.RUNNING
        }
        return {key: crashes for key, crashes in found.items() if crashes.count}

    def skip_streaks(self, ticks: list[Tick]) -> Streaks:
        """(key, tick) -> (streak, alert, notice); (key, None) -> the streak a run ends.

        A tick skipped behind a run a person asked for counts in no streak.
        """
        j = tables.jobs
        out: Streaks = {}
        counted = [t for t in ticks if t.fate is Status.RUNNING or _overran(t)]
        for key in sorted({t.key for t in counted}):
            mine = [t for t in counted if t.key == key]
            skipped = [t for t in mine if t.fate is Status.SKIPPED]
            ran = len(skipped) < len(mine)
            self._ensure_job(key, mine[0].request.name)
            row = self.conn.execute(select(j).where(j.c.job_key == key)).one()
            before, alerted = row.consecutive_skips, row.skip_alerted
            threshold = min(t.request.skip_threshold for t in mine)
            after = 0 if ran else before + len(skipped)
            alerting = not alerted and not ran and after >= threshold
            self.conn.execute(
                update(j)
                .where(j.c.job_key == key)
                .values(
                    consecutive_skips=after,
                    overrun_skips=row.overrun_skips + len(skipped),
                    skip_alerted=alerted or alerting,
                )
            )
            if ran:
                out[(key, None)] = Streak(before, False, None)
            for n, tick in enumerate(skipped, start=1):
                streak, notice = before + n, None
                if alerting and streak == max(before + 1, threshold):
                    notice = self._skip_alert(tick, streak, threshold)
                out[(key, tick.request.scheduled_at)] = Streak(streak, notice is not None, notice)
        return out


class _Finish(_Shared):
    # -- scheduler_finish ---------------------------------------------------------------

    def record_finishes(self, requests: Sequence[FinishRequest]) -> list[Recorded]:
        """Each finish, recorded now or by an earlier call or not at all, in order."""
        t = tables.ticks
        out: list[Recorded] = []
        for r in sorted(requests, key=lambda r: (r.scheduled_at, r.key)):
            row = (t.c.job_key == r.key, t.c.scheduled_at == r.scheduled_at, t.c.run_id == r.run_id)
            done = self.conn.execute(
                update(t)
                .where(*row, t.c.status == Status.RUNNING)
                .values(
                    status=r.status,
                    finished_at=self.now,
                    error=r.error,
                    told=r.told,
                    duration_s=r.duration_s,
                    retry_at=None
                    if r.retry_in_s is None
                    else self.now + timedelta(seconds=r.retry_in_s),
                )
            ).rowcount
            if done == 1:
                out.append(Recorded(r, True, False, self.now))
                continue
            again = self.conn.execute(select(t.c.finished_at).where(*row, t.c.status == r.status))
            earlier = again.first()
            out.append(Recorded(r, False, earlier is not None, earlier[0] if earlier else None))
        return out

    def finish_streaks(self, done: list[Recorded]) -> dict[int, Settled]:
        """Job key -> what its finish did to its streaks, in key order."""
        j = tables.jobs
        out: dict[int, Settled] = {}
        for d in sorted(done, key=lambda d: d.request.key):
            r, finished = d.request, d.finished_at
            ended = (Status.SUCCEEDED, Status.FAILED, Status.CRASHED)  # crashed: abandoned
            if not d.now or r.status not in ended:
                continue
            if r.retry_in_s is not None:  # another attempt is to come: not the tick's end
                continue
            self._ensure_job(r.key, self._job_name(r))
            row = self.conn.execute(select(j).where(j.c.job_key == r.key)).one()
            crashed = r.status == Status.CRASHED  # at shutdown: ends its tick as a failure
            # No tick skipped behind it either (a replica ahead may skip one before it is due).
            kept_up = (
                not crashed
                and row.consecutive_skips == 0
                and (r.next_due is None or (finished is not None and finished <= r.next_due))
            )
            failed = r.status in (Status.FAILED, Status.CRASHED)
            failures = row.consecutive_failures + 1 if failed else 0
            fail_alert = failed and not row.fail_alerted and failures >= r.fail_threshold
            recovered = not failed and row.fail_alerted
            skips_recovered = kept_up and row.skip_alerted
            self.conn.execute(
                update(j)
                .where(j.c.job_key == r.key)
                .values(
                    consecutive_failures=failures,
                    fail_alerted=failed and (row.fail_alerted or fail_alert),
                    skip_alerted=row.skip_alerted and not kept_up,
                    overrun_skips=0 if kept_up else row.overrun_skips,
                )
            )
            who = {"instance": self.instance, "run_id": r.run_id}
            due = [
                (fail_alert, "job.failures_exceeded", {
                    "consecutive_failures": failures, "threshold": r.fail_threshold,
                    **who, "error": r.error, "crashed": int(crashed),
                }),
                (recovered, "job.failures_recovered", {
                    "consecutive_failures": row.consecutive_failures, **who,
                }),
                (skips_recovered, "job.recovered", {
                    "consecutive_skips": row.overrun_skips, **who,
                }),
            ]  # fmt: skip
            notices = tuple(
                self._notice(event, TickRef(r.key, r.scheduled_at), row.job_name, **facts)
                for raised, event, facts in due
                if raised
            )
            shown = failures if failed else row.consecutive_failures
            out[r.key] = Settled(shown, fail_alert, recovered, skips_recovered, notices)
        return out


class _Retries(_Shared):
    # -- scheduler_claim_retries ---------------------------------------------------------

    def claim_retries(
        self, keys: Sequence[int], capacity: int, crashed: str, thresholds: dict[int, int]
    ) -> Retries:
        """Due retries of these jobs, lock first; one attempt per job (as in postgres.sql)."""
        waiting = self._waiting_retries(keys)
        started: list[ClaimResult] = []
        crashes: dict[int, Crashes] = {}
        for row in waiting:  # oldest tick first, as postgres.sql takes them
            if len(started) >= capacity:
                break
            due = row.retry_at <= self.now and all(r.key != row.job_key for r in started)
            if not due or not self._lock(row.job_key, row.scheduled_at):
                continue
            result, stale = self._start_retry(row, crashed, thresholds.get(row.job_key, 3))
            if stale.count:
                crashes[row.job_key] = stale
            started.append(result)
        self.count_crashes(crashes)  # after every attempt is started, as in postgres.sql
        taken = {r.key for r in started}
        later = [r.retry_at for r in waiting if r.job_key not in taken]
        next_in = (min(later) - self.now).total_seconds() if later else None
        return Retries(started, next_in)

    def _waiting_retries(self, keys: Sequence[int]) -> list[Any]:
        t = tables.ticks
        paused = self._paused(set(keys))
        query = (
            select(t)
            .where(
                t.c.retry_at.is_not(None),
                t.c.status == Status.FAILED,
                t.c.job_key.in_(sorted(set(keys) - paused)),
            )
            .order_by(t.c.scheduled_at, t.c.job_key)
        )
        return list(self.conn.execute(query))

    def _start_retry(
        self, row: Any, crashed: str, fail_threshold: int
    ) -> tuple[ClaimResult, Crashes]:
        """The failed attempt kept in `attempts`; the row runs again, here, as the next one."""
        t = tables.ticks
        self.conn.execute(
            insert(tables.attempts)
            .values(
                job_key=row.job_key,
                scheduled_at=row.scheduled_at,
                attempt=row.attempt,
                instance=row.instance,
                run_id=row.run_id,
                status=Status.FAILED,
                started_at=row.started_at,
                finished_at=row.finished_at,
                duration_s=row.duration_s,
                error=row.error,
                told=row.told,
            )
            .on_conflict_do_nothing()
        )
        run_id = self._next_run_id()
        self.conn.execute(
            update(t)
            .where(t.c.job_key == row.job_key, t.c.scheduled_at == row.scheduled_at)
            .values(
                status=Status.RUNNING,
                attempt=row.attempt + 1,
                instance=self.instance,
                run_id=run_id,
                started_at=self.now,
                finished_at=None,
                duration_s=None,
                error=None,
                told=None,
                retry_at=None,
                holder=None,
            )
        )
        stale = self._crash_others(
            TickRef(row.job_key, row.scheduled_at),
            crashed,
            name=row.job_name,
            fail_threshold=fail_threshold,
        )
        result = ClaimResult(
            row.job_key,
            row.scheduled_at,
            Outcome.RUN,
            run_id,
            self.now,
            crashed=stale.count,
            attempt=row.attempt + 1,
        )
        return result, stale


class _Recheck(_Shared):
    """scheduler_recheck: runs whose lease ran out, asked again before they start."""

    def recheck(self, runs: Sequence[Recheck]) -> list[Outcome]:
        paused = self._paused({r.key for r in runs if r.kind != "asked" and not r.give_back})
        return [self._recheck_one(r, r.key in paused) for r in runs]

    def _recheck_one(self, r: Recheck, paused: bool) -> Outcome:
        t = tables.ticks
        mine = (
            t.c.job_key == r.key,
            t.c.scheduled_at == r.scheduled_at,
            t.c.run_id == r.run_id,
            t.c.status == Status.RUNNING,
        )
        if r.give_back:
            self.conn.execute(delete(t).where(*mine))
            return Outcome.LOST
        change: dict[str, Any] = {"started_at": self.now}
        if paused and r.kind == "retry":
            change = self._attempt_before(r)
        elif paused:
            change = {"status": Status.PAUSED, "run_id": None, "started_at": None}
            change["caught_up"] = False
        if not change or not self.conn.execute(update(t).where(*mine).values(**change)).rowcount:
            return Outcome.LOST
        return Outcome.PAUSED if paused else Outcome.RUN

    def _attempt_before(self, r: Recheck) -> dict[str, Any]:
        """A retry paused before it began: its row as the failed attempt before it, due
        again now (it waits for the resume), as `_start_retry` found it."""
        t, a = tables.ticks, tables.attempts
        attempt = self.conn.execute(
            select(t.c.attempt).where(t.c.job_key == r.key, t.c.scheduled_at == r.scheduled_at)
        ).scalar()
        if attempt is None:
            return {}
        row = self.conn.execute(
            select(a).where(
                a.c.job_key == r.key, a.c.scheduled_at == r.scheduled_at, a.c.attempt == attempt - 1
            )
        ).first()
        if row is None:
            return {}
        kept = ("status", "attempt", "instance", "run_id", "started_at", "finished_at")
        change = {name: getattr(row, name) for name in (*kept, "duration_s", "error", "told")}
        change["retry_at"] = self.now
        return change


class Steps(_Decide, _Finish, _Retries, _Recheck):
    """One transaction's worth of steps, by the names of postgres.sql's functions' steps."""


def _overran(tick: Tick) -> bool:
    """A skip that counts in the job's skip streak: not one behind a run asked for by hand."""
    return tick.fate is Status.SKIPPED and not tick.by_hand


def claimed(
    ticks: list[Tick], crashed: dict[int, Crashes], streaks: Streaks, alerts: dict[int, int]
) -> ClaimAnswer:
    """The claim's answer, in the shape of scheduler_decide's (never a tick `yielded`)."""
    rest: dict[Fate, list[TickRef]] = {outcome: [] for outcome in UNRECORDED}
    answered = []
    for tick in ticks:
        if tick.fate in rest:
            rest[tick.fate].append(TickRef(tick.key, tick.request.scheduled_at))
        else:
            answered.append(_result(tick, crashed, streaks, alerts))
    return ClaimAnswer(answered, rest[Outcome.LOST], rest[Outcome.YIELDED], rest[Outcome.DEFERRED])


def _result(
    tick: Tick, crashed: dict[int, Crashes], streaks: Streaks, alerts: dict[int, int]
) -> ClaimResult:
    """A tick this replica recorded, or could not lock: what its answer carries."""
    r = tick.request
    outcome = Outcome.RUN if tick.fate is Status.RUNNING else Outcome(tick.fate)
    found = streaks.get((r.key, r.scheduled_at)) or streaks.get((r.key, None), NO_STREAK)
    if outcome not in (Outcome.RUN, Outcome.SKIPPED):
        found = NO_STREAK
    notice = found.notice
    if outcome is Outcome.RUN and notice is None:
        notice = alerts.get(r.key)  # its crashed predecessors reached fail_alert_after
    return ClaimResult(
        r.key,
        r.scheduled_at,
        outcome,
        tick.run_id,
        tick.started_at,
        tick.holder,
        tick.holder_since,
        found.streak,
        found.alert,
        crashed[r.key].count if outcome is Outcome.RUN and r.key in crashed else 0,
        () if notice is None else (notice,),
    )
