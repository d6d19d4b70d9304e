"""What the timeline reads from the ledger: the ticks of one window, bounded.

However many rows the window holds, the page reads a bounded amount: one
GROUP BY gives each lane's ticks per time bucket and status (at most lanes x
BUCKETS x statuses rows), and only the lanes sparse enough to draw run by run
have their rows read, at most `DETAIL_LIMIT` in all. Both queries are served by
the ledger's `scheduled_at` index, on both backends.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Float,
    Integer,
    Select,
    cast,
    func,
    or_,
    select,
)

from scheduler.ledger import tables
from scheduler.statuses import Status

BUCKETS = 120  # time buckets across the window: a dense lane is drawn as these
LANE_DETAIL = 300  # a lane with more ticks than this in the window is drawn aggregated
DETAIL_LIMIT = 3000  # rows read run by run, at most, whatever the lanes
NOT_RUN = (Status.MISSED, Status.PAUSED)  # ticks no replica ran: drawn on their own lane


@dataclass(frozen=True)
class Tick:
    """One ledger row as the timeline draws it."""

    job: str
    key: int
    instance: str | None
    status: str
    scheduled_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    duration_s: float | None
    error: str | None
    run_id: int | None
    manual: bool


@dataclass
class Lane:
    """One row of the timeline: a replica's runs, or the ticks nobody ran."""

    name: str
    label: str
    kind: str  # replica (live), gone (a replica no longer live), not-run
    ticks: list[Tick] = field(default_factory=list)
    # bucket index -> status -> count; set when the lane is too dense to draw run by run
    buckets: dict[int, dict[str, int]] | None = None
    total: int = 0


@dataclass(frozen=True)
class Window:
    start: datetime
    end: datetime

    @property
    def seconds(self) -> float:
        return (self.end - self.start).total_seconds()

    @property
    def bucket_s(self) -> float:
        return self.seconds / BUCKETS


NOT_RUN_LANE = "\x00not-run"  # not an instance name: those are [A-Za-z0-9._-]


def lane_of(instance: str | None, status: str) -> str:
    return NOT_RUN_LANE if status in NOT_RUN or instance is None else instance


def read_lanes(conn: Connection, window: Window, live: list[str]) -> list[Lane]:
    """The live replicas' lanes (in their order), then lanes of replicas gone since,
    then the ticks nobody ran; each lane run by run, or in buckets when dense."""
    counts = _bucket_counts(conn, window)
    lanes = {name: Lane(name, name, "replica") for name in live}
    for (name, index, status), count in counts.items():
        if name == NOT_RUN_LANE and name not in lanes:
            lanes[name] = Lane(name, "not run (missed, paused)", "not-run")
        elif name not in lanes:
            lanes[name] = Lane(name, f"{name} (gone)", "gone")
        lane = lanes[name]
        lane.total += count
        if lane.buckets is None:
            lane.buckets = {}
        lane.buckets.setdefault(index, {}).setdefault(status, 0)
        lane.buckets[index][status] += count
    sparse = _sparse(list(lanes.values()))
    for tick in _detail(conn, window, {lane.name for lane in sparse}):
        lanes[lane_of(tick.instance, tick.status)].ticks.append(tick)
    for lane in sparse:
        lane.buckets = None
    for run in _running(conn, window):  # runs that began before the window and still go
        home = lanes.get(lane_of(run.instance, run.status))
        if home is not None and home.buckets is None:
            home.ticks.append(run)
    order = {"replica": 0, "gone": 1, "not-run": 2}
    return sorted(lanes.values(), key=lambda lane: order[lane.kind])


def _sparse(lanes: list[Lane]) -> list[Lane]:
    """The lanes drawn run by run: each within LANE_DETAIL, all within DETAIL_LIMIT
    (the quietest first; the others stay in buckets)."""
    chosen, budget = [], DETAIL_LIMIT
    for lane in sorted(lanes, key=lambda lane: lane.total):
        if 0 < lane.total <= min(LANE_DETAIL, budget):
            chosen.append(lane)
            budget -= lane.total
    return chosen


def _epoch(conn: Connection) -> object:
    column = tables.ticks.c.scheduled_at
    if conn.dialect.name == "postgresql":
        return func.date_part("epoch", column)  # double precision (EXTRACT's numeric is slower)
    return (func.julianday(column) - 2440587.5) * 86400.0


def _in_window(window: Window) -> list[ColumnElement[bool]]:
    column = tables.ticks.c.scheduled_at
    return [column >= window.start, column <= window.end]


def _bucket_counts(conn: Connection, window: Window) -> dict[tuple[str, int, str], int]:
    t = tables.ticks
    offset = (cast(_epoch(conn), Float) - window.start.timestamp()) / window.bucket_s
    bucket = func.floor(offset) if conn.dialect.name == "postgresql" else cast(offset, Integer)
    query = (
        select(t.c.instance, bucket.label("bucket"), t.c.status, func.count().label("n"))
        .where(*_in_window(window))
        .group_by(t.c.instance, bucket, t.c.status)
    )
    out: dict[tuple[str, int, str], int] = defaultdict(int)
    last = BUCKETS - 1
    for instance, at, status, n in conn.execute(query).all():  # thousands of rows: all at once
        index = int(at)
        index = 0 if index < 0 else last if index > last else index
        out[(lane_of(instance, status), index, status)] += n
    return out


# Tick's fields and the ledger columns they come from.
_COLUMNS = {
    "job": "job_name",
    "key": "job_key",
    "instance": "instance",
    "status": "status",
    "scheduled_at": "scheduled_at",
    "started_at": "started_at",
    "finished_at": "finished_at",
    "duration_s": "duration_s",
    "error": "error",
    "run_id": "run_id",
    "manual": "manual",
}


def _ticks(conn: Connection, query: Select[Any]) -> list[Tick]:
    return [
        Tick(**{f: row._mapping[c] for f, c in _COLUMNS.items()}) for row in conn.execute(query)
    ]


def _selected() -> Select[Any]:
    return select(*(tables.ticks.c[name] for name in _COLUMNS.values()))


def _detail(conn: Connection, window: Window, lanes: set[str]) -> list[Tick]:
    if not lanes:
        return []
    t = tables.ticks
    names = [name for name in lanes if name != NOT_RUN_LANE]
    ran = t.c.instance.in_(names) & t.c.status.not_in(NOT_RUN)
    wanted = (
        or_(ran, t.c.status.in_(NOT_RUN), t.c.instance.is_(None)) if NOT_RUN_LANE in lanes else ran
    )
    query = (
        _selected()
        .where(*_in_window(window), wanted)
        .order_by(t.c.scheduled_at.desc())
        .limit(DETAIL_LIMIT)
    )
    return _ticks(conn, query)


def _running(conn: Connection, window: Window) -> list[Tick]:
    """Runs still going that were scheduled before the window (the partial index)."""
    t = tables.ticks
    query = _selected().where(t.c.status == Status.RUNNING, t.c.scheduled_at < window.start)
    return _ticks(conn, query.limit(100))


def window_ending(now: datetime, length: timedelta) -> Window:
    return Window(now - length, now)
