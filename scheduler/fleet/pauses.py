"""Pausing a job for the whole fleet: `scheduler pause` and `scheduler resume`.

A pause is one row of `tables.pauses`, read by every claim (postgres.sql,
`scheduler_choose`; embedded: `Steps.choose`): while it is there, each tick of
the job is recorded `paused` once for the fleet and none runs. A run already
going is not interrupted: it ends as it would have. A manual trigger still
runs the job (a person asked for it). The row lives in the ledger, so the
pause outlives every replica and the database's restarts.

Pausing and resuming raise `job.paused` and `job.resumed` notices in the same
transaction; the next live replica delivers them (see `scheduler.observers.notices`).
Two people pausing at once make one pause and one notice (the primary key).
"""

from __future__ import annotations

import getpass
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, delete, select

from scheduler.errors import ConfigError, LedgerError
from scheduler.gate.ahead import LEASE
from scheduler.ledger import tables
from scheduler.ledger.outbox import add_notice
from scheduler.ledger.times import iso
from scheduler.observers import alerts
from scheduler.text import printable, storable
from scheduler.waits import sleep as wait

MAX_REASON = 500  # characters of a pause's reason
MAX_ACTOR = 200  # characters of who paused or resumed
# Seconds after a pause commits during which a run claimed before it may still start (a
# run won ahead of a free worker, under its lease: scheduler/gate/ahead.py).
SETTLE = LEASE
PAUSE_TRIES = 3  # a pause found in force, and resumed before it was read: tried again


@dataclass(frozen=True)
class Pause:
    key: int
    job: str
    by: str
    at: datetime
    reason: str | None

    def as_json(self) -> dict[str, object]:
        return {"by": self.by, "at": iso(self.at), "reason": self.reason}

    def describe(self) -> str:
        why = f": {self.reason}" if self.reason else ""
        return printable(f"paused by {self.by} since {iso(self.at)}{why}")


def default_actor() -> str:
    """user@host of whoever runs the command, for the record (`--by` overrides it)."""
    try:
        user = getpass.getuser()
    except Exception:  # no user name in the environment nor the password database
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def checked(text: str | None, what: str, limit: int) -> str | None:
    """A reason or a name as given, or one clear error: it is kept, not cut short.

    (What reaches the ledger by another way is made storable there, cut if it must.)"""
    if text is None:
        return None
    text = text.strip()
    if len(text) > limit:
        raise ConfigError(f"{what}: at most {limit} characters, got {len(text)}")
    return text or None


def settle(sleep: Callable[[float], None] = wait) -> None:
    """After a new pause has committed: once this returns, no run of the job starts
    (but a run a person asks for), on any replica."""
    sleep(SETTLE)


def paused_jobs(conn: Connection, key: int | None = None) -> dict[int, Pause]:
    """The pauses in force (of the job `key` alone, if given)."""
    p = tables.pauses
    query = select(p) if key is None else select(p).where(p.c.job_key == key)
    return {
        row.job_key: Pause(row.job_key, row.job_name, row.paused_by, row.paused_at, row.reason)
        for row in conn.execute(query)
    }


def pause(
    conn: Connection, key: int, name: str, *, by: str, reason: str | None, now: datetime
) -> tuple[Pause, bool]:
    """Pause the job (inside the caller's transaction); returns the pause in force and
    whether this call made it (False: it was paused already, and stays as it was)."""
    p = tables.pauses
    by, reason = storable(by, MAX_ACTOR) or "unknown", storable(reason, MAX_REASON)
    statement = (
        tables.upsert(conn, p)
        .values(job_key=key, job_name=name, paused_by=by, paused_at=now, reason=reason)
        .on_conflict_do_nothing(index_elements=[p.c.job_key])
        .returning(p.c.job_key)
    )
    # The pause found in force may be ended by a resume that commits between the two
    # statements: then this call pauses the job after all (a few tries, then the error).
    for _ in range(PAUSE_TRIES):
        made = conn.execute(statement).first() is not None
        in_force = paused_jobs(conn, key).get(key)
        if in_force is not None:
            break
    else:
        raise LedgerError(
            f"job {name}: paused and resumed by others {PAUSE_TRIES} times while this pause "
            "was being made; nothing changed here: try again"
        )
    if made:
        facts = {"by": by, "at": iso(now), "reason": reason}
        add_notice(conn, alerts.JOB_PAUSED, key, name, facts, raised_by=by, now=now)
    return in_force, made


def resume(conn: Connection, key: int, name: str, *, by: str, now: datetime) -> Pause | None:
    """Resume the job (inside the caller's transaction); returns the pause it ended, if any."""
    p = tables.pauses
    by = storable(by, MAX_ACTOR) or "unknown"
    row = conn.execute(
        delete(p)
        .where(p.c.job_key == key)
        .returning(p.c.job_name, p.c.paused_by, p.c.paused_at, p.c.reason)
    ).first()
    if row is None:
        return None
    ended = Pause(key, row.job_name, row.paused_by, row.paused_at, row.reason)
    facts = {
        "by": by,
        "paused_by": ended.by,
        "paused_at": iso(ended.at),
        "reason": ended.reason,
        "paused_s": round((now - ended.at).total_seconds(), 3),
    }
    add_notice(conn, alerts.JOB_RESUMED, key, name, facts, raised_by=by, now=now)
    return ended
