"""The rules a simulated fleet must keep, each in one place, as README and
docs/guarantees.md state them (not as the code does it).

Rules on a run are checked the moment it starts; rules on the fleet after
every step. Each raises Violation with what it saw.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from sqlalchemy import select

from scheduler.config.schedules import _ticks
from scheduler.fleet.housekeeping import MISSED_LIMIT
from scheduler.fleet.pauses import SETTLE
from scheduler.ledger import tables
from scheduler.observers import alerts
from scheduler.observers.notices import GIVE_UP_AFTER
from tests.simulation.outbox import outbox_clock
from tests.simulation.sweeps import missed_bound

FAIL_THRESHOLD = 3  # every simulated job's fail_alert_after (tests/simulation/jobs.py)

if TYPE_CHECKING:
    from scheduler.registry.catalog import CatalogJob
    from tests.simulation.world import InForce, SimRun, World


class Violation(AssertionError):
    def __init__(self, rule: str, message: str) -> None:
        super().__init__(f"{rule}: {message}")
        self.rule = rule


# -- when a run starts -----------------------------------------------------------------


def no_tick_started_twice(world: World, run: SimRun) -> None:
    """Exactly once (guarantee 1): a tick, or a retry's attempt, starts on one replica once."""
    ident = (run.key, run.scheduled_at, run.attempt)
    if ident in world.started:
        raise Violation(
            "no_tick_started_twice",
            f"job {run.key} tick {run.scheduled_at} attempt {run.attempt} started again on "
            f"{run.replica.name} (first on {world.started[ident]})",
        )
    world.started[ident] = run.replica.name


def no_overlap_unless_told(world: World, run: SimRun) -> None:
    """Never overlapping (guarantee 2): another run of the job still going elsewhere must
    have been told `lock_lost`, or have lost its lock with its session (frozen, killed:
    told as soon as its replica can tell)."""
    for other in world.live_runs():
        if other is run or other.key != run.key:
            continue
        if not (other.told() or other.lock_gone):
            raise Violation(
                "no_overlap_unless_told",
                f"job {run.key}: run {run.run_id} started on {run.replica.name} while run "
                f"{other.run_id} of {other.replica.name} goes on, not told its lock was lost",
            )


def started_untold(world: World, run: SimRun) -> None:
    """A run started after a session was lost is never handed an event already set."""
    if run.told():
        raise Violation(
            "started_untold",
            f"job {run.key}: run {run.run_id} on {run.replica.name} started already told "
            "its lock was lost",
        )


def run_id_grows(world: World, run: SimRun) -> None:
    """Fencing (`run_id`): each run of a job has a run_id greater than any earlier run's."""
    before = world.max_run_id.get(run.key, 0)
    if run.run_id <= before:
        raise Violation(
            "run_id_grows",
            f"job {run.key}: run_id {run.run_id} on {run.replica.name} after {before}",
        )
    world.max_run_id[run.key] = run.run_id


def paused_starts_no_scheduled_tick(world: World, run: SimRun) -> None:
    """Pause (guarantee 9): a job paused for the fleet starts none of its ticks, retries or
    caught-up ticks once `pauses.SETTLE` has passed since the pause committed (when
    `scheduler pause` returns); before, only a run handed to the workers before the
    commit (won ahead, under its lease). A run a person asks for (`scheduler trigger`)
    runs paused or not."""
    paused_at = world.paused.get(run.key)
    if paused_at is None or run.run.asked:
        return
    now = world.monotonic()
    if now >= paused_at + SETTLE or run.handed_at >= paused_at:
        raise Violation(
            "paused_starts_no_scheduled_tick",
            f"job {run.key} tick {run.scheduled_at} attempt {run.attempt} started on "
            f"{run.replica.name} {now - paused_at:.3f} s after its pause committed (handed "
            f"to the workers {run.handed_at - paused_at:.3f} s after it), settle {SETTLE} s",
        )


def caught_up_tick_was_due(world: World, run: SimRun) -> None:
    """The ledger explains every tick (guarantee 9): a tick caught up was due, that is, a
    schedule in force at that instant contained it (no row for a tick no schedule had)."""
    if not run.run.caught_up:
        return
    if not any(held.contains(run.scheduled_at) for held in world.history[run.key]):
        raise Violation(
            "caught_up_tick_was_due",
            f"job {run.key}: caught-up tick {run.scheduled_at:%H:%M:%S} run on "
            f"{run.replica.name}, but no schedule in force then had it",
        )


def within_max_workers(world: World, run: SimRun) -> None:
    """A replica runs at most `max_workers` scheduled runs at once: the claims of one step
    share one budget of free workers (a run a person or catch-up asked for is apart)."""
    if run.run.manual is not None:
        return
    limit = run.replica.gate.table.max_workers
    going = [r for r in world.live_runs() if r.replica is run.replica and r.run.manual is None]
    if len(going) >= limit:
        raise Violation(
            "within_max_workers",
            f"{run.replica.name} started job {run.key} tick {run.scheduled_at} with "
            f"{len(going)} runs going, max_workers {limit}",
        )


def starts_within_lease(world: World, run: SimRun) -> None:
    """Claiming ahead (scheduler/gate/ahead.py): a run won ahead of a free worker starts
    only within its lease (else it is asked again first, and starts with a new one)."""
    lease = run.run.lease_until
    if lease is not None and world.monotonic() > lease:
        raise Violation(
            "starts_within_lease",
            f"job {run.key} tick {run.scheduled_at} attempt {run.attempt} started on "
            f"{run.replica.name} {world.monotonic() - lease:.3f} s after its lease ran out",
        )


ON_START = (
    within_max_workers,
    starts_within_lease,
    caught_up_tick_was_due,
    no_tick_started_twice,
    no_overlap_unless_told,
    started_untold,
    run_id_grows,
    paused_starts_no_scheduled_tick,
)


# -- when a replica's scheduler fires ---------------------------------------------------


def same_instants(world: World, job_key: int, fired: list, expected: list, who: str) -> None:
    """Time zones (guarantee 8): every replica computes the same UTC instants, wherever its
    walk starts (a restart inside the repeated autumn hour, a clock that jumped): what it
    fires between two instants is what one walk from before the DST change lists there."""
    if fired != expected:
        extra = sorted(set(fired) - set(expected))
        missing = sorted(set(expected) - set(fired))
        raise Violation(
            "same_instants",
            f"job {job_key} on {who}: fired {len(fired)} tick(s), one walk lists "
            f"{len(expected)}; extra {[f'{t:%H:%M:%S}' for t in extra[:5]]}, missing "
            f"{[f'{t:%H:%M:%S}' for t in missing[:5]]}",
        )


# -- after every step ------------------------------------------------------------------


def locks_follow_runs(world: World) -> None:
    """Locks follow runs (guarantee 11): a replica holds a job's lock only while it has a
    run of that job here (no claim is in flight between two steps)."""
    held = world.site.held([r.proxy for r in world.replicas])
    for replica in world.replicas:
        mine = held.get(id(replica.proxy), set())
        running = replica.gate.table.running_keys()
        if not mine <= running:
            raise Violation(
                "locks_follow_runs",
                f"{replica.name} holds the locks of {sorted(mine - running)} with runs of "
                f"{sorted(running)}",
            )


def streaks_recount(world: World) -> None:
    """Skips and failures (guarantee 7): each job's skip streak is what its claims add up
    to (a skip grows it, a run ends it), and a streak at its threshold has raised its
    alert; each job's failure streak is what its ticks' ends add up to (a last attempt
    failed or a run found crashed grows it, a success ends it)."""
    for key, streak, alerted, _, failures in _ledger(world)[0]:
        expected = world.streaks.get(key, 0)
        if streak != expected:
            raise Violation(
                "streaks_recount",
                f"job {key}: the ledger's skip streak is {streak}, its claims add up to {expected}",
            )
        counted = world.failures.get(key, 0)
        if failures != counted:
            raise Violation(
                "streaks_recount",
                f"job {key}: the ledger's failure streak is {failures}, its finishes and the "
                f"crashes found add up to {counted}",
            )
        threshold = world.thresholds.get(key)
        if threshold is not None and streak >= threshold and not alerted:
            raise Violation(
                "streaks_recount",
                f"job {key}: {streak} skips in a row, threshold {threshold}, and no alert",
            )


def one_alert_per_streak(world: World) -> None:
    """Skips (guarantee 7): exactly one alert for the fleet per streak of skipped ticks that
    reached the threshold in force (never two for one streak, whoever claimed its ticks)."""
    raised = Counter(key for _, event, key, _ in _outbox(world) if event == alerts.SKIPS_EXCEEDED)
    for key, count in raised.items():
        if count > world.reached.get(key, 0):
            raise Violation(
                "one_alert_per_streak",
                f"job {key}: {count} skip alerts, for {world.reached.get(key, 0)} streak(s) "
                "that reached the threshold",
            )


# Each alert and the recovery that ends it, by kind of streak.
PAIRS = {
    alerts.SKIPS_EXCEEDED: alerts.RECOVERED,
    alerts.FAILURES_EXCEEDED: alerts.FAILURES_RECOVERED,
}
# What each flag of the gate's events announces (TickSkipped.alert, RunFinished's flags).
FLAGGED = {
    "alert": alerts.SKIPS_EXCEEDED,
    "failures_alert": alerts.FAILURES_EXCEEDED,
    "failures_recovered": alerts.FAILURES_RECOVERED,
    "skips_recovered": alerts.RECOVERED,
}


Jobs = list[tuple[int, int, bool, bool, int]]
Outbox = list[tuple[int, str, int, str | None]]


def _ledger(world: World) -> tuple[Jobs, Outbox]:
    """The jobs' streaks (key, skips, skip alerted, failure alerted, failures) and the
    outbox's rows (id, event, job, outcome): read once per step for every rule."""
    if world.ledger_read[0] != world.played:
        j, n = tables.jobs, tables.notices
        streaks = select(
            j.c.job_key, j.c.consecutive_skips, j.c.skip_alerted, j.c.fail_alerted,
            j.c.consecutive_failures,
        )  # fmt: skip
        outbox = select(n.c.id, n.c.event, n.c.job_key, n.c.outcome).order_by(n.c.id)
        with world.site.engine.connect() as conn:
            jobs = [(k, s, bool(a), bool(f), c) for k, s, a, f, c in conn.execute(streaks)]
            rows = [(i, e, k, o) for i, e, k, o in conn.execute(outbox)]
        world.ledger_read = (world.played, (jobs, rows))
    return world.ledger_read[1]


def _outbox(world: World) -> Outbox:
    return _ledger(world)[1]


def alert_then_recovery(world: World) -> None:
    """Skips and failures (guarantee 7; docs/operating.md, alerts): one alert per streak
    that reached its threshold in force, and one recovery when the job keeps up (skips) or
    succeeds (failures) again: each job's alerts and recoveries alternate in the outbox,
    alert first, and an alert is open exactly while the ledger says the job is alerting
    (a failure streak at its threshold is). Every flag the gates said (an event's `alert`,
    `failures_recovered`, ...) is a notice of that event in the outbox, and every notice an
    event carried is one it flagged."""
    outbox = _outbox(world)
    by_id = {row[0]: row for row in outbox}
    rows = _ledger(world)[0]
    states = {key: (skips, failures) for key, _, skips, failures, _ in rows}
    streaks = {key: streak for key, _, _, _, streak in rows}
    for alert, recovery in PAIRS.items():
        open_now: dict[int, bool] = {}
        for ident, event, key, _ in outbox:
            if event not in (alert, recovery):
                continue
            was = open_now.get(key, False)
            if was == (event == alert):
                raise Violation(
                    "alert_then_recovery",
                    f"job {key}: notice {ident} {event} while its alert was "
                    f"{'open' if was else 'not open'}",
                )
            open_now[key] = not was
        flag = 0 if alert == alerts.SKIPS_EXCEEDED else 1
        for key, state in states.items():
            if bool(state[flag]) != open_now.get(key, False):
                raise Violation(
                    "alert_then_recovery",
                    f"job {key}: the ledger says alerting={bool(state[flag])} for {alert}, "
                    f"the outbox has {'an' if open_now.get(key) else 'no'} open alert",
                )
    for key, failures in streaks.items():
        if failures >= FAIL_THRESHOLD and not states[key][1]:
            raise Violation(
                "alert_then_recovery",
                f"job {key}: {failures} failures in a row, threshold {FAIL_THRESHOLD}, no alert",
            )
    for what, key, ids, flags in world.heard[world.heard_checked :]:
        said = sorted(FLAGGED[flag] for flag, up in flags.items() if up)
        found = sorted(by_id[i][1] for i in ids if i in by_id and by_id[i][2] == key)
        if said != found or len(found) != len(ids):
            raise Violation(
                "alert_then_recovery",
                f"job {key}: the gate said {what} with {said}, carrying notices {list(ids)} "
                f"which are {found} in the outbox",
            )
    world.heard_checked = len(world.heard)


def delivered_was_received(world: World) -> None:
    """A notice the outbox marks delivered was taken by the receiver (no notice lost by
    marking it done before its POST was answered)."""
    for ident, event, key, outcome in _outbox(world):
        if outcome == "delivered" and not world.receiver.delivered[ident]:
            raise Violation(
                "every_notice_delivered",
                f"job {key}: notice {ident} {event} marked delivered, never received",
            )


AFTER_STEP = (
    locks_follow_runs,
    streaks_recount,
    one_alert_per_streak,
    alert_then_recovery,
    delivered_was_received,
)


# -- once the fleet has settled and a sweep has run -------------------------------------


def every_tick_explained(world: World) -> None:
    """The ledger explains every tick (guarantee 9; how a tick is due: scheduler.due's
    docstring): once a whole sweep has looked past a tick's grace, every tick that was due
    (some schedule in force then, and every one in force contained it) has its row, but
    those over a sweep's limit; and no
    row is for a tick that no schedule in force had (a run-now has a tick of its own; a
    replica whose clock is ahead claims its schedule's ticks early: docs/operating.md). A
    sweep judges the jobs live replicas have: a tick whose window was swept while no live
    replica (a session holding the presence lock) had the job is nobody's to record."""
    if not world.swept:
        return
    t = tables.ticks
    with world.site.engine.connect() as conn:
        rows = conn.execute(select(t.c.job_key, t.c.scheduled_at, t.c.manual)).all()
    for key, held in world.history.items():
        have = {tick for k, tick, _ in rows if k == key}
        bound = missed_bound(held[0].job, world.swept[-1][0])
        due = due_ticks(held, world.tracked_since, bound) - have - _left_by_limit(world, held)
        missing = sorted(tick for tick in due if _judged(world, held[0].job, tick))
        if missing:
            raise Violation(
                "every_tick_explained",
                f"job {key}: {len(missing)} tick(s) due and without a row after a sweep, "
                f"first {[f'{m:%H:%M:%S}' for m in missing[:5]]}",
            )
    for key, tick, manual in rows:
        if manual or (key, tick) in world.fired:  # fired early by a replica ahead: by design
            continue
        if not any(h.contains(tick) for h in world.history.get(key, [])):
            raise Violation(
                "every_tick_explained",
                f"job {key}: a row for tick {tick:%H:%M:%S}, which no schedule in force had "
                "and no replica fired",
            )


def _left_by_limit(world: World, held: list[InForce]) -> set[datetime]:
    """The ticks sweeps may leave without a row by design: each records at most
    `MISSED_LIMIT` of a job's due ticks, the latest of its window (since the watermark),
    per sweep (docs/guarantees.md).

    The sweep counts the ticks due by the registrations as it reads them, where a replica
    that was reconnecting may look gone and its schedule ended early (`supersede`, until
    it reasserts). So the latest `MISSED_LIMIT` are counted here among every tick some
    schedule in force had, of which both views' due ticks are part: what is older than
    those was left by the limit on either view.
    """
    left: set[datetime] = set()
    after = world.tracked_since
    for sweep_now, _ in world.swept:
        bound = missed_bound(held[0].job, sweep_now)
        if bound > after:
            had = sorted(due_ticks(held, after, bound, _some_had))
            newest = had[-MISSED_LIMIT:]
            if len(had) > MISSED_LIMIT:
                left.update(t for t in due_ticks(held, after, bound) if t < newest[0])
            after = bound
    return left


def _judged(world: World, job: CatalogJob, tick: datetime) -> bool:
    """Whether, at the whole sweep whose window held `tick`, a live replica had the job."""
    for sweep_now, keys in world.swept:
        if missed_bound(job, sweep_now) >= tick:
            return job.key in keys
    return False


def due_ticks(
    held: list[InForce],
    since: datetime,
    until: datetime,
    due: Callable[[list[InForce], datetime], bool] | None = None,
) -> set[datetime]:
    """The ticks in (since, until] that were due (a schedule was in force, and all that
    were contained them; or what `due` says): a job's ticks count from after it was first
    tracked."""
    due = due or _was_due
    candidates: set[datetime] = set()
    for h in held:
        start = max(h.since - timedelta(microseconds=1), since)
        end = until if h.until is None else min(h.until, until)
        if h.job.trigger is None or start >= end:
            continue
        for tick in _ticks(h.job.trigger, start):
            if tick > end:
                break
            candidates.add(tick)
    return {tick for tick in candidates if due(held, tick)}


def _some_had(held: list[InForce], tick: datetime) -> bool:
    return any(h.contains(tick) for h in held)


def _was_due(held: list[InForce], tick: datetime) -> bool:
    in_force = [h for h in held if h.since <= tick and (h.until is None or tick <= h.until)]
    return bool(in_force) and all(h.contains(tick) for h in in_force)


def every_notice_delivered(world: World) -> None:
    """Notices (docs/guarantees.md; docs/operating.md, alerts and notices): every notice
    written to the outbox is delivered at least once by some live replica, whoever raised
    it, however many of its attempts failed, whichever replica died holding its lease; it
    is given up only 15 minutes after it was raised."""
    n = tables.notices
    query = select(n.c.id, n.c.event, n.c.job_key, n.c.outcome, n.c.raised_at).order_by(n.c.id)
    with world.site.engine.connect() as conn:
        rows = conn.execute(query).all()
    now = outbox_clock(lambda: world.outbox_ahead)()
    for ident, event, key, outcome, raised_at in rows:
        if outcome == "given_up" and now - raised_at > GIVE_UP_AFTER:
            continue
        if outcome != "delivered" or not world.receiver.delivered[ident]:
            raise Violation(
                "every_notice_delivered",
                f"job {key}: notice {ident} {event} raised at {raised_at:%H:%M:%S} is "
                f"{outcome or 'not done'}, received {world.receiver.delivered[ident]} time(s) "
                f"in {world.receiver.attempts[ident]} attempt(s)",
            )


AT_REST = (every_tick_explained, every_notice_delivered)
