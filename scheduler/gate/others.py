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
as other replicas' ticks to help with (`TickQueue.help`). A shape gone stale costs
no tick: a tick its owner did not take (gone, frozen, or seeing another fleet) is
found by that probe on every replica that holds it, as other replicas' ticks were
found before by the claims that offered them.
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
SPLITS_KEPT = 64  # schedules x shapes whose split is remembered (a reload starts afresh)
# Records held at most, oldest dropped first: while the lock session is down nothing is
# probed, and a tick dropped here is still its owner's (which keeps its own queued), or
# the sweep's to record missed. Ticks probed in one round trip at most.
HELD_MAX = 1000
PROBE_MAX = 10_000
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


class Others:
    """The records held, oldest first (not thread-safe: the tick queue's mutex guards it)."""

    def __init__(self) -> None:
        self._held: list[Unowned] = []
        # (schedule's jobs, live, rank) -> the jobs again (held: its id is never reused
        # while cached), its own, and other replicas'
        self._splits: dict[tuple[int, int, int], _Split] = {}

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
        self._held.append(Unowned(jobs, tick, now))
        del self._held[:-HELD_MAX]

    def due(self, now: float) -> list[Unowned]:
        """The records to probe now, taken out: oldest first, up to `PROBE_MAX` ticks
        (at least one record; the rest are due at the next step)."""
        n = ticks = 0
        while n < len(self._held) and self._held[n].since + HELP_AFTER <= now:
            ticks += len(self._held[n].jobs)
            if n and ticks > PROBE_MAX:
                break
            n += 1
        taken, self._held[:n] = self._held[:n], []
        return taken

    def hold_again(self, found: Sequence[tuple[CatalogJob, datetime, float]], now: float) -> None:
        """Untaken ticks this replica did not help with now: probed again later."""
        by_tick: dict[datetime, list[CatalogJob]] = {}
        for job, tick, _ in found:
            by_tick.setdefault(tick, []).append(job)
        for tick, jobs in sorted(by_tick.items()):
            self.hold(jobs, tick, now)

    def next_due(self) -> float | None:
        return self._held[0].since + HELP_AFTER if self._held else None

    def refresh(self, current: Callable[[int], CatalogJob | None]) -> None:
        """After a reload: the jobs still scheduled here, with their new settings."""
        held = [Unowned(_scheduled(r.jobs, current), r.tick, r.since) for r in self._held]
        self._held = [r for r in held if r.jobs]
        self._splits.clear()

    def clear(self) -> None:
        self._held.clear()
        self._splits.clear()

    def __len__(self) -> int:
        return len(self._held)


def _scheduled(
    jobs: Sequence[CatalogJob], current: Callable[[int], CatalogJob | None]
) -> list[CatalogJob]:
    found = (current(job.key) for job in jobs)
    return [job for job in found if job is not None and job.scheduled]


def help_part(untaken: int, shape: Shape | None) -> int:
    """How many of `untaken` ticks this replica helps with at once (see HELPERS)."""
    if shape is None or shape.live <= 2:
        return untaken
    return min(untaken, -(-untaken * HELPERS // (shape.live - 1)))
