"""`scheduler status` and `scheduler history`: the fleet now, and what happened.

Read-only views over the ledger and the backend's live locks; the JSON shapes
are documented in docs/cli.md. The command line and the page's API (`/api/status`,
`/api/history`) answer from here, and read `history`'s filters with one function
(`history_filter`), so both accept and refuse the same values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import UTC, datetime, tzinfo
from typing import Any
from urllib.parse import quote

from sqlalchemy import Connection, Engine

from scheduler.backends import Backend
from scheduler.backends.embedded import READ_ONLY
from scheduler.config import parsing
from scheduler.fleet import agreement, due, pauses
from scheduler.ledger import history as ledger_history
from scheduler.ledger.history import TickFilter, TickRow, latest_of
from scheduler.ledger.job_states import job_states
from scheduler.ledger.registrations import Registration, by_job, registrations_of, seen_at
from scheduler.ledger.times import iso
from scheduler.registry.catalog import Catalog, CatalogJob, schedule_text
from scheduler.statuses import FINISHED, Status

HISTORY_LINES = 50  # ticks `history` lists when asked for neither a limit nor a time span


def _reading(backend: Backend) -> Engine:
    """Reads only: on SQLite a deferred BEGIN, so no writer holds them up."""
    return backend.ledger_engine.execution_options(**{READ_ONLY: True})


def reading(backend: Backend) -> AbstractContextManager[Connection]:
    """One read transaction, on a ledger session opened for it and closed after: a page
    passes its connection to every read below, so a request costs one session."""
    return _reading(backend).begin()


@contextlib.contextmanager
def _within(backend: Backend, conn: Connection | None) -> Iterator[Connection]:
    """The caller's read transaction, or one of its own."""
    if conn is not None:
        yield conn
        return
    with reading(backend) as own:
        yield own


def history(
    backend: Backend, wanted: TickFilter, conn: Connection | None = None
) -> list[dict[str, Any]]:
    with _within(backend, conn) as reads:
        return [row.as_json() for row in ledger_history.history(reads, wanted)]


@dataclass(frozen=True)
class HistoryAsked:
    """`history`'s filters as they were given: the command's flags, the API's query."""

    since: str | None = None  # an age (12h) or an instant
    until: str | None = None
    status: str | None = None  # S[,S...]
    instance: str | None = None
    limit: str | None = None


def history_filter(
    asked: HistoryAsked,
    now: datetime,
    *,
    most: int,
    spanned: int | None,
    zone: tzinfo = UTC,
    flag: str = "",
) -> TickFilter:
    """The ticks asked for; a malformed value is `parsing.Refused`, naming `flag` + field.

    Without a limit: `HISTORY_LINES` ticks, or `spanned` (None: all) when `since` or
    `until` is given; a limit is at most `most`. Instants without an offset are in `zone`.
    """
    since = until = None
    if asked.since:
        since = parsing.since(asked.since, flag + "since", now, zone)
    if asked.until:
        until = parsing.instant(asked.until, flag + "until", zone)
    statuses: tuple[str, ...] = ()
    if asked.status:
        statuses = parsing.some_of(asked.status, flag + "status", [str(v) for v in Status])
    instance = None
    if asked.instance is not None:
        instance = parsing.instance_name(asked.instance, flag + "instance")
    if asked.limit is not None:
        limit: int | None = parsing.whole(asked.limit, flag + "limit", 1, most)
    else:
        limit = HISTORY_LINES if since is None and until is None else spanned
    return TickFilter(None, since, until, statuses, instance, limit)


def schedule_checks(backend: Backend, catalog: Catalog) -> list[tuple[bool, str]]:
    """For `scheduler check`: (agrees, what) per job the live replicas run otherwise than
    this config.yaml says, or than one another; one (True, ...) line when all agree."""
    with _reading(backend).connect() as conn:
        live = {i["name"] for i in backend.live_instances(conn)}
        variants = agreement.live_schedules(registrations_of(conn), live)
    out = []
    for job in catalog:
        found = variants.get(job.key, [])
        mine = schedule_text(job)
        if not found or (len(found) == 1 and found[0].schedule == mine):
            continue
        running = "; ".join(
            f"{agreement.words(v.schedule)} on {', '.join(v.instances)}" for v in found
        )
        here = agreement.words(mine)
        out.append((False, f"{job.name}: live replicas run {running}; this config.yaml: {here}"))
    if not out:
        out.append((True, f"the {len(live)} live replica(s) run the schedules of this config.yaml"))
    return out


def next_ticks(
    backend: Backend, job: CatalogJob, now: datetime, n: int, conn: Connection | None = None
) -> list[datetime]:
    """The job's next `n` ticks as the live replicas fire them (scheduler.fleet.due)."""
    with _within(backend, conn) as reads:
        live = {i["name"] for i in backend.live_instances(reads)}
        registered = registrations_of(reads, [job.key])
    return due.upcoming(job, registered, live, now, n)


@dataclass(frozen=True)
class _Snapshot:
    """What `status` reads of the fleet, in one read transaction."""

    live: set[str]
    holders: dict[int, str]
    running: dict[int, TickRow]
    latest: dict[int, TickRow]
    states: dict[int, dict[str, Any]]
    paused: dict[int, pauses.Pause]
    by_job: dict[int, list[Registration]]
    variants: dict[int, list[agreement.Variant]]
    seen: dict[str, datetime]


def fleet_status(
    backend: Backend,
    catalog: Catalog,
    now: datetime,
    standbys: Sequence[str] = (),
    root: str = "",
    conn: Connection | None = None,
) -> dict[str, Any]:
    """The fleet now; `standbys`: the replicas on standby behind the host lock, on the
    host that asks (they hold no session, so the ledger cannot know them); `root`: the
    prefix the page is served under, for each job's `job_url`."""
    # One read transaction; the embedded backend reads its file locks without taking
    # any (a probe could make a concurrent claim see its lock as taken).
    with _within(backend, conn) as reads:
        instances = backend.live_instances(reads)
        snapshot = _read(backend, reads, catalog, {i["name"] for i in instances})
    notes = getattr(backend, "notes", None)
    return {
        "backend": backend.name,
        "instances": [
            {
                "name": i["name"],
                "since": iso(i.get("since")),
                "address": i.get("address"),
                **({"note": i["note"]} if i.get("note") else {}),
            }
            for i in instances
        ],
        "standbys": list(standbys),
        "jobs": [_job_status(job, snapshot, now, root) for job in catalog],
        # What the backend finds wrong under the fleet (embedded: a lock folder that is gone).
        "notes": notes() if callable(notes) else [],
    }


def _read(backend: Backend, conn: Connection, catalog: Catalog, live: set[str]) -> _Snapshot:
    running = {row.key: row for row in ledger_history.running(conn)}
    registered = registrations_of(conn)
    gone = sorted({r.instance for r in running.values() if r.instance} - live)
    return _Snapshot(
        live=live,
        holders=backend.lock_holders(conn),
        running=running,
        latest=latest_of(conn, [job.key for job in catalog], FINISHED),
        states=job_states(conn),
        paused=pauses.paused_jobs(conn),
        by_job=by_job(registered),
        variants=agreement.live_schedules(registered, live),
        seen=seen_at(conn, gone),
    )


def _job_status(job: CatalogJob, snap: _Snapshot, now: datetime, root: str) -> dict[str, Any]:
    state = snap.states.get(job.key, {})
    run = snap.running.get(job.key)
    last = snap.latest.get(job.key)
    upcoming = due.upcoming(job, snap.by_job.get(job.key, []), snap.live, now, 1)
    variants = snap.variants.get(job.key, [])
    return {
        **job.as_json(now),
        "job_url": job_url(job.name, root),
        "next_tick": job.local(upcoming[0]) if upcoming else None,
        "running": None if run is None else _running_status(job, run, snap, now),
        "last_run": None if last is None else _last_status(last),
        "consecutive_skips": int(state.get("consecutive_skips") or 0),
        "skip_alert_after": job.skip_threshold,
        "consecutive_failures": int(state.get("consecutive_failures") or 0),
        "fail_alert_after": job.fail_threshold,
        "alerting": bool(state.get("skip_alerted") or state.get("fail_alerted")),
        "paused": snap.paused[job.key].as_json() if job.key in snap.paused else None,
        # What the live replicas run, and who runs it: one entry when they agree.
        "schedules": [v.as_json() for v in variants],
        "schedules_agree": len(variants) <= 1,
    }


def job_url(name: str, root: str = "") -> str:
    """The job's page: a path below where the page is served (under `root`, its prefix)."""
    return f"{root}/jobs/{quote(name, safe='')}"


def _running_status(
    job: CatalogJob, run: TickRow, snap: _Snapshot, now: datetime
) -> dict[str, Any]:
    return {
        "instance": run.instance,
        "since": iso(run.started_at),
        "scheduled_at": iso(run.scheduled_at),
        "run_id": run.run_id,
        "lock_held_by": snap.holders.get(job.key),
        # Its replica is gone and nobody holds the lock: the sweep will
        # record it crashed; until then it is shown so, not as running.
        "replica_gone": run.instance not in snap.live and job.key not in snap.holders,
        "last_seen": iso(snap.seen.get(run.instance or "")),
        "past_timeout_since": iso(past_timeout(job, run, now)),
    }


def _last_status(last: TickRow) -> dict[str, Any]:
    return {
        "status": last.status,
        "scheduled_at": iso(last.scheduled_at),
        "instance": last.instance,
        "finished_at": iso(last.finished_at),
        "duration_s": last.duration_s,
        "error": last.error,
        "run_id": last.run_id,
    }


def past_timeout(job: CatalogJob, run: TickRow, now: datetime) -> datetime | None:
    """Since when a run still going is past its job's `timeout` (this config.yaml's), if it is:
    a thread cannot be stopped, so a timed-out thread job may run on for long."""
    if job.timeout is None or run.started_at is None:
        return None
    due_by = run.started_at + job.timeout
    return due_by if now > due_by else None


def running_words(run: dict[str, Any], when: Callable[[str | None], str]) -> str:
    """A run in `fleet_status` as the command and the page say it (`when`: an instant)."""
    said = f"on {run['instance']} since {when(run['since'])}"
    if run["replica_gone"]:
        seen = f", last seen {when(run['last_seen'])}" if run["last_seen"] else ""
        return f"{said}: replica gone, not yet marked{seen}"
    if run["past_timeout_since"]:
        return f"{said}: past its timeout since {when(run['past_timeout_since'])}"
    return said
