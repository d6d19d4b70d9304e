"""A simulated fleet: several gates over one backend, in one process, played step by step.

Each replica has its own clock (a skew over the world's time), its own lock
session (`Faulty` over a real backend) and a pool that hands its runs to the
simulation, which decides when each one ends and how. Nothing sleeps and no
thread of the gate is started: a step is `Gate.step()`, where the dispatcher
thread would call it. The world's time is the monotonic clock of every gate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import zlib
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import select, update

from scheduler.backends.base import (
    ClaimAnswer,
    ClaimRequest,
    ClaimResult,
    FinishRequest,
    FinishResult,
    Intent,
    Outcome,
    Retries,
)
from scheduler.config.schedules import _ticks, tick_after
from scheduler.fleet import catch_up, pauses
from scheduler.fleet.housekeeping import SWEEP_EVERY
from scheduler.gate import Gate
from scheduler.gate.runs import Run
from scheduler.ledger import tables
from scheduler.ledger.history import TickRow
from scheduler.ledger.outbox import NOTICE_LEASE
from scheduler.ledger.registrations import Registration
from scheduler.observers import events
from scheduler.registry.catalog import CatalogJob, schedule_text
from scheduler.statuses import TIMED_OUT, Status
from tests.simulation import jobs, rules, sweeps
from tests.simulation.faults import Faulty
from tests.simulation.outbox import Heard, Receiver, SimNotices, outbox_clock
from tests.simulation.rules import Violation
from tests.simulation.sites import HOLDER_TIMEOUT
from tests.simulation.steps import ARMED, CALL_FAULTS, Step
from tests.support import JobsDesk

REPLICAS = 3
MAX_WORKERS = 3
BY_HAND = frozenset({Intent.MANUAL, Intent.CATCH_UP})
# Steps that change neither the ledger nor the locks unless a gate calls its backend
# (which `touched` notes): the rules that read them are not read again after these.
QUIET = frozenset({"tick", "freeze", "clock_jump", "clock_skew", "reload", "run_now", "finish"})
EPOCH = 1000.0  # the gates' monotonic clock at the world's start
LONGEST_TICK = 4.4  # seconds a tick step lets pass, at most
STALL_EVERY = 4  # hand-overs of runs to the workers, of which one stops its process
# Seconds a pause's transaction takes: it commits after every claim sent before its step.
PAUSE_COMMITS = 0.001


class CutShort(ConnectionError):
    """A sweep cut short as it records missed ticks (what it did before stays committed)."""


@dataclass(eq=False)
class SimRun:
    replica: Replica
    run: Run
    handed_at: float  # when the gate last handed it to the workers (monotonic)
    lock_gone: bool = False  # its session ended under it (the replica may not know yet)
    ended: bool = False

    @property
    def key(self) -> int:
        return self.run.job.key

    @property
    def scheduled_at(self) -> datetime:
        return self.run.ctx.scheduled_at

    @property
    def attempt(self) -> int:
        return self.run.ctx.attempt

    @property
    def run_id(self) -> int:
        return self.run.ctx.run_id

    @property
    def scheduled(self) -> bool:
        """A tick the job's schedule fired (not a retry, a run-now or a caught-up tick)."""
        return self.run.manual is None and self.attempt == 1

    def told(self) -> bool:
        return self.run.ctx.lock_lost.is_set()


Begin = Callable[[Run, events.RunStarted], bool]
Started = Callable[[Run, float], None]  # a run started, and when it was handed over


class SimPool:
    """The gate's workers (scheduler/gate/workers.py), each run they start the simulation's
    to play: at most `max_workers` going at once, the rest waiting in the order handed
    over, as in the real pool; runs won ahead of a free worker wait there under a lease.

    Every start asks the run table first, as `RunTable.execute` does (`begin`): a run it
    refuses is no longer the pool's (handed back to the dispatcher past its lease, or
    recorded crashed), and may come back with a new lease (`RunTable.relet`).
    """

    def __init__(
        self,
        max_workers: int,
        monotonic: Callable[[], float],
        started: Started,
        frozen: Callable[[], bool],
        handing: Callable[[], None] = lambda: None,
    ) -> None:
        self.max_workers = max_workers
        self.monotonic = monotonic
        self.started = started
        self.frozen = frozen  # the process is stopped: its workers take nothing
        self.handing = handing  # runs are handed over (the process may stop there)
        self.begin: Begin | None = None  # the gate's `RunTable.begin`, once the gate exists
        self.waiting: deque[tuple[Run, events.RunStarted, float]] = deque()
        self.going: list[Run] = []  # started here and not ended (`Run.ended` unset)

    def submit_all(self, tasks: list[tuple[Callable[..., None], tuple[object, ...]]]) -> None:
        now = self.monotonic()
        for _fn, (run, event) in tasks:
            assert isinstance(run, Run) and isinstance(event, events.RunStarted)
            self.waiting.append((run, event, now))
        self.handing()
        self.take()

    def take(self) -> None:
        """Each free worker takes the run that has waited longest, if `begin` lets it start."""
        assert self.begin is not None
        if self.frozen():
            return
        self.going = [run for run in self.going if run.ended is None]
        while self.waiting and len(self.going) < self.max_workers:
            run, event, handed_at = self.waiting.popleft()
            if self.begin(run, event):
                self.going.append(run)
                self.started(run, handed_at)

    def wait(self, timeout: float | None = None) -> bool:
        return True

    def shutdown(self) -> None:
        return None


@dataclass(eq=False)
class Replica:
    name: str
    proxy: Faulty
    gate: Gate
    catalog: dict[int, CatalogJob]
    fired: datetime  # the last instant its scheduler fired ticks up to (its own clock)
    skew: timedelta = timedelta(0)
    frozen_since: float | None = None
    frozen_until: float = 0.0
    killed_while_frozen: bool = False
    in_force: list[InForce] = field(default_factory=list)  # its registrations
    notices: SimNotices | None = None  # its deliverer of the outbox
    killed: set[int] = field(default_factory=set)  # its lock sessions ended under it

    def frozen(self, now: float) -> bool:
        return self.frozen_since is not None and now < self.frozen_until

    @property
    def pool(self) -> SimPool:
        pool = self.gate.table.workers
        assert isinstance(pool, SimPool)
        return pool


@dataclass
class World:
    site: Any  # sites.PgSite or sites.EmbeddedSite
    start: datetime
    t: float = 0.0  # seconds of world time since `start`
    replicas: list[Replica] = field(default_factory=list)
    runs: list[SimRun] = field(default_factory=list)
    started: dict[tuple[int, datetime, int], str] = field(default_factory=dict)
    max_run_id: dict[int, int] = field(default_factory=dict)  # by job
    paused: dict[int, float] = field(default_factory=dict)  # when each pause committed
    streaks: dict[int, int] = field(default_factory=dict)  # skip streaks, from the claims
    failures: dict[int, int] = field(default_factory=dict)  # failure streaks, from the calls
    counted_ends: set[tuple[int, datetime, int | None]] = field(default_factory=set)
    thresholds: dict[int, int] = field(default_factory=dict)  # of each job's latest skip
    reached: dict[int, int] = field(default_factory=dict)  # streaks that reached it, by job
    alerted: set[int] = field(default_factory=set)  # jobs whose streak reached it
    faults: Counter[str] = field(default_factory=Counter)
    checked: int = 0  # rules checked
    # Each whole sweep (its missed ticks recorded): its clock, and the jobs live replicas had.
    swept: list[tuple[datetime, frozenset[int]]] = field(default_factory=list)
    fired: set[tuple[int, datetime]] = field(default_factory=set)  # by some replica's scheduler
    tracked_since: datetime = field(init=False)
    touched: bool = True  # a call or a step may have changed the ledger or the locks
    step_errors: int = 0  # errors a step let through (the real loop logs them, goes on)
    restarts: int = 0
    log: list[str] = field(default_factory=list)  # what happened, for a failure's report
    reference: Reference = field(init=False)
    # The outbox: the webhook every replica POSTs to, and what the gates said of alerts
    # (event, job key, notice ids, flags), the rules' part read after each step.
    receiver: Receiver = field(default_factory=Receiver)
    heard: list[tuple[str, int, tuple[int, ...], dict[str, Any]]] = field(default_factory=list)
    heard_checked: int = 0
    outbox_ahead: float = 0.0  # seconds the outbox's clock is ahead of the database's
    played: int = 0  # steps played (and settle's rounds): what the rules read once per step
    ledger_read: tuple[int, Any] = (-1, None)  # rules.py's read of the streaks and outbox
    comparable: bool = False  # the faults both backends meet alike only (see twins.py)
    step_now: Step | None = None  # the step being played
    gates: list[Gate] = field(default_factory=list)  # every one made, gone or not
    settling: bool = False
    ahead_anyway: bool = False  # the embedded backend claims ahead too (Faulty.claims_ahead)

    # What each job's replicas registered, as the world saw it (the rule's own record),
    # and as the ledger's registrations (what catch-up plans from).
    history: dict[int, list[InForce]] = field(default_factory=dict)
    registered: list[Registration] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reference = Reference(self.start - timedelta(hours=2))
        began, ended = self.start - jobs.DOWN_FOR - jobs.RAN_FOR, self.start - jobs.DOWN_FOR
        self.tracked_since = began
        sweeps.track(self.site.engine, jobs.catalog(1), began)
        self._register("gone", jobs.catalog(1), began, ended)

    def _register(
        self, name: str, catalog: dict[int, CatalogJob], since: datetime, until: datetime | None
    ) -> list[InForce]:
        made = []
        for job in catalog.values():
            held = InForce(job, since, until)
            self.history.setdefault(job.key, []).append(held)
            made.append(held)
            self.registered.append(
                Registration(name, job.key, job.name, schedule_text(job), since, until)
            )
        sweeps.write_registrations(self.site.engine, self.registered[-len(made) :])
        return made

    def say(self, text: str) -> None:
        self.log.append(f"t={self.t:.1f} {text}")

    # -- the world's clocks ----------------------------------------------------------

    def monotonic(self) -> float:
        return EPOCH + self.t

    def now(self) -> datetime:
        return self.start + timedelta(seconds=self.t)

    # -- replicas --------------------------------------------------------------------

    def add_replica(self, name: str, variant: int, skew: timedelta = timedelta(0)) -> Replica:
        catalog = jobs.catalog(variant)
        real = self.site.backend(f"{name}#{self.restarts}")
        self.restarts += 1
        holder: list[Replica] = []
        proxy = Faulty(
            real,
            kill=lambda: self._kill(holder[0]),
            fired=lambda kind: self.faults.update([kind]),
            observe=self._observe,
            say=lambda text: self.say(text),
            touch=self._touch,
            ahead=lambda: datetime.now(UTC) - self.now(),
        )
        # Before the gate is made: it reads whether its backend claims ahead once.
        proxy.comparable, proxy.ahead_anyway = self.comparable, self.ahead_anyway
        pool = SimPool(
            MAX_WORKERS,
            self.monotonic,
            lambda run, at: self._started(holder[0], run, at),
            frozen=lambda: holder[0].frozen(self.t),
            handing=lambda: self._handing(holder[0]),
        )
        replica_clock = lambda: self.now() + holder[0].skew  # noqa: E731
        notices = SimNotices(
            real.ledger_engine,
            real.instance,
            self.receiver,
            outbox_clock(lambda: self.outbox_ahead),
            self.monotonic,
        )
        gate = Gate(
            proxy,  # type: ignore[arg-type]
            instance=real.instance,
            max_workers=MAX_WORKERS,
            holder_timeout=HOLDER_TIMEOUT,
            listeners=(notices, Heard(self.heard)),
            clock=replica_clock,
            monotonic=self.monotonic,
            desk=JobsDesk(*catalog.values()),
            workers=pool,
        )
        pool.begin = gate.table.begin
        self.gates.append(gate)
        replica = Replica(name, proxy, gate, catalog, fired=self.now() + skew, skew=skew)
        replica.notices = notices
        replica.in_force = self._register(real.instance, catalog, self.now(), None)
        holder.append(replica)
        return replica

    def live_runs(self) -> list[SimRun]:
        return [r for r in self.runs if not r.ended]

    def _started(self, replica: Replica, run: Run, handed_at: float) -> None:
        """A run starts; its lock is gone already if its session ended as it waited."""
        sim = SimRun(replica, run, handed_at, lock_gone=run.session in replica.killed)
        self.say(
            f"{replica.name} starts {run.job.key} {run.ctx.scheduled_at:%H:%M:%S.%f} "
            f"attempt {run.ctx.attempt} run_id {run.ctx.run_id}"
            + ("" if run.lease_until is None else f" lease t={run.lease_until - EPOCH:.1f}")
        )
        for rule in rules.ON_START:
            self.checked += 1
            rule(self, sim)
        self.runs.append(sim)

    def _observe(self, name: str, args: tuple[Any, ...], result: Any) -> None:
        """What a call committed: the skip streaks its claims make (a skip grows the job's,
        a run ends it; a skip behind a run asked for by hand counts in none)."""
        if name in ("claim", "claim_retries", "finish", "release_strays"):
            self.say(f"{name} -> {_brief(result)}")
        if name == "claim":
            requests: list[ClaimRequest] = args[0]
            self._streaks(requests, result.every())
            self._crashes(result.every())
        if name == "claim_retries":
            self._crashes(result.started)
        if name == "finish":
            self._failures(args[0], result)
        if name == "untaken":  # other replicas' ticks held here, probed (gate/others.py)
            self.faults.update(
                {"probe_answered": 1, "probe_ticks": len(args[0]), "probe_untaken": len(result)}
            )
        if name == "recheck":  # runs won ahead, asked again past their lease: how often
            self.say(f"recheck -> {', '.join(str(outcome) for outcome in result)}")
            self.faults.update(["recheck_answered", *(f"recheck_{said}" for said in result)])
        # A retry is a failed tick's next attempt: it changes no streak (see Retries in
        # docs/run-policies.md), whether it starts or ends.

    def _streaks(self, requests: list[ClaimRequest], results: list[ClaimResult]) -> None:
        asked = {(r.key, r.scheduled_at): r for r in requests}
        ran = {r.key for r in results if r.outcome is Outcome.RUN}
        for key in ran:
            self.streaks[key] = 0
            self.alerted.discard(key)
        for result in results:
            request = asked[(result.key, result.scheduled_at)]
            if result.outcome is not Outcome.SKIPPED or request.intent in BY_HAND:
                continue
            if result.key in ran or self._behind_by_hand(result.key):
                continue
            self.streaks[result.key] = self.streaks.get(result.key, 0) + 1
            thresholds = [
                r.skip_threshold
                for r in requests
                if r.key == result.key and r.intent not in BY_HAND
            ]
            self.thresholds[result.key] = min(thresholds)
        for key, streak in self.streaks.items():
            if key not in self.alerted and streak >= self.thresholds.get(key, streak + 1):
                self.alerted.add(key)  # this streak reached its threshold: one alert
                self.reached[key] = self.reached.get(key, 0) + 1

    def _crashes(self, results: list[ClaimResult]) -> None:
        """A run a claim found stale (its replica died or lost the lock) counts as failed."""
        for result in results:
            if result.outcome is Outcome.RUN and result.crashed:
                self.failures[result.key] = self.failures.get(result.key, 0) + result.crashed

    def _failures(self, requests: list[FinishRequest], results: list[FinishResult]) -> None:
        """A tick's last attempt ends the failure streak (succeeded) or grows it (failed,
        crashed); an attempt with another to come, an interruption, or a finish whose row
        was no longer the run's (crashed meanwhile) change nothing. A run that never
        started (`crashed`) whose row a claim or a sweep found crashed first is answered
        as if sent again, with no streak: it too changes nothing."""
        asked = {(r.key, r.scheduled_at): r for r in requests}
        for result in results:
            request = asked[(result.key, result.scheduled_at)]
            if not result.recorded or request.retry_in_s is not None:
                continue
            if request.status is Status.CRASHED and result.consecutive_failures is None:
                continue
            once = (request.key, request.scheduled_at, request.run_id)
            if once in self.counted_ends:
                continue  # sent again after its reply was lost: the same end
            self.counted_ends.add(once)
            if request.status is Status.SUCCEEDED:
                self.failures[result.key] = 0
            elif request.status in (Status.FAILED, Status.CRASHED):
                self.failures[result.key] = self.failures.get(result.key, 0) + 1

    def _behind_by_hand(self, key: int) -> bool:
        """A skip behind a run a person asked for counts in no streak (the newest running
        row of the job is the run that held the lock)."""
        t = tables.ticks
        query = (
            select(t.c.manual)
            .where(t.c.job_key == key, t.c.status == "running")
            .order_by(t.c.scheduled_at.desc())
            .limit(1)
        )
        with self.site.engine.connect() as conn:
            return bool(conn.execute(query).scalar())

    def _kill(self, replica: Replica) -> bool:
        """The replica's lock session ends under it: its locks go, its runs go on.
        False where only the replica itself can find its session lost (embedded)."""
        session = replica.gate.session
        self.touched = True
        if not self.site.kill(replica.proxy):
            return False
        replica.killed.add(session.opened)
        for sim in self.live_runs():
            if sim.replica is replica and sim.run.session == session.opened:
                sim.lock_gone = True
        return True

    # -- playing a step --------------------------------------------------------------

    def _touch(self) -> None:
        self.touched = True

    def play(self, step: Step) -> None:
        self.say(str(step))
        self.played += 1
        self.step_now = step
        self.touched = step.action not in QUIET
        getattr(self, f"_{step.action}")(step)
        self.take_waiting()
        self.deliver()
        if not self.touched:
            return
        for rule in rules.AFTER_STEP:
            self.checked += 1
            rule(self)

    def take_waiting(self) -> None:
        """Workers free, of each replica not frozen, take the runs waiting for them."""
        for replica in self.replicas:
            if not replica.frozen(self.t):
                replica.pool.take()

    def deliver(self) -> None:
        """Each replica not frozen delivers what is due (its thread, had it run meanwhile)."""
        for replica in self.replicas:
            if replica.notices is not None and not replica.frozen(self.t):
                replica.notices.pump()

    def _replica(self, index: int) -> Replica:
        return self.replicas[index % len(self.replicas)]

    def _step_one(self, replica: Replica) -> None:
        if replica.frozen(self.t):
            return
        if replica.frozen_since is not None:  # thawed: its workers go on, as its dispatcher
            replica.frozen_since = None
            replica.pool.take()
        self._dispatch(replica)

    def _dispatch(self, replica: Replica) -> None:
        """One step of the replica's dispatcher (`Gate.step`); an error is logged, as the
        real loop does, and the step counted."""
        try:
            replica.gate.step()
        except Violation:
            raise
        except Exception as exc:
            self.say(f"{replica.name} step failed: {exc!r}"[:300])
            self.step_errors += 1

    def _tick(self, step: Step) -> None:
        self._pass(0.5 + (step.a % 40) / 10)

    def _pass(self, seconds: float) -> None:
        """World time passes; each replica's scheduler fires the ticks its clock passed."""
        self.t += seconds
        for replica in self.replicas:
            self._frozen_too_long(replica)
            if replica.frozen(self.t):
                continue
            self.fire(replica)

    def fire(self, replica: Replica) -> None:
        """APScheduler's part: each tick in (last fired, the replica's now] goes to the gate."""
        until = self.now() + replica.skew
        if until <= replica.fired:
            return
        with replica.gate.burst():
            for job in replica.catalog.values():
                if not job.scheduled:
                    continue
                assert job.trigger is not None
                ticks = fired_ticks(job, replica.fired, until)
                self.checked += 1
                expected = self.reference.between(job, replica.fired, until)
                rules.same_instants(self, job.key, ticks, expected, replica.name)
                for tick in ticks:
                    self.fired.add((job.key, tick))
                    replica.gate.submit(job, tick)
        replica.fired = until

    def _next_tick_in(self, replica: Replica) -> float:
        """Seconds until the replica's scheduler fires its next tick."""
        triggers = [job.trigger for job in replica.catalog.values() if job.scheduled]
        ticks = [tick_after(t, replica.fired) for t in triggers if t is not None]
        soonest = min((tick for tick in ticks if tick is not None), default=replica.fired)
        return max(0.0, (soonest - (self.now() + replica.skew)).total_seconds())

    def _handing(self, replica: Replica) -> None:
        """The replica's process may stop (a GC pause, a CPU quota) at the end of a step of
        its dispatcher that handed runs over, before its workers took them: one hand-over
        in `STALL_EVERY`, by its step and replica, for 1 to 4 s. Its workers take those runs
        after, and each won ahead is past its lease. Not as the fleet settles, nor in a
        comparable play (see twins.py)."""
        step = self.step_now
        if step is None or self.comparable or self.settling or replica.frozen_since is not None:
            return
        draw = zlib.crc32(f"{step} {replica.name}".encode())
        if draw % STALL_EVERY:
            return
        replica.frozen_since, replica.killed_while_frozen = self.t, False
        replica.frozen_until = self.t + 1 + draw // STALL_EVERY % 4
        self.say(f"{replica.name} stalls until t={replica.frozen_until:.1f}")
        self.faults.update(["stalled_replica"])

    def _frozen_too_long(self, replica: Replica) -> None:
        """PostgreSQL ends a session quiet for holder_timeout (idle_session_timeout)."""
        if replica.frozen_since is None or replica.killed_while_frozen:
            return
        if self.t - replica.frozen_since > HOLDER_TIMEOUT and replica.frozen(self.t):
            replica.killed_while_frozen = True
            self._kill(replica)  # embedded: kernel locks stay with the frozen process

    def _step_all(self, step: Step) -> None:
        for replica in self.replicas:
            self._step_one(replica)

    def _step(self, step: Step) -> None:
        self._step_one(self._replica(step.a))

    def _finish(self, step: Step) -> None:
        """One run ends: succeeds, fails, times out, is interrupted, or goes on regardless."""
        live = [r for r in self.live_runs() if not r.replica.frozen(self.t)]
        if not live:
            return
        # In an order of their own, not the order they started in: a backend answers a
        # claim's ticks in an order of its own, and the step must mean the same on both.
        live.sort(key=lambda r: (r.replica.name, r.key, r.scheduled_at, r.attempt))
        sim = live[step.a % len(live)]
        choice = step.b % 10
        if choice == 9:
            return  # it ignores what it was told, and goes on
        run = sim.run
        told = sim.told() or run.ctx.stopping.is_set()
        if choice in (5, 6) or (choice == 4 and run.job.retries):  # jobs with retries fail more
            status, error = Status.FAILED, "the job failed"
        elif choice == 7 and run.job.timeout is not None:
            run.ctx.timed_out.set()
            status, error = Status.FAILED, TIMED_OUT.format(timeout="20s")
        elif choice == 8 and told:
            status, error = Status.INTERRUPTED, "interrupted"
        else:
            status, error = Status.SUCCEEDED, None
        self._end(sim, status, error)

    def _end(self, sim: SimRun, status: Status, error: str | None) -> None:
        """A run returns, as `RunTable.execute` ends it: its length counts towards how many
        runs are claimed ahead, its end is handed over, and its worker takes the next run."""
        sim.ended = True
        table = sim.replica.gate.table
        table.lengths.add(self.monotonic() - sim.run.started)
        table.ended(sim.run, status, error)
        sim.replica.pool.take()

    def _end_all(self, status: Status, error: str | None, replica: Replica | None = None) -> None:
        """Every live run ends (of `replica`, or of all), and so does each that a worker
        freed by them takes from its queue."""
        while live := [s for s in self.live_runs() if replica in (None, s.replica)]:
            for sim in live:
                self._end(sim, status, error)

    def _fault_call(self, step: Step) -> None:
        """A fault for the next call that changes something, or for the next of one kind;
        it goes to a replica with none waiting (where every one waits, it takes the place
        of one). Time passes (a tick) and that replica takes a step at once: the fault
        meets whatever it has to do, most often a claim."""
        count = len(self.replicas)
        order = [self._replica(step.a + i) for i in range(count)]
        replica = next((r for r in order if r.proxy.armed is None), order[0])
        targets = (None, None, None, "claim", "finish", "claim_retries")
        target = targets[(step.c >> 8) % len(targets)]
        replica.proxy.armed = (ARMED[step.b % len(ARMED)], step.c, target)
        self._tick(step)
        self._step_one(replica)

    def _freeze(self, step: Step) -> None:
        """The replica's process stops for a while. One freeze in two stops it just after
        its dispatcher handed a claim's runs over, before its workers took them: time
        passes, it claims, and its workers take those runs after the thaw (past the lease
        of each won ahead, which the dispatcher asks again before it starts); such a
        freeze ends before its lock session would (the runs are asked again, not lost)."""
        replica = self._replica(step.a)
        if replica.frozen_since is not None:
            return
        handing = step.c % 2 == 1
        if handing:  # until its next tick fires (a tick step at most): a claim hands it over
            self._pass(min(self._next_tick_in(replica), LONGEST_TICK))
        replica.frozen_since, replica.killed_while_frozen = self.t, False
        short = self.comparable or handing  # see twins.py
        longest = HOLDER_TIMEOUT - 6 if short else 60
        replica.frozen_until = self.t + 5 + step.b % int(longest)
        self.faults.update(["frozen_replica"])
        if handing:
            self._dispatch(replica)  # its workers are stopped: what it hands over waits

    def _clock_jump(self, step: Step) -> None:
        replica = self._replica(step.a)
        seconds = 1 + step.b % 120
        replica.skew += timedelta(seconds=seconds if step.c % 4 else -seconds)
        self.faults.update(["clock_jump"])

    def _clock_skew(self, step: Step) -> None:
        self._replica(step.a).skew = timedelta(seconds=step.b % 21 - 10)
        self.faults.update(["clock_skew"])

    def _restart_other_schedule(self, step: Step) -> None:
        """A rolling deploy: a graceful stop, then the replica starts with another config."""
        index = step.a % len(self.replicas)
        old = self.replicas[index]
        if old.frozen(self.t):
            return
        gate = old.gate
        gate.queue.close()
        gate.table.stopping.set()
        old.proxy.armed = None
        for _ in range(3):  # what waits for a worker starts, told to stop, and is interrupted
            self._end_all(Status.INTERRUPTED, "stopping", old)
            self._step_one(old)
            if not gate.table.running_keys():
                break
        self._gone(old)
        self.replicas[index] = self.add_replica(old.name, step.b % 3, old.skew)
        self.faults.update(["restart_other_schedule"])

    def _crash_restart(self, step: Step) -> None:
        index = step.a % len(self.replicas)
        old = self.replicas[index]
        self._gone(old)
        self.replicas[index] = self.add_replica(old.name, step.b % 3, old.skew)
        self.faults.update(["crash_restart"])

    def _gone(self, replica: Replica) -> None:
        """The process ends: its session and locks with it, and its runs; its schedules are
        in force until the replica that takes its place registers its own."""
        replica.proxy._real.close()
        instance = replica.proxy._real.instance
        for held in replica.in_force:
            held.until = self.now()
        sweeps.end_registrations(self.site.engine, instance, self.now())
        self.registered = [
            dataclasses.replace(r, until=self.now())
            if r.instance == instance and r.until is None
            else r
            for r in self.registered
        ]
        for sim in self.live_runs():
            if sim.replica is replica:
                sim.ended = True
        replica.notices = None  # what it had not delivered waits for its leases to run out
        self.outbox_ahead += NOTICE_LEASE.total_seconds() + 1

    def _reload(self, step: Step) -> None:
        """A changed config.yaml (one job's skip_alert_after), reloaded by one replica, or by
        each in turn (a fleet-wide change)."""
        key = jobs.KEYS[step.b % len(jobs.KEYS)]
        chosen = self.replicas if step.a % 2 else [self._replica(step.a >> 1)]
        for replica in chosen:
            job = replica.catalog.get(key)
            if job is None:
                continue
            replica.catalog[key] = jobs.with_threshold(job, 1 + step.c % 4)
            replica.gate.desk.jobs = replica.catalog  # type: ignore[union-attr]
            replica.gate.reloaded(replica.catalog.get)
        self.faults.update(["reload"])

    def _pause_resume(self, step: Step) -> None:
        """`scheduler pause` or `resume`; its commit is a moment after the claims before it."""
        key = jobs.KEYS[step.a % len(jobs.KEYS)]
        self.t += PAUSE_COMMITS
        with self.site.engine.begin() as conn:
            if key in self.paused:
                pauses.resume(conn, key, f"job{key}", by="sim", now=datetime.now(UTC))
                del self.paused[key]
            else:
                pauses.pause(conn, key, f"job{key}", by="sim", reason=None, now=datetime.now(UTC))
                self.paused[key] = self.monotonic()
        self.faults.update(["pause_resume"])

    def _run_now(self, step: Step) -> None:
        replica = self._replica(step.a)
        job = replica.catalog.get(jobs.KEYS[step.b % len(jobs.KEYS)])
        if job is None or replica.frozen(self.t):
            return
        replica.gate.manual.add(job, Future())
        self.faults.update(["run_now"])

    def _retry_due(self, step: Step) -> None:
        t = tables.ticks
        past = datetime.now(UTC) - timedelta(seconds=1)
        with self.site.engine.begin() as conn:
            conn.execute(update(t).where(t.c.retry_at.is_not(None)).values(retry_at=past))
        for replica in self.replicas:
            replica.gate.retries.due_in(0)
        self.faults.update(["retry_due"])
        if step.b % 2:  # and a fault waits for one replica's look, which it makes at once
            replica = self._replica(step.c)
            if replica.proxy.armed is None:
                fault = CALL_FAULTS[(step.b >> 1) % len(CALL_FAULTS)]
                replica.proxy.armed = (fault, step.c >> 4, "claim_retries")
                self._step_one(replica)

    def _catch_up(self, step: Step) -> None:
        """A catch-up pass: one tick of `slow` from before the fleet came up, lock first."""
        replica = self._replica(step.a)
        job = replica.catalog[jobs.SLOW]
        if replica.frozen(self.t):
            return
        assert job.trigger is not None
        if replica.gate.manual.has(job.key):
            return  # one pass per job at a time, each tick claimed once the last has answered
        t = tables.ticks
        with self.site.engine.connect() as conn:
            have = set(
                conn.execute(select(t.c.scheduled_at).where(t.c.job_key == job.key)).scalars()
            )
        mine = [r for r in self.registered if r.key == job.key]
        to_run, _ = catch_up.plan(job, mine, self.now(), self.start, have)
        if not to_run:
            return
        replica.gate.manual.add(job, Future(), to_run[step.b % len(to_run)], Intent.CATCH_UP)
        if step.c % 2 and replica.proxy.armed is None:  # a fault waits for its claim
            fault = CALL_FAULTS[(step.c >> 1) % len(CALL_FAULTS)]
            replica.proxy.armed = (fault, step.c >> 4, "claim")
        self.faults.update(["catch_up"])

    def _database_restart(self, step: Step) -> None:
        """Every session ends at once; on the embedded backend, each replica's next call
        finds its session lost (not in a comparable play: see twins.py)."""
        if self.comparable:
            return
        if self.site.kind == "postgresql":
            self.site.restart()
            for replica in self.replicas:
                replica.killed.add(replica.gate.session.opened)
            for sim in self.live_runs():
                sim.lock_gone = True
        else:
            for replica in self.replicas:
                replica.proxy.armed = ("lost", 0, None)
        self.faults.update(["database_restart"])

    def sweep_now(self) -> datetime:
        """The sweep's clock: the database's, which is the world's (no skew)."""
        return self.now()

    def _sweep(self, step: Step) -> None:
        """A replica's housekeeping pass (the election, stale runs, registrations, missed
        ticks); one in two is cut short as it records missed ticks (its session lost)."""
        order = [self._replica(step.a + i) for i in range(len(self.replicas))]
        awake = [r for r in order if not r.frozen(self.t)]
        if awake:
            self.sweep(awake[0], cut_short=step.b % 2 == 0)

    def sweep(self, replica: Replica, cut_short: bool = False) -> None:
        keeper = sweeps.keeper(replica.proxy._real, replica.catalog, self.sweep_now)
        if cut_short:
            keeper.sweep_missed = self._cut_short  # type: ignore[method-assign]
        counted: list[TickRow] = []
        count_crashes = keeper.count_crashes

        def counting(conn: Any, marked: list[TickRow]) -> list[int]:
            counted.extend(marked)  # runs whose replica is gone count as failed
            return count_crashes(conn, marked)

        keeper.count_crashes = counting  # type: ignore[method-assign]
        try:
            done = keeper.run_once()
        except Exception as exc:
            self.say(f"{replica.name} sweep failed: {exc}")
            self.step_errors += 1
            if isinstance(exc, CutShort):  # after the crashes' transaction was committed
                self._swept_crashes(counted)
            return
        self._swept_crashes(counted)
        if "missed" in done:
            self.swept.append((self.sweep_now(), self._live_jobs(replica)))
        if replica.notices is not None:  # on the outbox's clock: see outbox.py
            done["notices"] = replica.notices.adopt_now()
        self.say(f"{replica.name} sweep: {done}")

    def _swept_crashes(self, marked: list[TickRow]) -> None:
        """Each run a sweep found crashed ends its tick, once: a finish its replica sends
        later changes nothing (one of a run that never started says `crashed` too, and is
        answered as if sent again)."""
        for row in marked:
            self.failures[row.key] = self.failures.get(row.key, 0) + 1
            self.counted_ends.add((row.key, row.scheduled_at, row.run_id))

    def _live_jobs(self, sweeper: Replica) -> frozenset[int]:
        """The jobs of the sweeper and of the replicas live as the database sees them (a
        session that holds the presence lock), which are what a sweep can judge."""
        with self.site.engine.connect() as conn:
            live = {i["name"] for i in sweeper.proxy._real.live_instances(conn)}
        up = [r for r in self.replicas if r is sweeper or r.proxy._real.instance in live]
        return frozenset(key for r in up for key in r.catalog)

    def _cut_short(self, *args: object) -> int:
        self.faults.update(["sweep_cut_short"])
        raise CutShort("simulated: the sweep's session was lost")

    # -- the end ---------------------------------------------------------------------

    def settle(self) -> None:
        """Faults end, frozen replicas thaw, every run ends: the fleet must come to rest
        with every rule still kept."""
        self.settling = True
        for replica in self.replicas:
            replica.frozen_since, replica.proxy.armed = None, None
        for _ in range(4):  # runs started meanwhile (waiting, asked again, retries) end too
            self._end_all(Status.SUCCEEDED, None)
            self.t += HOLDER_TIMEOUT / 3 + 1
            self.play(Step("step_all"))
        whole = len(self.swept)
        for replica in self.replicas:  # the next sweep is due: a replica that can runs it
            self.t += SWEEP_EVERY
            self.sweep(replica)
            if len(self.swept) > whole:
                break
        self.settle_outbox()
        self.played += 1
        for rule in rules.AT_REST:
            self.checked += 1
            rule(self)

    def settle_outbox(self) -> None:
        """Leases run out, a replica's housekeeping adopts what nobody delivers, retries fall
        due: until the outbox has nothing left to deliver (a few rounds at most)."""
        n = tables.notices
        for _ in range(6):
            with self.site.engine.connect() as conn:
                if not conn.execute(select(n.c.id).where(n.c.done_at.is_(None)).limit(1)).first():
                    return
            self.outbox_ahead += NOTICE_LEASE.total_seconds() + 1
            for replica in self.replicas:
                assert replica.notices is not None
                replica.notices.adopt_now()
                for _ in range(4):  # retries 1, 2, 4 s apart
                    replica.notices.pump()
                    self.t += 5
                replica.notices.pump()

    def close(self) -> None:
        """Every replica ends; so do the wake-up pipes of every gate made (a process runs
        many worlds, and `select` takes no descriptor past 1023)."""
        for replica in self.replicas:
            replica.gate.table.stopping.set()
            replica.proxy._real.close()
        for gate in self.gates:
            for fd in (gate.wake.fileno, gate.wake._write):
                with contextlib.suppress(OSError):
                    os.close(fd)


def fired_ticks(job: CatalogJob, after: datetime, until: datetime) -> list[datetime]:
    """The ticks in (after, until], at most 200: walked only as far as `until`."""
    assert job.trigger is not None
    walk = itertools.islice(_ticks(job.trigger, after), 200)
    return list(itertools.takewhile(lambda tick: tick <= until, walk))


def _brief(result: Any) -> str:
    if isinstance(result, Retries):
        result = result.started
    if isinstance(result, ClaimAnswer):
        result = result.every()
    if isinstance(result, list):
        return ", ".join(
            f"{r.key}@{r.scheduled_at:%H:%M:%S}:{getattr(r, 'outcome', '')}"
            if hasattr(r, "scheduled_at")
            else str(r)
            for r in result
        )
    return str(result)


class Reference:
    """Each schedule's ticks from one walk, begun two hours before the world starts (so
    before the DST change), and extended as the world's time goes on."""

    def __init__(self, since: datetime) -> None:
        self.since = since
        self.walks: dict[object, tuple[Any, list[datetime]]] = {}

    def between(self, job: CatalogJob, after: datetime, until: datetime) -> list[datetime]:
        walk, seen = self.walks.setdefault(job.schedule_key, (_ticks(job.trigger, self.since), []))
        while not seen or seen[-1] < until:
            tick = next(walk, None)
            if tick is None:
                break
            seen.append(tick)
        return [t for t in seen if after < t <= until]


@dataclass
class InForce:
    """One replica's schedule of one job, and when it was in force (the world's record)."""

    job: CatalogJob
    since: datetime
    until: datetime | None

    def contains(self, tick: datetime) -> bool:
        if tick < self.since or (self.until is not None and tick > self.until):
            return False
        trigger = self.job.trigger
        return trigger is not None and tick_after(trigger, tick - timedelta(microseconds=1)) == tick
