"""A claim never waits for another replica's claim of the same tick.

An INSERT that meets a row another transaction inserted and has not committed waits for
that transaction to end. Two replicas claiming one tick at once (its owner late, a
helper taking it over) made whole batches wait on each other, and in a fleet short of
CPU the waits fed on themselves. The claim that comes second now leaves the tick
`yielded` at once, and finds it `lost` (or its own) when it tries again.

The first claim is held open here: `scheduler_decide` called on a session of the test's
own inside a transaction it ends when it chooses.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone

import psycopg
import pytest

from scheduler.backends.base import ClaimAnswer, ClaimRequest, Intent, Outcome
from scheduler.backends.postgres import PostgresBackend

NAMESPACE = 4646
KEY = 7
WAIT = 20.0  # seconds: far longer than an answer takes, far shorter than never


def request(at: datetime, key: int = KEY, intent: Intent = Intent.RUN) -> ClaimRequest:
    return ClaimRequest(
        key=key, name=f"job{key}", scheduled_at=at, intent=intent, grace_s=60, skip_threshold=3
    )


@pytest.fixture
def replica(database_url: str) -> Iterator[PostgresBackend]:
    made = PostgresBackend(database_url, instance="second", namespace=NAMESPACE, holder_timeout=30)
    made.migrate()
    made.connect()
    yield made
    made.close()


def open_claim(
    url: str,
    at: datetime,
    keys: list[int],
    expect: list[str] | None = None,
    capacity: int = 10,
    grace: float = 60.0,
) -> psycopg.Connection:
    """Another replica's claim of these ticks, left uncommitted."""
    conn = psycopg.connect(url, application_name="first")
    row = conn.execute(
        "SELECT outcomes FROM scheduler_decide(%s, 'first', %s, 0.2, 100000, 'crashed',"
        " %s::integer[], %s::text[], %s::timestamptz[], %s::text[], %s::float8[],"
        " %s::integer[], %s::integer[])",
        (
            NAMESPACE,
            capacity,
            keys,
            [f"job{k}" for k in keys],
            [at] * len(keys),
            ["run"] * len(keys),
            [grace] * len(keys),
            [3] * len(keys),
            [3] * len(keys),
        ),
    ).fetchone()
    assert row is not None and row[0] == (expect or ["run"] * len(keys))
    return conn


def claim_within(backend: PostgresBackend, requests: list[ClaimRequest]) -> ClaimAnswer:
    """The claim's answer, or a failure if it did not come within WAIT (it waited)."""
    found: list[ClaimAnswer] = []
    thread = threading.Thread(
        target=lambda: found.append(backend.claim(requests, "second", capacity=10)),
        daemon=True,
    )
    thread.start()
    thread.join(WAIT)
    assert found, f"the claim waited more than {WAIT:g} s for another claim's transaction"
    return found[0]


def outcomes(answer: ClaimAnswer) -> dict[int, Outcome]:
    return {result.key: result.outcome for result in answer.every()}


def test_a_tick_another_claim_is_recording_is_yielded_then_lost_once_it_commits(
    database_url: str, replica: PostgresBackend
) -> None:
    at = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=2)
    first = open_claim(database_url, at, [KEY])
    try:
        # Another tick in the same batch is not held up by the one left to the first claim.
        answer = claim_within(replica, [request(at), request(at, key=KEY + 1)])
        assert outcomes(answer) == {KEY: Outcome.YIELDED, KEY + 1: Outcome.RUN}
        first.commit()
        assert outcomes(claim_within(replica, [request(at)])) == {KEY: Outcome.LOST}
    finally:
        first.close()


def test_a_tick_to_record_skipped_waits_no_more_than_one_to_run(
    database_url: str, replica: PostgresBackend
) -> None:
    """A replica whose run of the job goes on claims the job's next tick to record it
    skipped; another replica recording that tick at the same moment makes it yield too."""
    at = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=2)
    first = open_claim(database_url, at, [KEY])
    try:
        skip = request(at, intent=Intent.SKIP)
        assert outcomes(claim_within(replica, [skip])) == {KEY: Outcome.YIELDED}
        first.commit()
        assert outcomes(claim_within(replica, [skip])) == {KEY: Outcome.LOST}
    finally:
        first.close()


def test_a_tick_whose_other_claim_rolled_back_is_claimed_when_tried_again(
    database_url: str, replica: PostgresBackend
) -> None:
    at = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=2)
    first = open_claim(database_url, at, [KEY])
    try:
        assert outcomes(claim_within(replica, [request(at)])) == {KEY: Outcome.YIELDED}
        first.rollback()  # its session lock on the job stays: another session's, not ours
        first.close()
        assert outcomes(claim_within(replica, [request(at)])) == {KEY: Outcome.RUN}
    finally:
        first.close()


def test_the_lock_of_a_tick_is_apart_from_the_jobs_locks(
    database_url: str, replica: PostgresBackend
) -> None:
    """A claim recording a tick is never seen as holding a job's lock (nor a presence), and
    every replica names a tick's lock alike, whatever its time zone."""
    at = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=2)
    with psycopg.connect(database_url) as conn:
        conn.execute(
            "SELECT pg_advisory_xact_lock(scheduler_tick_lock(%s, %s, %s))", (NAMESPACE, KEY, at)
        )
        seen = conn.execute("SELECT count(*) FROM scheduler_locks(%s)", (NAMESPACE,)).fetchone()
        same = conn.execute(
            "SELECT scheduler_tick_lock(%(ns)s, %(key)s, %(at)s)"
            "     = scheduler_tick_lock(%(ns)s, %(key)s, %(elsewhere)s),"
            " scheduler_tick_lock(%(ns)s, %(key)s, %(at)s)"
            "     <> scheduler_tick_lock(%(ns)s, %(key)s, %(next)s)",
            {
                "ns": NAMESPACE,
                "key": KEY,
                "at": at,
                "elsewhere": at.astimezone(timezone(timedelta(hours=5, minutes=30))),
                "next": at + timedelta(seconds=1),
            },
        ).fetchone()
    assert seen is not None and seen[0] == 1  # the replica's presence, nothing else
    assert same == (True, True)


def ledger_reads(conn: psycopg.Connection) -> int:
    """Rows and index entries of the ledger read so far (every scan, every index)."""
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(
        "SELECT coalesce(t.seq_tup_read, 0) + coalesce(sum(i.idx_tup_read), 0)"
        " FROM pg_stat_user_tables t JOIN pg_stat_user_indexes i ON i.relid = t.relid"
        " WHERE t.relname = 'scheduler_ticks' GROUP BY t.seq_tup_read"
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_claim_reads_the_ledger_rows_of_its_own_ticks_only(
    database_url: str, replica: PostgresBackend
) -> None:
    """However large the ledger and however many runs are in flight, a claim reads the
    rows of the jobs it claims: the class of a join that nested loops being off (in
    scheduler_decide) turned into a scan. Step 6 (crash stale runs) read the whole index
    of running rows in every claim, and every entry a finished run left in it until a
    vacuum (40 replicas of 1,000 jobs: 20 ms a claim, the most of any step).
    """
    at = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=2)
    stale = at - timedelta(hours=1)
    held = KEY + 1  # a job whose run goes on elsewhere: its tick is skipped
    with (
        psycopg.connect(database_url, autocommit=True) as conn,
        psycopg.connect(database_url, autocommit=True) as elsewhere,
    ):
        conn.execute(  # a ledger of past ticks, and other replicas' runs in flight
            "INSERT INTO scheduler_ticks (job_key, scheduled_at, job_name, status, instance,"
            " run_id, started_at)"
            " SELECT 1000 + k %% 1000, %s - make_interval(secs => k / 1000 + 1), 'old' || k,"
            "        'succeeded', 'elsewhere', NULL, NULL FROM generate_series(0, 19999) k",
            (stale,),
        )
        conn.execute(
            "INSERT INTO scheduler_ticks (job_key, scheduled_at, job_name, status, instance,"
            " run_id, started_at)"
            " SELECT 1000 + k, %s, 'other' || k, 'running', 'elsewhere', k, now()"
            " FROM generate_series(1, 2000) k",
            (at,),
        )
        conn.execute(  # this job's run left by a replica that died; the held job's going
            "INSERT INTO scheduler_ticks (job_key, scheduled_at, job_name, status, instance,"
            " run_id, started_at) VALUES (%s, %s, %s, 'running', 'gone', 1, now()),"
            " (%s, %s, %s, 'running', 'elsewhere', 2, now())",
            (KEY, stale, f"job{KEY}", held, stale, f"job{held}"),
        )
        elsewhere.execute("SELECT pg_advisory_lock(%s, %s)", (NAMESPACE, held))
        conn.execute("ANALYZE scheduler_ticks")
        before = ledger_reads(conn)
        first = open_claim(database_url, at, [KEY, held], expect=["skipped", "run"])
        first.execute("SELECT pg_stat_force_next_flush()")
        first.commit()
        first.close()
        after = ledger_reads(conn)
        status = conn.execute(
            "SELECT status FROM scheduler_ticks WHERE job_key = %s AND scheduled_at = %s",
            (KEY, stale),
        ).fetchone()
    assert status == ("crashed",)  # the stale run was found
    assert after - before < 100, f"the claim read {after - before} rows and entries"


def tick_locks(conn: psycopg.Connection) -> int:
    """The one-key advisory locks (ticks' locks) this session holds now."""
    row = conn.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1"
        " AND pid = pg_backend_pid()"
    ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize(
    ("capacity", "grace", "recorded", "locks"),
    [
        (300, 60.0, ["run"] * 300, 32),  # runs: the first 32 tried
        (300, 0.5, ["missed"] * 300, 0),  # a burst recorded missed: none
        (5, 60.0, ["run"] * 5, 5),  # the deferred ones insert nothing
    ],
)
def test_a_claim_takes_a_bounded_number_of_tick_locks(
    database_url: str,
    replica: PostgresBackend,
    capacity: int,
    grace: float,
    recorded: list[str],
    locks: int,
) -> None:
    """Each tick's lock holds an entry of the server's shared lock table until the claim
    commits, and a full table fails every lock in the database: a claim tries the locks
    of its runs and skips only, 32 at most, never of a burst's ticks recorded missed."""
    at = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=2)
    keys = list(range(1000, 1300))
    first = open_claim(database_url, at, keys, recorded, capacity=capacity, grace=grace)
    try:
        assert tick_locks(first) == locks
    finally:
        first.rollback()
        first.close()
