"""Run now, on the fleet: `scheduler trigger JOB` hands the run to a live replica.

The command writes a request row (`ledger.run_requests`) and, on PostgreSQL,
notifies the fleet's channel; every replica's lock session listens on it
(and its heartbeat looks for requests too, in case a notification came while
it was reconnecting). A replica that runs the job takes the request (one
UPDATE: exactly one replica gets it), runs it through its gate as a manual
tick (the job's lock decides, as for `--here`), and writes the outcome to
the row, where the command reads it. A request nobody takes is withdrawn by
the command that made it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine, delete, select, text, update

from scheduler import ledger
from scheduler.errors import one_line
from scheduler.text import storable

if TYPE_CHECKING:
    from scheduler.catalog import Catalog, CatalogJob

log = logging.getLogger("scheduler.run_now")


def ask(
    conn: Connection, key: int, name: str, *, by: str, now: datetime, namespace: int | None
) -> int:
    """Write a request (inside the caller's transaction); PostgreSQL: notify the fleet."""
    r = ledger.run_requests
    statement = r.insert().values(
        job_key=key, job_name=name, requested_by=storable(by, 200) or "unknown", requested_at=now
    )
    request = int(conn.execute(statement.returning(r.c.id)).scalar_one())
    if namespace is not None and conn.dialect.name == "postgresql":
        conn.execute(
            text("SELECT pg_notify(:channel, :id)"),
            {"channel": ledger.run_now_channel(namespace), "id": str(request)},
        )
    return request


def settle(
    conn: Connection,
    request: int,
    *,
    outcome: str,
    status: str | None,
    run_id: int | None,
    error: str | None,
    now: datetime,
) -> None:
    r = ledger.run_requests
    conn.execute(
        update(r)
        .where(r.c.id == request, r.c.finished_at.is_(None))
        .values(
            outcome=outcome, status=status, run_id=run_id, error=storable(error), finished_at=now
        )
    )


def state(conn: Connection, request: int) -> dict[str, Any] | None:
    row = conn.execute(
        select(ledger.run_requests).where(ledger.run_requests.c.id == request)
    ).first()
    return dict(row._mapping) if row else None


def patience(holder_timeout: float) -> float:
    """How long a request may wait untaken before its asker withdraws it: a replica's
    heartbeat (a third of holder_timeout) finds a request whose notification it missed."""
    return holder_timeout + 5


def withdraw(conn: Connection, request: int) -> bool:
    """Withdraw a request nobody took; False if a replica took it meanwhile."""
    r = ledger.run_requests
    return bool(conn.execute(delete(r).where(r.c.id == request, r.c.taken_by.is_(None))).rowcount)


class Desk:
    """A replica's side of run-now (the gate's RequestDesk): which jobs it can take, and
    where outcomes go.

    The gate takes requests through its lock session and runs them; the
    outcome is written here, on the ledger session, from whichever thread
    ends the run (never the lock session, which only the dispatcher uses).
    """

    def __init__(
        self, engine: Engine, jobs: Callable[[], Catalog], clock: Callable[[], datetime]
    ) -> None:
        self.engine = engine
        self.jobs = jobs  # the replica's catalog now (a reload replaces it)
        self.clock = clock

    def keys(self) -> list[int]:
        return [job.key for job in self.jobs()]

    def enabled_keys(self) -> list[int]:
        """Jobs whose retries and caught-up ticks run here: a disabled job starts nothing
        but a run a person asks for."""
        return [job.key for job in self.jobs() if job.enabled]

    def job(self, key: int) -> CatalogJob | None:
        return self.jobs().by_key(key)

    def settle(
        self,
        request: ledger.RunRequest,
        outcome: str,
        status: str | None,
        run_id: int | None,
        error: str | None,
    ) -> None:
        try:
            with self.engine.begin() as conn:
                settle(
                    conn,
                    request.id,
                    outcome=outcome,
                    status=status,
                    run_id=run_id,
                    error=error,
                    now=self.clock(),
                )
        except Exception as exc:  # the command sees it unsettled, and says so
            log.warning(
                "cannot record the outcome of run-now request %d: %s", request.id, one_line(exc)
            )
