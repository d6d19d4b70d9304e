"""Run policies on real replicas and a real PostgreSQL (docs/run-policies.md).

Retries: each attempt runs once for the fleet, where the ledger says; the
failure streak and its alert count ticks, not attempts; a retry pending when
its replica is SIGKILLed is run by another. Catch-up: a fleet that was down
for several ticks of a job with `catch_up: all` runs the newest
`catch_up_limit` of them once each, oldest first, with three replicas
starting at once, and records the others missed.
"""

from __future__ import annotations

import itertools
import json
import signal
import time
from collections import Counter
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from tests.support import Fleet, Receiver, cli, parse_tick, wait_for

pytestmark = pytest.mark.fleet

NAMES = ["p1", "p2", "p3"]


def attempts(fleet: Fleet, job: str) -> list[dict]:
    return [e for e in fleet.evidence() if e["job"] == job and e.get("event") == "attempt"]


def earlier_attempts(fleet: Fleet, key: int) -> list[dict]:
    with psycopg.connect(fleet.database_url) as conn:
        cur = conn.cursor(row_factory=psycopg.rows.dict_row)
        query = "SELECT * FROM scheduler_attempts WHERE job_key = %s ORDER BY scheduled_at, attempt"
        return list(cur.execute(query, (key,)))


def failure_streak(fleet: Fleet, key: int) -> int:
    with psycopg.connect(fleet.database_url) as conn:
        found = conn.execute(
            "SELECT consecutive_failures FROM scheduler_jobs WHERE job_key = %s", (key,)
        ).fetchone()
    return found[0] if found else 0


def final(fleet: Fleet, job: str) -> dict[datetime, dict]:
    return {
        r["scheduled_at"]: r
        for r in fleet.ledger(job)
        if r["status"] == "succeeded" or (r["status"] == "failed" and r["retry_at"] is None)
    }


def test_retries_run_each_attempt_once_where_the_ledger_says_and_count_ticks(
    tmp_path, database_url
):
    receiver = Receiver()
    fleet = Fleet(
        tmp_path,
        database_url,
        {
            "flaky": {"interval": "8s", "retries": 2, "retry_delay": "1s", "fail_alert_after": 1},
            "stubborn": {"interval": "8s", "retries": 1, "retry_delay": "4s"},
        },
        {"alert_webhook_url": receiver.url(), "holder_timeout": 6},
        job_files=["policies.py"],
    )
    try:
        for name in NAMES:
            fleet.start(name)
        fleet.wait_ready()
        # Two ticks of each job reach their final attempt.
        wait_for(lambda: len(final(fleet, "flaky")) >= 2, 90, "two ticks of flaky done")
        wait_for(lambda: len(final(fleet, "stubborn")) >= 2, 90, "two ticks of stubborn done")

        # flaky: attempts 1, 2, 3 of each tick, each run once for the fleet, on the
        # replica the ledger names; the tick ends succeeded; no failure alert.
        done = final(fleet, "flaky")
        runs = attempts(fleet, "flaky")
        kept = earlier_attempts(fleet, 161)
        for at, row in done.items():
            mine = [e for e in runs if parse_tick(e["tick"]) == at]
            assert sorted(e["attempt"] for e in mine) == [1, 2, 3], (at, mine)
            assert row["status"] == "succeeded" and row["attempt"] == 3
            by_attempt = {e["attempt"]: e for e in mine}
            assert by_attempt[3]["instance"] == row["instance"]
            assert by_attempt[3]["run_id"] == row["run_id"]
            for old in (r for r in kept if r["scheduled_at"] == at):
                assert old["status"] == "failed"
                assert by_attempt[old["attempt"]]["instance"] == old["instance"]
                assert by_attempt[old["attempt"]]["run_id"] == old["run_id"]
            assert sorted(r["attempt"] for r in kept if r["scheduled_at"] == at) == [1, 2]
        assert failure_streak(fleet, 161) == 0
        assert not [b for b in receiver.bodies("job.failures_exceeded") if b["job"] == "flaky"]

        # stubborn: two attempts per tick, final failed, the streak grows by one per tick.
        done = final(fleet, "stubborn")
        runs = attempts(fleet, "stubborn")
        for at, row in done.items():
            mine = [e for e in runs if parse_tick(e["tick"]) == at]
            assert sorted(e["attempt"] for e in mine) == [1, 2], (at, mine)
            assert row["status"] == "failed" and row["attempt"] == 2
        finished = len(final(fleet, "stubborn"))
        assert failure_streak(fleet, 162) in (finished, finished + 1)

        # A replica SIGKILLed while stubborn's retry is pending (its failed first attempt
        # recorded, with when the next is due): another replica runs it.
        done_before = set(final(fleet, "stubborn"))

        def pending_retry() -> dict | None:
            return next(
                (
                    r
                    for r in fleet.ledger("stubborn")
                    if r["retry_at"] is not None and r["scheduled_at"] not in done_before
                ),
                None,
            )

        pending = wait_for(pending_retry, 60, "a failed first attempt of stubborn, retry pending")
        killed = pending["instance"]
        fleet.replicas[killed].signal(signal.SIGKILL)
        at = pending["scheduled_at"]
        retried = wait_for(
            lambda: next(
                (
                    e
                    for e in attempts(fleet, "stubborn")
                    if parse_tick(e["tick"]) == at and e["attempt"] == 2
                ),
                None,
            ),
            60,
            "the pending retry to run on another replica",
        )
        assert retried["instance"] != killed
        wait_for(lambda: at in final(fleet, "stubborn"), 30, "the retried tick recorded")
        assert final(fleet, "stubborn")[at]["instance"] == retried["instance"]
        counts = Counter((e["tick"], e["attempt"]) for e in attempts(fleet, "stubborn"))
        assert max(counts.values()) == 1, counts
        counts = Counter((e["tick"], e["attempt"]) for e in attempts(fleet, "flaky"))
        assert max(counts.values()) == 1, counts
    finally:
        fleet.kill_all()
        receiver.close()


def test_catch_up_all_runs_the_newest_missed_ticks_once_each_oldest_first(tmp_path, database_url):
    fleet = Fleet(
        tmp_path,
        database_url,
        {
            "backlog": {
                "interval": "2s",
                "catch_up": "all",
                "catch_up_window": "1m",
                "catch_up_limit": 3,
                "misfire_grace": "1s",
            }
        },
        {"holder_timeout": 6},
        job_files=["policies.py"],
    )
    try:
        fleet.start("p1")
        fleet.wait_ready()
        wait_for(lambda: len(fleet.ends()) >= 2, 60, "a few runs before the fleet stops")
        assert fleet.stop() == {"p1": 0}, fleet.logs()
        last_before = max(parse_tick(e["tick"]) for e in fleet.starts())
        time.sleep(11)  # five ticks or more with no replica up
        for name in NAMES:  # three replicas at once
            fleet.start(name)
        fleet.wait_ready()

        def caught_up() -> list[dict]:
            """Caught up after the gap: the first start may have caught up a tick too (one
            that fell due between its registration and its scheduler's start)."""
            rows = fleet.ledger("backlog")
            return [r for r in rows if r["caught_up"] and r["scheduled_at"] > last_before]

        wait_for(
            lambda: sum(r["status"] == "succeeded" for r in caught_up()) >= 3,
            60,
            "three caught-up ticks",
        )
        rows = {r["scheduled_at"]: r for r in fleet.ledger("backlog")}
        ups = sorted(r["scheduled_at"] for r in caught_up())
        assert len(ups) == 3, fleet.logs()
        assert [b - a for a, b in itertools.pairwise(ups)] == [timedelta(seconds=2)] * 2
        # The ticks of the gap older than those three are recorded missed, none run.
        gap = [at for at in rows if last_before < at < ups[0]]
        assert len(gap) >= 2 and all(rows[at]["status"] == "missed" for at in gap), rows
        # The next tick after them was no caught-up one: they were the newest missed.
        after = [at for at in rows if at > ups[-1]]
        wait_for(lambda: fleet.ledger("backlog")[-1]["scheduled_at"] > ups[-1], 30, "a later tick")
        assert not any(rows[at]["caught_up"] for at in after)
        # Each ran once for the fleet, oldest first.
        starts = [e for e in fleet.starts() if parse_tick(e["tick"]) in ups]
        assert sorted(Counter(parse_tick(e["tick"]) for e in starts).values()) == [1, 1, 1]
        by_time = sorted(starts, key=lambda e: e["at"])
        assert [parse_tick(e["tick"]) for e in by_time] == ups
        assert not any(e.get("overlap") for e in fleet.starts())
        assert all(rows[at]["instance"] in NAMES for at in ups)
    finally:
        fleet.kill_all()


def test_spread_moves_100_jobs_of_one_grid_apart_the_same_everywhere_each_once(
    tmp_path, database_url
):
    """The replicas' clocks are set a few seconds before a minute starts (libfaketime; the
    database keeps the real time), so the minute's 100 ticks come within the test."""
    names = [f"minutely_{n:03d}" for n in range(100)]
    fleet = Fleet(
        tmp_path,
        database_url,
        {name: {"cron": "* * * * *", "spread": "30s"} for name in names},
        {"holder_timeout": 6, "misfire_grace": 120},
        job_files=["spread.py"],
    )
    now = datetime.now(UTC)
    # Replicas at hh:mm:45: a loaded machine may take seconds to start three replicas of
    # 100 jobs, and a tick that passed before a replica's scheduler started is not fired.
    lead = 15
    ahead = (60 - now.second - now.microsecond / 1e6 - lead) % 60
    try:
        for name in NAMES:
            fleet.start(name, clock_offset=f"+{ahead:.3f}s")
        fleet.wait_ready()
        minute = (now + timedelta(seconds=ahead + lead + 1)).replace(second=0, microsecond=0)
        in_minute = lambda: [  # noqa: E731
            e
            for e in fleet.starts()
            if minute <= parse_tick(e["tick"]) < minute + timedelta(minutes=1)
        ]
        wait_for(lambda: len(in_minute()) >= 100, 90, "every job's tick of the minute")
        time.sleep(1)
        runs = in_minute()
        ticks = Counter((e["job"], parse_tick(e["tick"])) for e in runs)
        assert sorted({job for job, _ in ticks}) == names and set(ticks.values()) == {1}
        offsets = {job: (at - minute).total_seconds() for job, at in ticks}
        assert all(0 <= s < 30 and s == int(s) for s in offsets.values()), offsets
        assert len(set(offsets.values())) >= 20, sorted(offsets.values())
        assert len({e["instance"] for e in runs}) >= 2
        # A process of its own (as a restarted replica) computes the same offsets.
        done = cli(
            fleet,
            "jobs",
            "--next",
            "1",
            "--after",
            (minute - timedelta(seconds=1)).isoformat(),
            "--json",
        )
        assert done.returncode == 0, done.stderr
        shown = {
            row["name"]: (parse_tick(row["next_ticks"][0]) - minute).total_seconds()
            for row in json.loads(done.stdout)
        }
        assert shown == offsets
        rows = [
            r for r in fleet.ledger() if minute <= r["scheduled_at"] < minute + timedelta(minutes=1)
        ]
        assert len(rows) == 100 and {r["status"] for r in rows} == {"succeeded"}
    finally:
        fleet.kill_all()
