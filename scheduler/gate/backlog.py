"""The backlog: queued ticks a claim left to later, offered again a few at a time.

A burst is claimed whole once, so that the backend can share it out among the
live replicas; what comes back `deferred` (this replica's, beyond its free
workers) or `yielded` (another live replica's share) waits here. A replica
wins at most as many runs per claim as it has free workers, so offering the
whole rest of a burst at every claim made each one cost the whole burst, on
both sides of the connection (a burst of n ticks took n / workers claims of up
to n ticks each). A claim takes from here at most `WINDOW` ticks per free
worker: this replica's own first, oldest first; once none is left, other
replicas' (after their time to themselves), in an order of this replica's own,
so that replicas helping with the same share seldom reach for the same ticks,
and never start where its owner is working.
"""

from __future__ import annotations

import heapq
import itertools
import math
import zlib
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import NamedTuple, Protocol

from scheduler.registry.catalog import CatalogJob

# Own ticks offered per free worker: a few more than the workers, as a few may have been
# taken elsewhere meanwhile (each tick sent costs a probe on the server and its share of
# building the claim and reading the answer here, won or not).
WINDOW = 1.25
# Other replicas' ticks offered at once: most are found taken by their owners, at the cost
# of an index probe each on the server; taken a window of a few at a time, a backlog of
# thousands would cost as many claims to clear.
HELP = 1000


class Entry(Protocol):
    """What the backlog needs of a queued entry (ticks.Pending)."""

    job: CatalogJob
    ticks: list[datetime]
    not_before: float
    others: bool  # once yielded: another replica's share, whatever later answers say


def helper_order(instance: str) -> Callable[[int], int]:
    """The order in which this replica takes other replicas' ticks: its own, from its
    name, so that two replicas helping with one share take different ticks."""
    salt = f"{instance}\0".encode()
    return lambda key: zlib.crc32(salt + key.to_bytes(4, "big", signed=True))


class _Place(NamedTuple):
    """A place in the heap. A tuple, so that the heap compares in C: a burst's thousand
    places cost a dozen comparisons each (`seq` is unique: `entry` is never compared)."""

    others: bool  # another replica's share: after every tick of this replica's own
    tick: datetime
    order: int
    seq: int
    entry: Entry


class Backlog:
    def __init__(self, order: Callable[[int], int]) -> None:
        self.order = order
        self._heap: list[_Place] = []
        self._entries: dict[int, _Place] = {}  # job key -> its place (the heap may hold stale ones)
        self._seq = itertools.count()

    def put(self, entry: Entry) -> None:
        """Left by a claim: its place comes from its newest tick and whose share it is."""
        key = entry.job.key
        order = self.order(key) if entry.others else key
        place = _Place(entry.others, entry.ticks[-1], order, next(self._seq), entry)
        self._entries[key] = place
        heapq.heappush(self._heap, place)

    def has(self, key: int) -> bool:
        return key in self._entries

    def remove(self, key: int) -> Entry | None:
        place = self._entries.pop(key, None)
        return None if place is None else place.entry

    def take(self, free: int, now: float) -> list[Entry]:
        """The entries to offer now, for `free` workers: up to `WINDOW` per worker of this
        replica's own, oldest first; once none is left, up to `HELP` of others'. Others'
        ticks wait as long as the first of them in this replica's order does (they were
        left together, so a fraction of a second apart at most)."""
        taken: list[Entry] = []
        own = False
        n = math.ceil(WINDOW * free)
        while free > 0 and len(taken) < n and (place := self._top()) is not None:
            if place.entry.not_before > now or (own and place.others):
                break
            if place.others:
                n = HELP
            heapq.heappop(self._heap)
            del self._entries[place.entry.job.key]
            taken.append(place.entry)
            own = not place.others
        return taken

    def next_due(self) -> float | None:
        place = self._top()
        return None if place is None else place.entry.not_before

    def _top(self) -> _Place | None:
        """The first live place (stale ones, of entries removed or put again, dropped)."""
        while self._heap:
            place = self._heap[0]
            if self._entries.get(place.entry.job.key) is place:
                return place
            heapq.heappop(self._heap)
        return None

    def clear(self) -> None:
        self._heap.clear()
        self._entries.clear()

    def __iter__(self) -> Iterator[Entry]:
        return iter([place.entry for place in self._entries.values()])

    def __len__(self) -> int:
        return len(self._entries)
