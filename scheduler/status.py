"""`scheduler status` and `scheduler history`: the fleet now, and what happened.

Read-only views over the ledger and the backend's live locks; the JSON shapes
are documented in README.md.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from scheduler import ledger, pauses
from scheduler.backends import Backend
from scheduler.catalog import Catalog
from scheduler.statuses import FINISHED


def history(backend: Backend, key: int | None, limit: int) -> list[dict[str, Any]]:
    with backend.ledger_engine.connect() as conn:
        return [row.as_json() for row in ledger.history(conn, key, limit)]


def fleet_status(backend: Backend, catalog: Catalog, now: datetime) -> dict[str, Any]:
    # One transaction: on SQLite this is BEGIN IMMEDIATE, so probing the file
    # locks can never make a concurrent claim see its lock as taken.
    with backend.ledger_engine.begin() as conn:
        instances = backend.live_instances(conn)
        holders = backend.lock_holders(conn)
        running = {row.key: row for row in ledger.running(conn)}
        states = ledger.job_states(conn)
        paused = pauses.paused_jobs(conn)
        jobs = []
        for job in catalog:
            state = states.get(job.key, {})
            run = running.get(job.key)
            last = ledger.latest(conn, job.key, FINISHED)
            jobs.append(
                {
                    **job.as_json(now),
                    "running": None
                    if run is None
                    else {
                        "instance": run.instance,
                        "since": ledger.iso(run.started_at),
                        "scheduled_at": ledger.iso(run.scheduled_at),
                        "run_id": run.run_id,
                        "lock_held_by": holders.get(job.key),
                    },
                    "last_run": None
                    if last is None
                    else {
                        "status": last.status,
                        "scheduled_at": ledger.iso(last.scheduled_at),
                        "instance": last.instance,
                        "finished_at": ledger.iso(last.finished_at),
                        "duration_s": last.duration_s,
                        "error": last.error,
                        "run_id": last.run_id,
                    },
                    "consecutive_skips": int(state.get("consecutive_skips") or 0),
                    "skip_alert_after": job.skip_threshold,
                    "consecutive_failures": int(state.get("consecutive_failures") or 0),
                    "fail_alert_after": job.fail_threshold,
                    "alerting": bool(state.get("skip_alerted") or state.get("fail_alerted")),
                    "paused": paused[job.key].as_json() if job.key in paused else None,
                }
            )
    return {
        "backend": backend.name,
        "instances": [
            {"name": i["name"], "since": ledger.iso(i.get("since")), "address": i.get("address")}
            for i in instances
        ],
        "jobs": jobs,
    }
