"""The two backends side by side: the same steps played on each, and their ledgers compared
row by row once the fleet has settled.

Both backends keep one contract (scheduler/backends/base.py), so the same steps must
leave the same ledger. What differs by design is listed in docs/faults.md (Simulation,
"The two ledgers") and made the same on both here, in a comparable play:

- A killed session: PostgreSQL ends it from the server's side at once; the embedded
  backend's locks are the kernel's and live as long as the process, so only the replica
  itself finds its session lost. A comparable play arms no killed session, restarts no
  database, and thaws a frozen replica before PostgreSQL would end its idle session.
- A fault inside a statement (a statement or lock timeout, a deadlock) lands at one of
  the statements a call writes with, and the two backends write with other statements.
  A comparable play raises it at the call's edge, before its first statement.
- The times the database stamps (started, finished, raised) are each backend's clock,
  and run ids come from a sequence on PostgreSQL (one a rolled-back claim used is not
  handed out again) and from a counter in the ledger on the embedded backend: neither
  is compared; the order of run ids is checked by the rule `run_id_grows` on each.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from sqlalchemy import Engine, select

from scheduler.ledger import tables

# Each table's compared columns: what the fleet decided, not when a clock said it happened.
Rows = dict[str, list[tuple[Any, ...]]]


def rows(engine: Engine) -> Rows:
    """The settled ledger's compared columns, in one order on both backends."""
    t, a, j, n, p = tables.ticks, tables.attempts, tables.jobs, tables.notices, tables.pauses
    queries = {
        "ticks": select(
            t.c.job_key, t.c.scheduled_at, t.c.status, t.c.instance, t.c.holder, t.c.manual,
            t.c.told, t.c.attempt, t.c.retry_at.is_not(None), t.c.caught_up, t.c.error,
        ).order_by(t.c.job_key, t.c.scheduled_at),
        "attempts": select(
            a.c.job_key, a.c.scheduled_at, a.c.attempt, a.c.instance, a.c.status, a.c.told,
            a.c.error,
        ).order_by(a.c.job_key, a.c.scheduled_at, a.c.attempt),
        "jobs": select(
            j.c.job_key, j.c.consecutive_skips, j.c.skip_alerted, j.c.consecutive_failures,
            j.c.fail_alerted, j.c.overrun_skips,
        ).order_by(j.c.job_key),
        "notices": select(n.c.event, n.c.job_key, n.c.scheduled_at, n.c.outcome).order_by(
            n.c.job_key, n.c.scheduled_at, n.c.event, n.c.outcome
        ),
        "pauses": select(p.c.job_key).order_by(p.c.job_key),
    }  # fmt: skip
    with engine.connect() as conn:
        return {name: [tuple(row) for row in conn.execute(q)] for name, q in queries.items()}


def differences(pg: Rows, embedded: Rows, limit: int = 8) -> list[str]:
    """Rows one ledger has and the other has not, table by table (at most `limit`)."""
    found: list[str] = []
    for table in pg:
        left, right = Counter(pg[table]), Counter(embedded[table])
        for row in sorted((left - right).elements(), key=repr):
            found.append(f"{table}: only on postgresql: {row}")
        for row in sorted((right - left).elements(), key=repr):
            found.append(f"{table}: only on embedded: {row}")
    found.sort(key=lambda line: (line.split(":")[0], line.split(": ", 2)[-1]))
    return found[:limit] + ([f"... and {len(found) - limit} more"] if len(found) > limit else [])


def count(compared: Rows) -> int:
    return sum(len(table) for table in compared.values())
