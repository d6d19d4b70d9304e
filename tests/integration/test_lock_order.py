"""Claims, finishes and sweeps take row locks in one global order, so they never deadlock.

The order is written down in scheduler/backends/postgres.sql; these tests
drive the statements against each other on real PostgreSQL sessions.
"""

from __future__ import annotations

import random
import threading
import time
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from scheduler.backends.base import ClaimRequest, FinishRequest, Intent, Outcome
from scheduler.backends.postgres import PostgresBackend
from scheduler.config.settings import Settings
from scheduler.fleet.housekeeping import Housekeeping
from scheduler.ledger.job_states import job_states
from scheduler.registry.catalog import Catalog
from tests.support import make_job, wait_for

NAMESPACE = 4545


def deadlocks(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_force_next_flush()")
        row = conn.execute(
            "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
    return int(row[0])


def request(key: int, at: datetime, intent: Intent = Intent.RUN) -> ClaimRequest:
    return ClaimRequest(
        key=key, name=f"job{key}", scheduled_at=at, intent=intent, grace_s=60, skip_threshold=3
    )


def backend(url: str, name: str) -> PostgresBackend:
    made = PostgresBackend(url, instance=name, namespace=NAMESPACE, holder_timeout=30)
    made.migrate()
    made.connect()
    return made


def waiting_on_a_lock(url: str, instance: str) -> bool:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE application_name = %s AND wait_event_type = 'Lock'",
            (instance,),
        ).fetchone()
    return bool(row and row[0])


def test_two_claims_skipping_the_same_jobs_in_other_orders_do_not_deadlock(database_url):
    """Each claim bumps the skip streaks of K3 and K5; they meet on those rows.

    A claims K5's tick before K3's (its K5 tick is older), B the other way round.
    Job rows are updated in key order whatever the ticks' order, so B waits for
    A (or A for B), never both for each other.
    """
    holder, a, b = (backend(database_url, n) for n in ("holder", "a", "b"))
    base = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=20)
    for key in (3, 5):  # the holder runs both jobs: every other tick of theirs is a skip
        (won,) = holder.claim([request(key, base)], "holder", capacity=10).every()
        assert won.outcome is Outcome.RUN
    for key in (3, 5):  # the jobs' streak rows exist
        (skipped,) = a.claim([request(key, base + timedelta(seconds=1))], "a", capacity=10).every()
        assert skipped.outcome is Outcome.SKIPPED
    batch_a = [request(5, base + timedelta(seconds=2)), request(3, base + timedelta(seconds=3))]
    batch_b = [request(3, base + timedelta(seconds=4)), request(5, base + timedelta(seconds=5))]
    before = deadlocks(database_url)
    errors: list[BaseException] = []

    def claim(replica: PostgresBackend, batch: list[ClaimRequest]) -> None:
        try:
            replica.claim(batch, replica.instance, capacity=10).every()
        except BaseException as exc:
            errors.append(exc)

    with psycopg.connect(database_url) as blocker:
        blocker.execute("SELECT 1 FROM scheduler_jobs WHERE job_key = 3 FOR UPDATE")
        first = threading.Thread(target=claim, args=(b, batch_b))
        first.start()
        wait_for(lambda: waiting_on_a_lock(database_url, "b"), 10, "b to wait for K3")
        second = threading.Thread(target=claim, args=(a, batch_a))
        second.start()
        time.sleep(1)  # a has taken what it takes before it waits
        blocker.rollback()
    first.join(20)
    second.join(20)
    assert not errors, errors
    assert deadlocks(database_url) == before
    for replica in (holder, a, b):
        replica.close()


@pytest.mark.fleet
def test_claims_finishes_and_sweeps_running_together_never_deadlock(database_url):
    """Replicas claim, skip, crash and finish random batches of a few jobs for a while."""
    keys = list(range(11, 19))
    jobs = Catalog(tuple(make_job(k, lambda ctx: None, name=f"job{k}") for k in keys))
    replicas = [backend(database_url, f"r{i}") for i in range(4)]
    keeper = Housekeeping(replicas[0], jobs, Settings(instance_name="sweeper"))
    before = deadlocks(database_url)
    stop = time.monotonic() + 12
    errors: list[BaseException] = []
    start = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=50)

    def work(replica: PostgresBackend, seed: int) -> None:
        rng = random.Random(seed)
        running: dict[int, tuple[datetime, int]] = {}
        try:
            while time.monotonic() < stop:
                ticks = [start + timedelta(seconds=rng.randrange(0, 60)) for _ in keys]
                batch = []
                for key, at in zip(keys, ticks, strict=True):
                    if rng.random() < 0.6:
                        intent = Intent.SKIP if key in running else Intent.RUN
                        batch.append(request(key, at, intent))
                for result in replica.claim(batch, replica.instance, capacity=5).every():
                    if result.outcome is Outcome.RUN:
                        running[result.key] = (result.scheduled_at, result.run_id)
                done = [k for k in running if rng.random() < 0.5]
                if done:
                    replica.finish(
                        [
                            FinishRequest(
                                key=k,
                                scheduled_at=running[k][0],
                                run_id=running[k][1],
                                status=rng.choice(["succeeded", "failed"]),
                                error=None,
                                unlock=True,
                                fail_threshold=2,
                            )
                            for k in sorted(done)
                        ]
                    )
                    for k in done:
                        del running[k]
                if rng.random() < 0.05:  # the replica dies: its runs are left `running`
                    replica.connect()
                    running.clear()
        except BaseException as exc:
            errors.append(exc)

    def sweep() -> None:
        try:
            while time.monotonic() < stop:
                with keeper.backend.ledger_engine.begin() as conn:
                    now = keeper.backend.now(conn)
                    keeper.sweep_crashed(conn, now)
                    keeper.sweep_missed(conn, job_states(conn), now - timedelta(seconds=60), now)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(r, i)) for i, r in enumerate(replicas)]
    threads.append(threading.Thread(target=sweep))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for replica in replicas:
        replica.close()
        replica.ledger_engine.dispose()
    assert not errors, errors[:3]
    assert deadlocks(database_url) == before
