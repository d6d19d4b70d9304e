"""What each page shows, as plain data for its template; `now` is passed in.

The fleet and the jobs come from `scheduler.fleet.status` (the documents of
`status --json` and `history --json`), so the page, the API and the command
line never disagree; the timeline reads its window through
`scheduler.web.window`. Nothing here writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, desc, select

from scheduler.backends import Backend
from scheduler.fleet.status import fleet_status, history, next_ticks, reading
from scheduler.ledger import tables
from scheduler.ledger.history import TickFilter
from scheduler.ledger.times import iso
from scheduler.observers import alerts
from scheduler.registry.catalog import Catalog, CatalogJob
from scheduler.statuses import FINISHED, Status
from scheduler.web import plot, timeline, window, words

WINDOWS = {
    "15m": timedelta(minutes=15),
    "30m": timedelta(minutes=30),
    "1h": timedelta(hours=1),
    "3h": timedelta(hours=3),
    "6h": timedelta(hours=6),
    "12h": timedelta(hours=12),
    "24h": timedelta(hours=24),
}
DEFAULT_WINDOW = "1h"
SORTS = ("problems", "name", "next", "last")
DONE = {  # what the job page says after an action (a fixed vocabulary, never echoed input)
    "paused": "Paused for the fleet.",
    "already": "It was paused already; the first pause stays.",
    "resumed": "Resumed: its next tick runs.",
    "not-paused": "It was not paused.",
    "run": "Run-now request sent to the fleet.",
}
HISTORY_PAGE = 25
PLOTTED = 100  # runs in the duration and lateness plot
NOTICES = 10
FAILING = (Status.FAILED, Status.CRASHED)


@dataclass(frozen=True)
class Wanted:
    """What the index was asked for (already checked)."""

    window: str = DEFAULT_WINDOW
    query: str = ""
    sort: str = "problems"


def _failing(job: dict[str, Any]) -> bool:
    return bool(job["consecutive_failures"] or (job["last_run"] or {}).get("status") in FAILING)


def problem_rank(job: dict[str, Any]) -> int:
    """0 alerting, 1 failing, 2 paused, 3 skipping, 4 the rest: the problems first."""
    if job["alerting"]:
        return 0
    if _failing(job):
        return 1
    if job["paused"]:
        return 2
    if job["consecutive_skips"] or not job["schedules_agree"]:
        return 3
    return 4


def _sorted(jobs: list[dict[str, Any]], sort: str) -> list[dict[str, Any]]:
    if sort == "name":
        return sorted(jobs, key=lambda j: j["name"].lower())
    if sort == "next":
        return sorted(jobs, key=lambda j: (j["next_tick_utc"] is None, j["next_tick_utc"] or ""))
    if sort == "last":
        return sorted(
            jobs, key=lambda j: (j["last_run"] or {}).get("finished_at") or "", reverse=True
        )
    return sorted(jobs, key=lambda j: (problem_rank(j), j["name"].lower()))


def _row(job: dict[str, Any], entry: CatalogJob | None, now: datetime) -> dict[str, Any]:
    tick = datetime.fromisoformat(job["next_tick"]).astimezone(UTC) if job["next_tick"] else None
    return {
        **job,
        "words": words.in_words(entry) if entry else job["schedule"],
        "written": words.as_written(entry) if entry else "",
        "next_tick_utc": iso(tick),
        "rank": problem_rank(job),
        "failing": _failing(job),
    }


def index(
    backend: Backend,
    catalog: Catalog,
    now: datetime,
    wanted: Wanted,
    standbys: Sequence[str] = (),
) -> dict[str, Any]:
    span = window.window_ending(now, WINDOWS[wanted.window])
    with reading(backend) as conn:  # one ledger session for the page
        status = fleet_status(backend, catalog, now, standbys, conn=conn)
        lanes = window.read_lanes(conn, span, [i["name"] for i in status["instances"]])
    rows = [_row(job, catalog.by_name(job["name"]), now) for job in status["jobs"]]
    shown = [r for r in rows if wanted.query.lower() in r["name"].lower()]
    running: dict[str, list[dict[str, Any]]] = {}
    for job in status["jobs"]:
        if job["running"]:
            running.setdefault(job["running"]["instance"], []).append(job)
    return {
        "status": status,
        "jobs": _sorted(shown, wanted.sort),
        "total_jobs": len(rows),
        "running": running,
        "drift": [j for j in status["jobs"] if not j["schedules_agree"]],
        "problems": sum(1 for r in rows if r["rank"] <= 2),
        "timeline": timeline.render(lanes, span, now),
        "lanes": lanes,
        "wanted": wanted,
        "windows": list(WINDOWS),
        "sorts": SORTS,
    }


def job_page(
    backend: Backend,
    catalog: Catalog,
    job: CatalogJob,
    now: datetime,
    older_than: datetime | None,
) -> dict[str, Any]:
    """One job; its history from the newest tick, or from `older_than` (inclusive) back."""
    with reading(backend) as conn:  # one ledger session for the page
        status = fleet_status(backend, catalog, now, conn=conn)
        page = TickFilter(key=job.key, until=older_than, limit=HISTORY_PAGE + 1)
        rows = history(backend, page, conn)
        finished = history(backend, TickFilter(key=job.key, statuses=FINISHED, limit=PLOTTED), conn)
        upcoming = next_ticks(backend, job, now, 10, conn)
        notices = recent_notices(conn, job.key)
    (entry,) = [j for j in status["jobs"] if j["name"] == job.name]
    more = len(rows) > HISTORY_PAGE
    rows = rows[:HISTORY_PAGE]
    return {
        "job": _row(entry, job, now),
        "next_ticks": [job.local(t) for t in upcoming],
        "history": rows,
        "older": rows[-1]["scheduled_at"] if more and rows else None,
        "paged": older_than is not None,
        "plot": plot.render(plot.points(finished)),
        "plotted": len(finished),
        "notices": notices,
    }


def recent_notices(conn: Connection, key: int) -> list[dict[str, Any]]:
    """The job's latest notices (alerts, recoveries, pauses), each as its sentence."""
    n = tables.notices
    query = select(n).where(n.c.job_key == key).order_by(desc(n.c.id)).limit(NOTICES)
    found = [dict(row._mapping) for row in conn.execute(query)]
    return [
        {
            "event": row["event"],
            "at": iso(row["raised_at"]),
            "by": row["raised_by"],
            "text": alerts.Notice.from_row(row).text(),
            "delivered": row["outcome"] or ("pending" if row["done_at"] is None else ""),
        }
        for row in found
    ]
