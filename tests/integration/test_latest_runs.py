"""`status`'s last run of every job, read in one statement per hundred jobs (both backends)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from scheduler.ledger import tables
from scheduler.ledger.history import TickFilter, history, latest_of
from scheduler.statuses import FINISHED


def test_the_latest_finished_row_of_each_job_in_few_statements(backends):
    backend = backends("a")
    base = datetime(2026, 11, 30, 12, tzinfo=UTC)
    keys = list(range(1, 251))  # more than one statement's worth
    rows = []
    for key in keys:
        if key % 7 == 0:
            continue  # never ran
        for n in range(3):
            rows.append(
                {
                    "job_key": key,
                    "scheduled_at": base + timedelta(minutes=n),
                    "job_name": f"j{key}",
                    "status": ("succeeded", "failed", "skipped")[(key + n) % 3],
                    "instance": "a",
                    "run_id": key * 10 + n,
                }
            )
    statements: list[str] = []
    with backend.ledger_engine.begin() as conn:
        conn.execute(tables.ticks.insert(), rows)
    with backend.ledger_engine.connect() as conn:
        from sqlalchemy import event

        event.listen(conn, "before_cursor_execute", lambda *a: statements.append(a[2]))
        found = latest_of(conn, keys, FINISHED)
        statements_used = len([s for s in statements if "scheduler_ticks" in s])
        expected = {}
        for key in keys:
            newest = history(conn, TickFilter(key=key, statuses=FINISHED, limit=1))
            if newest:
                expected[key] = newest[0]
    assert statements_used == 3  # 250 jobs, a hundred at a time
    assert found == expected and len(found) == len(keys) - len(keys) // 7
    assert all(row.status in FINISHED for row in found.values())
