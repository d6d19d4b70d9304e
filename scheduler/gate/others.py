"""Other replicas' shares of the ticks this replica fires: held whole, looked at once.

Every replica fires every schedule, so each one sees every tick of the fleet. Once
the lock session knows the fleet's shape (backends/shares.py), all but this
replica's own share are other replicas' to claim first. Queued one by one, to be
offered again once anyone may take them, they cost each replica the whole fleet's
ticks: 25-35 µs each, so that 100 replicas of 1,000 jobs needed more CPU than two
cores have, for ticks their owners had taken long before.

Here, on a schedule of as many jobs as the server shares a burst out from
(`Shape.share_from`), they wait as one record per fired tick. Once `HELP_AFTER` has
passed (the server's takeover, and a margin), one probe of the ledger for every
record due names the ticks no replica has recorded, and only those join the queue,
as other replicas' ticks to help with (`TickQueue.help`). Probing has a budget
(`PROBES_PER_TICK`) and waits longer in a replica that runs behind (`patience`), so
that a fleet short of CPU spends it running ticks, not looking at them. A shape gone
stale costs no tick: a tick its owner did not take (gone, frozen, or seeing another
fleet) is found by that probe on every replica that holds it, as other replicas'
ticks were found before by the claims that offered them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

from scheduler.backends.shares import Shape, share_of
from scheduler.registry.catalog import CatalogJob

# Seconds from a tick's firing here until its record is probed: the server's takeover
# (postgres.TAKEOVER_S), after which anyone may take it, and as much again.
HELP_AFTER = 0.2
# A replica behind on its own share waits as much longer before it probes: its owners are
# likely as late (the same machine, the same database), and a tick they take late is not
# a tick to help with. Probing and helping at HELP_AFTER whatever the lag made a fleet
# short of CPU spend it on ticks their owners were about to take, and never catch up
# (40 replicas of 1,000 jobs on 2 cores: 66 runs a second of 1,000). At most this much:
# a frozen owner's ticks are still found well inside a grace of a few seconds.
LAG_MAX = 5.0
SPLITS_KEPT = 64  # schedules x shapes whose split is remembered (a reload starts afresh)
# Records held at most, oldest dropped first: while the lock session is down nothing is
# probed, and a tick dropped here is still its owner's (which keeps its own queued), or
# the sweep's to record missed. Ticks probed in one round trip at most.
HELD_MAX = 1000
PROBE_MAX = 10_000
# Ticks probed, at most, per tick held as it fired: each is probed once, and those found
# untaken and left to other helpers once more on average. A backlog of held ticks (the
# fleet behind, or the session back after a cut) drains at that rate, never at the rate a
# step can probe: probing it all at once, every step, took a fleet short of CPU from
# behind to never catching up, its replicas and server busy looking at ticks, not running
# them. A full budget at most (PROBE_MAX), and at start.
PROBES_PER_TICK = 2
# Of the ticks a probe finds untaken, each replica helps with this many times its part
# (the untaken over the other live replicas) at once, the first in its own order; the
# rest are held again, to be probed once more. Owners left ticks untaken because they
# were late, or gone: every replica helping with every one of them multiplied the
# work of a fleet already short of CPU by its size (100 replicas went from 2% of a core
# each to ten seconds late, helping).
HELPERS = 2


@dataclass(frozen=True)
class _Split:
    jobs: Sequence[CatalogJob]
    own: Sequence[CatalogJob]
    theirs: Sequence[CatalogJob]


@dataclass(frozen=True)
class Unowned:
    """One fired tick of several jobs, other replicas' to claim first."""

    jobs: Sequence[CatalogJob]
    tick: datetime
    since: float  # monotonic: when it was fired here
    grace: float = 0.0  # seconds: the shortest misfire grace of its jobs
    held: float | None = None  # when held again after a probe (None: as it fired)

    def due_at(self, lag: float) -> float:
        """When to probe it: after `patience(lag)`, but never later than half its grace
        (beyond its grace a tick helped with is only recorded missed)."""
        held = self.since if self.held is None else self.held
        return held + min(patience(lag), max(HELP_AFTER, self.grace / 2))

    def past_grace(self, now: float) -> bool:
        """Fired longer ago than its grace: a claim would only record it missed, as the
        sweep does; probing it costs a fleet behind what it needs for ticks still due."""
        return self.since + self.grace < now


class Others:
    """The records held, oldest first (not thread-safe: the tick queue's mutex guards it)."""

    def __init__(self) -> None:
        self._held: list[Unowned] = []
        self._budget = float(PROBE_MAX)  # ticks that may be probed now (PROBES_PER_TICK)
        # (schedule's jobs, live, rank) -> the jobs again (held: its id is never reused
        # while cached), its own, and other replicas'
        self._splits: dict[tuple[int, int, int], _Split] = {}
        # id(jobs) -> the jobs again (held, as above) and their shortest grace
        self._graces: dict[int, tuple[Sequence[CatalogJob], float]] = {}

    def split(
        self, jobs: Sequence[CatalogJob], shape: Shape | None
    ) -> tuple[Sequence[CatalogJob], Sequence[CatalogJob]]:
        """(this replica's own, other replicas'): all are its own while it knows of no
        other live replica, and on a schedule of fewer jobs than the server shares out
        (`Shape.share_from`: the first replica to claim such a tick takes it). Remembered
        per schedule (the same list each time it fires)."""
        if shape is None or shape.live <= 1 or len(jobs) < shape.share_from:
            return jobs, ()
        cache = (id(jobs), shape.live, shape.rank)
        found = self._splits.get(cache)
        if found is None or found.jobs is not jobs:
            if len(self._splits) >= SPLITS_KEPT:
                self._splits.clear()
            own = [job for job in jobs if share_of(job.key, shape.live) == shape.rank]
            theirs = [job for job in jobs if share_of(job.key, shape.live) != shape.rank]
            found = self._splits[cache] = _Split(jobs, own, theirs)
        return found.own, found.theirs

    def hold(self, jobs: Sequence[CatalogJob], tick: datetime, now: float) -> None:
        """Other replicas' ticks as they fire: held, and as many more may be probed."""
        self._budget = min(PROBE_MAX, self._budget + PROBES_PER_TICK * len(jobs))
        self._keep(jobs, tick, now)

    def _keep(
        self,
        jobs: Sequence[CatalogJob],
        tick: datetime,
        since: float,
        held: float | None = None,
        grace: float | None = None,
    ) -> None:
        grace = self._grace(jobs) if grace is None else grace
        self._held.append(Unowned(jobs, tick, since, grace, held))
        del self._held[:-HELD_MAX]

    def _grace(self, jobs: Sequence[CatalogJob]) -> float:
        """The shortest grace of a split's list, remembered (it fires every tick)."""
        found = self._graces.get(id(jobs))
        if found is None or found[0] is not jobs:
            if len(self._graces) >= SPLITS_KEPT:
                self._graces.clear()
            found = self._graces[id(jobs)] = (jobs, shortest_grace(jobs))
        return found[1]

    def due(self, now: float, lag: float = 0.0) -> list[Unowned]:
        """The records to probe now, taken out: oldest first, up to `PROBE_MAX` ticks and
        the budget left (at least one record while any is left; the rest are due later).
        `lag`: how far this replica is behind on its own share (see `patience`)."""
        while self._held and self._held[0].past_grace(now):
            del self._held[0]
        n = ticks = 0
        while self._budget > 0 and n < len(self._held) and self._held[n].due_at(lag) <= now:
            size = len(self._held[n].jobs)
            if n and ticks + size > min(PROBE_MAX, self._budget):
                break
            ticks += size
            n += 1
        self._budget -= ticks
        taken, self._held[:n] = self._held[:n], []
        return taken

    def hold_again(self, found: Sequence[tuple[CatalogJob, datetime, float]], now: float) -> None:
        """Untaken ticks this replica did not help with now: probed again later."""
        by_tick: dict[datetime, tuple[list[CatalogJob], float]] = {}
        for job, tick, since in found:
            jobs, first = by_tick.setdefault(tick, ([], since))
            jobs.append(job)
            by_tick[tick] = jobs, min(first, since)
        for tick, (jobs, since) in sorted(by_tick.items()):  # lists of their own: not kept
            self._keep(jobs, tick, since, held=now, grace=shortest_grace(jobs))

    def next_due(self, lag: float = 0.0) -> float | None:
        """None with no budget left: the next tick held brings some, and wakes the
        dispatcher as it comes."""
        if not self._held or self._budget <= 0:
            return None
        return self._held[0].due_at(lag)

    def refresh(self, current: Callable[[int], CatalogJob | None]) -> None:
        """After a reload: the jobs still scheduled here, with their new settings."""
        held = [(_scheduled(r.jobs, current), r) for r in self._held]
        self._held = [
            Unowned(jobs, r.tick, r.since, shortest_grace(jobs), r.held) for jobs, r in held if jobs
        ]
        self._splits.clear()
        self._graces.clear()

    def clear(self) -> None:
        self._held.clear()
        self._splits.clear()
        self._graces.clear()

    def __len__(self) -> int:
        return len(self._held)


def _scheduled(
    jobs: Sequence[CatalogJob], current: Callable[[int], CatalogJob | None]
) -> list[CatalogJob]:
    found = (current(job.key) for job in jobs)
    return [job for job in found if job is not None and job.scheduled]


def shortest_grace(jobs: Sequence[CatalogJob]) -> float:
    """Seconds: the shortest misfire grace of `jobs` (0 for none)."""
    return min((job.misfire_grace.total_seconds() for job in jobs), default=0.0)


def patience(lag: float) -> float:
    """Seconds from a tick's firing here until its record is probed, for a replica `lag`
    seconds behind on its own share (see LAG_MAX)."""
    return HELP_AFTER + min(max(lag, 0.0), LAG_MAX)


def help_part(untaken: int, shape: Shape | None) -> int:
    """How many of `untaken` ticks this replica helps with at once (see HELPERS)."""
    if shape is None or shape.live <= 2:
        return untaken
    return min(untaken, -(-untaken * HELPERS // (shape.live - 1)))
