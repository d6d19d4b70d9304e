"""Run now, on the fleet: `scheduler trigger JOB` hands the run to a live replica.

The command writes a request row (`tables.run_requests`) and, on PostgreSQL,
notifies the fleet's channel; every replica's lock session listens on it
(and its heartbeat looks for requests too, in case a notification came while
it was reconnecting). A replica that runs the job takes the request (one
UPDATE: exactly one replica gets it), runs it through its gate as a manual
tick (the job's lock decides, as for `--here`), and writes the outcome to
the row. A request nobody takes is withdrawn by the command that made it.

What became of a request is read from the ledger, never from who is live
(`look`): a replica that took it may die, come back under the same name, be
cut off for a moment, or fail to write the outcome; its run's row says how
the run ended, and whoever looks first (the command, the page, housekeeping)
writes that outcome to the request. Every wait is bounded (`wait`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine, delete, select, text
from sqlalchemy.exc import SQLAlchemyError

from scheduler.errors import one_line
from scheduler.fleet.housekeeping import SWEEP_EVERY
from scheduler.ledger import tables
from scheduler.ledger.history import running_of
from scheduler.ledger.run_now import RunRequest, run_now_channel, run_of_request, settle_request
from scheduler.statuses import Status
from scheduler.text import printable, storable

if TYPE_CHECKING:
    from scheduler.backends.base import LedgerStore
    from scheduler.registry.catalog import Catalog, CatalogJob

log = logging.getLogger("scheduler.run_now")

LOOK_EVERY = 0.5  # seconds between two looks of a waiting command


def ask(conn: Connection, key: int, name: str, *, by: str, now: Any, namespace: int | None) -> int:
    """Write a request (inside the caller's transaction); PostgreSQL: notify the fleet.

    `now`: the ledger's clock (`LedgerStore.now_expression`), which `look` measures by."""
    r = tables.run_requests
    statement = r.insert().values(
        job_key=key, job_name=name, requested_by=storable(by, 200) or "unknown", requested_at=now
    )
    request = int(conn.execute(statement.returning(r.c.id)).scalar_one())
    if namespace is not None and conn.dialect.name == "postgresql":
        conn.execute(
            text("SELECT pg_notify(:channel, :id)"),
            {"channel": run_now_channel(namespace), "id": str(request)},
        )
    return request


def state(conn: Connection, request: int) -> dict[str, Any] | None:
    row = conn.execute(
        select(tables.run_requests).where(tables.run_requests.c.id == request)
    ).first()
    return dict(row._mapping) if row else None


def patience(holder_timeout: float) -> float:
    """How long a request may wait untaken before its asker withdraws it (a replica's
    heartbeat, a third of holder_timeout, finds a request whose notification it missed),
    and how long a taken one may go without a run in the ledger before its asker says it
    does not know what became of it (the take and the claim are one step of the taker)."""
    return holder_timeout + 5


def orphan_patience(holder_timeout: float) -> float:
    """How long a run may stay `running` with nobody holding its job's lock before its asker
    stops waiting for a replica's sweep to record it crashed."""
    return holder_timeout + SWEEP_EVERY + 5


def withdraw(conn: Connection, request: int) -> bool:
    """Withdraw a request nobody took; False if a replica took it meanwhile."""
    r = tables.run_requests
    return bool(conn.execute(delete(r).where(r.c.id == request, r.c.taken_by.is_(None))).rowcount)


class Phase(StrEnum):
    WAITING = "waiting"  # nobody has taken it yet
    TAKEN = "taken"  # a replica took it; no run of it is in the ledger yet
    RUNNING = "running"  # its run is going
    SETTLED = "settled"  # its outcome is in the ledger
    WITHDRAWN = "withdrawn"  # nobody took it within `patience`: withdrawn
    UNKNOWN = "unknown"  # taken, but the ledger does not say what became of it, in time
    GONE = "gone"  # no such request (withdrawn by another, or pruned)


FINAL = frozenset({Phase.SETTLED, Phase.WITHDRAWN, Phase.UNKNOWN, Phase.GONE})


@dataclass(frozen=True)
class Answer:
    """What became of a request, as the ledger says now."""

    phase: Phase
    request: int
    job: str = ""
    key: int | None = None
    taken_by: str | None = None
    taken_at: datetime | None = None
    outcome: str | None = None  # settled: run, held, lost
    status: str | None = None  # the run's
    run_id: int | None = None
    started_at: datetime | None = None
    error: str | None = None
    waited: float = 0.0  # seconds: since asked (untaken), since taken (no run yet)
    orphaned: bool = False  # running, and nobody holds the job's lock (its replica is gone)

    @property
    def final(self) -> bool:
        """The asker stops waiting."""
        return self.phase in FINAL

    def as_page(self) -> dict[str, Any] | None:
        """The fields the job page shows (None: no such request)."""
        if self.phase is Phase.GONE:
            return None
        settled = self.phase is Phase.SETTLED
        return {
            "id": self.request,
            "phase": str(self.phase),
            "finished_at": settled,
            "outcome": self.outcome if settled else None,
            "status": self.status,
            "run_id": self.run_id,
            "taken_by": self.taken_by,
            "error": self.error,
            "withdrawn": self.waited if self.phase is Phase.WITHDRAWN else None,
            "line": self.line(),
        }

    def line(self) -> str:
        """What the command prints (one line; what names and jobs said is escaped)."""
        job, where = printable(self.job), printable(self.taken_by or "a replica")
        if self.phase is Phase.SETTLED:
            return f"{job}: {self._outcome(where)}"
        if self.phase is Phase.UNKNOWN:
            return f"{job}: outcome unknown: {self._unknown(where)}; see `scheduler history {job}`"
        said = {
            Phase.WITHDRAWN: f"not run: no live replica took it within {self.waited:.0f} s"
            " (does their config.yaml have the job?)",
            Phase.GONE: f"request {self.request} is not in the ledger (pruned, or withdrawn)",
            Phase.RUNNING: f"run {self.run_id} running on {where}",
            Phase.TAKEN: f"taken by {where}",
            Phase.WAITING: "waiting for a replica to take it",
        }
        return f"{job}: {said[self.phase]}"

    def _outcome(self, where: str) -> str:
        error = f": {printable(self.error)}" if self.error else ""
        if self.outcome == "run":
            return f"run {self.run_id} {self.status} on {where}{error}"
        if self.outcome == "held":  # the error says where the job runs (`held_by`)
            return f"not run: {printable(self.error or 'its lock is held elsewhere')}"
        return f"not run on {where}{error or ': ' + str(self.outcome)}"

    def _unknown(self, where: str) -> str:
        if self.error:  # the ledger did not answer
            return printable(self.error)
        if self.run_id is not None:
            return (
                f"run {self.run_id} on {where} is recorded running, but nobody holds the job's"
                " lock and no replica has recorded how it ended"
            )
        at = self.taken_at.isoformat(timespec="milliseconds") if self.taken_at else "?"
        return (
            f"{where} took the request at {at}, and the ledger does not tell which run,"
            " if any, it became"
        )


def look(
    conn: Connection, request: int, *, now: datetime, holder_timeout: float, record: bool = True
) -> Answer:
    """What became of request R now, from the ledger and the ledger's clock `now`.

    A taken request whose run has ended is settled from the run's row; an untaken one
    past `patience` is withdrawn. A taken one with no run that is surely its own (see
    `run_of_request`) waits for its replica's word while a run that may be its
    own goes on, and for `patience` after; then it is UNKNOWN. `record=False` answers
    the same and writes nothing (a page that only shows it).
    """
    row = state(conn, request)
    if row is None:
        return Answer(Phase.GONE, request)
    answer = _answer(row)
    if answer.phase is Phase.SETTLED:
        return answer
    wait = patience(holder_timeout)
    if answer.taken_by is None:
        waited = (now - row["requested_at"]).total_seconds()
        if waited > wait and (not record or withdraw(conn, request)):
            return replace(answer, phase=Phase.WITHDRAWN, waited=waited)
        return replace(answer, phase=Phase.WAITING, waited=waited)
    run = run_of_request(conn, row)
    if run is not None and run.status == Status.RUNNING:  # its run, or maybe its run: wait
        return replace(answer, phase=Phase.RUNNING, run_id=run.run_id, started_at=run.started_at)
    if run is None or not run.sure:  # its replica has said nothing yet: it may still
        since = row["taken_at"] if run is None else run.finished_at or row["taken_at"]
        waited = (now - since).total_seconds()
        return replace(answer, phase=Phase.UNKNOWN if waited > wait else Phase.TAKEN, waited=waited)
    ran = replace(answer, run_id=run.run_id, started_at=run.started_at, status=run.status)
    if record and not settle_request(
        conn, request, outcome="run", status=run.status, run_id=run.run_id, error=run.error, now=now
    ):  # its replica settled it meanwhile: its words
        return look(conn, request, now=now, holder_timeout=holder_timeout, record=False)
    return replace(ran, phase=Phase.SETTLED, outcome="run", error=run.error)


def _answer(row: dict[str, Any]) -> Answer:
    settled = row["finished_at"] is not None
    return Answer(
        Phase.SETTLED if settled else Phase.WAITING,
        row["id"],
        job=row["job_name"],
        key=row["job_key"],
        taken_by=row["taken_by"],
        taken_at=row["taken_at"],
        outcome=row["outcome"],
        status=row["status"],
        run_id=row["run_id"],
        error=row["error"],
    )


def wait(
    backend: LedgerStore,
    request: int,
    *,
    job: str,
    holder_timeout: float,
    monotonic: Callable[[], float],
    sleep: Callable[[float], None],
) -> Answer:
    """Look until the answer is final: a command's wait, bounded in every case.

    Untaken: `patience` after asking. Taken without a run: `patience` after the take.
    Running: as long as the run goes, i.e. while some session holds the job's lock;
    once none does, a replica's sweep records it crashed, and if none has within
    `orphan_patience` (no replica is up to do it), the answer is UNKNOWN. A ledger
    that does not answer for `patience`: UNKNOWN.
    """
    last = Answer(Phase.WAITING, request, job=job)
    orphaned_since: float | None = None
    failing_since: float | None = None
    while True:
        try:
            last = replace(_look_now(backend, request, holder_timeout), job=job)
        except SQLAlchemyError as exc:
            failing_since = monotonic() if failing_since is None else failing_since
            if monotonic() - failing_since > patience(holder_timeout):
                return replace(last, phase=Phase.UNKNOWN, error=f"the ledger: {one_line(exc)}")
            sleep(LOOK_EVERY)
            continue
        failing_since = None
        if last.final:
            return last
        if not last.orphaned:
            orphaned_since = None
        elif orphaned_since is None:
            orphaned_since = monotonic()
        elif monotonic() - orphaned_since > orphan_patience(holder_timeout):
            return replace(last, phase=Phase.UNKNOWN)
        sleep(LOOK_EVERY)


def _look_now(backend: LedgerStore, request: int, holder_timeout: float) -> Answer:
    """`look` by the ledger's clock; a run going is `orphaned` if nobody holds its lock."""
    with backend.ledger_engine.begin() as conn:
        answer = look(conn, request, now=backend.now(conn), holder_timeout=holder_timeout)
        if answer.phase is Phase.RUNNING and answer.key is not None:
            orphaned = answer.key in backend.free_locks(conn, [answer.key])
            answer = replace(answer, orphaned=orphaned)
    return answer


def held_by(conn: Connection, key: int, holder: str | None) -> str:
    """Why a request was not run, truthfully: the run that holds the job's lock, if the
    ledger has it (on this replica or another), else the lock's holder."""
    run = running_of(conn, key)
    if run is not None and run.instance and run.started_at is not None:
        since = run.started_at.isoformat(timespec="milliseconds")
        return f"already running on {run.instance} (run {run.run_id}, since {since})"
    return f"its lock is held by {holder or 'another replica'}"


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
        request: RunRequest,
        outcome: str,
        status: str | None,
        run_id: int | None,
        error: str | None,
    ) -> None:
        try:
            with self.engine.begin() as conn:
                if outcome == "held":
                    error = held_by(conn, request.key, _holder(error))
                settle_request(
                    conn,
                    request.id,
                    outcome=outcome,
                    status=status,
                    run_id=run_id,
                    error=storable(error),
                    now=self.clock(),
                )
        except Exception as exc:  # its run's row still tells: see `look`
            log.warning(
                "cannot record the outcome of run-now request %d: %s", request.id, one_line(exc)
            )


def _holder(error: str | None) -> str | None:
    """The gate says a held request's holder as "held by NAME"."""
    prefix = "held by "
    return error[len(prefix) :] if error and error.startswith(prefix) else error
