"""The claim/lock protocol, step by step, on both backends (see scheduler/gate.py).

Two backends opened in one process stand for two replicas: on PostgreSQL
they are two sessions; in embedded mode two sets of flock descriptors.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import text

from scheduler.backends.base import ClaimRequest, FinishRequest, Intent, Outcome
from scheduler.backends.postgres import PostgresBackend
from scheduler.backends.schema import CURRENT_VERSION
from tests.support import wait_for

NAMESPACE = 4242  # as the `backends` fixture
KEY = 77


@pytest.fixture
def replicas(backends):
    return backends


def tick(seconds_ago: float = 0.0) -> datetime:
    now = datetime.now(UTC).replace(microsecond=0)
    return now - timedelta(seconds=seconds_ago)


def claim(
    backend,
    at: datetime,
    intent: Intent = Intent.RUN,
    threshold: int = 3,
    grace: float = 30.0,
    key: int = KEY,
):
    request = ClaimRequest(
        key=key, name="job", scheduled_at=at, intent=intent, grace_s=grace, skip_threshold=threshold
    )
    (result,) = backend.claim([request], backend.instance, capacity=10).every()
    return result


LATER = datetime(2100, 1, 1, tzinfo=UTC)  # a next tick no run here can overrun


def finish(
    backend, result, status="succeeded", unlock=True, threshold=3, error=None, next_due=LATER
):
    request = FinishRequest(
        key=result.key,
        scheduled_at=result.scheduled_at,
        run_id=result.run_id,
        status=status,
        error=error,
        unlock=unlock,
        fail_threshold=threshold,
        next_due=next_due,
    )
    (outcome,) = backend.finish([request])
    return outcome


def die(backend) -> None:
    """The replica dies: its session ends, and its locks with it (once the server notices)."""
    if backend.name != "postgresql":
        backend.close()  # file locks are released by the close itself
        return
    pid = backend._conn.connection.driver_connection.info.backend_pid
    backend.close()

    def ended() -> bool:
        # A transaction of its own per look: pg_stat_activity is read once per transaction.
        with backend.ledger_engine.connect() as conn:
            query = text("SELECT 1 FROM pg_stat_activity WHERE pid = :pid")
            return conn.execute(query, {"pid": pid}).first() is None

    wait_for(ended, 10, "the server to end the session")


def rows(backend) -> dict[datetime, dict]:
    from sqlalchemy import select

    from scheduler.ledger import tables

    with backend.ledger_engine.connect() as conn:
        found = conn.execute(select(tables.ticks).where(tables.ticks.c.job_key == KEY))
        return {r.scheduled_at: dict(r._mapping) for r in found}


def test_exactly_one_replica_wins_a_tick(replicas):
    a, b = replicas("a"), replicas("b")
    t = tick()
    first, second = claim(a, t), claim(b, t)
    assert first.outcome is Outcome.RUN and first.run_id is not None
    assert second.outcome is Outcome.LOST
    # The winner finishes in a millisecond and releases the lock; a replica whose
    # trigger fires late still cannot run the tick again.
    finish(a, first)
    assert claim(b, t).outcome is Outcome.LOST
    assert rows(a)[t]["status"] == "succeeded"


def test_a_tick_that_finds_the_previous_run_going_is_skipped_once_for_the_fleet(replicas):
    a, b = replicas("a"), replicas("b")
    t0 = tick(10)
    running = claim(a, t0)
    assert running.outcome is Outcome.RUN

    skipped = claim(b, t0 + timedelta(seconds=1))
    assert skipped.outcome is Outcome.SKIPPED
    assert (skipped.holder, skipped.consecutive_skips, skipped.alert) == ("a", 1, False)
    assert claim(a, t0 + timedelta(seconds=1)).outcome is Outcome.LOST  # recorded once

    # The replica running the job never asks its own session for the lock again
    # (advisory locks stack): it claims with intent `skip`.
    own = claim(a, t0 + timedelta(seconds=2), intent=Intent.SKIP)
    assert (own.outcome, own.holder, own.consecutive_skips) == (Outcome.SKIPPED, "a", 2)

    third = claim(b, t0 + timedelta(seconds=3))
    assert (third.consecutive_skips, third.alert) == (3, True)  # exactly one alert
    fourth = claim(b, t0 + timedelta(seconds=4))
    assert (fourth.consecutive_skips, fourth.alert) == (4, False)

    # The long run ends long after its next tick: it overran, nothing has recovered.
    overran = finish(a, running, next_due=t0 + timedelta(seconds=1))
    assert not overran.skips_recovered and not overran.notices
    resumed = claim(b, t0 + timedelta(seconds=5))
    assert resumed.outcome is Outcome.RUN
    assert resumed.consecutive_skips == 4  # the streak it ends
    kept_up = finish(b, resumed)  # ends before its next tick: the job keeps up again
    assert kept_up.skips_recovered and len(kept_up.notices) == 1  # one recovery notice
    again = claim(a, t0 + timedelta(seconds=6))
    assert again.outcome is Outcome.RUN
    assert not finish(a, again).skips_recovered
    statuses = [r["status"] for _, r in sorted(rows(a).items())]
    assert statuses == [
        "succeeded",
        "skipped",
        "skipped",
        "skipped",
        "skipped",
        "succeeded",
        "succeeded",
    ]


def test_a_dead_replicas_run_is_marked_crashed_and_its_late_finish_changes_nothing(replicas):
    a, b = replicas("a"), replicas("b")
    t0 = tick(5)
    stale = claim(a, t0)
    die(a)

    taken = claim(b, t0 + timedelta(seconds=1))
    assert taken.outcome is Outcome.RUN
    assert taken.crashed == 1
    assert rows(b)[t0]["status"] == "crashed"
    assert taken.run_id > stale.run_id  # the fencing token grows across the fleet

    a.connect()  # the stale replica comes back and reports its run finished
    late = finish(a, stale, status="succeeded", unlock=False)
    assert not late.recorded
    after = rows(b)
    assert after[t0]["status"] == "crashed"
    assert after[t0 + timedelta(seconds=1)]["status"] == "running"
    assert finish(b, taken).recorded


def test_a_tick_past_its_grace_is_recorded_missed_not_run(replicas):
    a, b = replicas("a"), replicas("b")
    old = tick(120)
    assert claim(a, old, grace=30).outcome is Outcome.MISSED
    assert claim(b, old, grace=30).outcome is Outcome.LOST
    assert rows(a)[old]["status"] == "missed"


def test_a_manual_run_needs_the_lock(replicas):
    a, b = replicas("a"), replicas("b")
    running = claim(a, tick(3))
    held = claim(b, tick(), intent=Intent.MANUAL)
    assert (held.outcome, held.holder) == (Outcome.HELD, "a")
    finish(a, running)
    manual = claim(b, tick(), intent=Intent.MANUAL)
    assert manual.outcome is Outcome.RUN
    assert rows(b)[manual.scheduled_at]["manual"]


def test_consecutive_failures_alert_once_and_recover(replicas):
    a = replicas("a")
    base = tick(20)
    outcomes = []
    for i in range(4):
        run = claim(a, base + timedelta(seconds=i))
        outcomes.append(finish(a, run, status="failed", error="boom"))
    assert [o.consecutive_failures for o in outcomes] == [1, 2, 3, 4]
    assert [o.alert for o in outcomes] == [False, False, True, False]
    ok = finish(a, claim(a, base + timedelta(seconds=5)))
    assert ok.recovered and ok.consecutive_failures == 4  # the streak it ends
    ok_again = finish(a, claim(a, base + timedelta(seconds=6)))
    assert not ok_again.recovered


def test_a_tracked_job_starts_with_no_streaks(replicas):
    """The daemon registers every job at start-up; its first runs report no recovery."""
    from scheduler.ledger import tables
    from scheduler.ledger.history import TickFilter, history
    from scheduler.ledger.job_states import track_jobs

    a = replicas("a")
    track_jobs(a.ledger_engine, [(KEY, "job", "every 1s")], datetime.now(UTC))
    with a.ledger_engine.begin() as conn:
        conn.execute(
            tables.ticks.insert().values(
                job_key=KEY, scheduled_at=tick(25), job_name="job", status="missed"
            )
        )
    run = claim(a, tick(1))
    assert run.outcome is Outcome.RUN and run.consecutive_skips == 0
    done = finish(a, run)
    assert not done.recovered and not done.skips_recovered and done.consecutive_failures == 0
    with a.ledger_engine.connect() as conn:
        rows = history(conn, TickFilter(KEY, limit=10))
    assert [r.manual for r in rows] == [False, False]


def test_run_ids_strictly_grow(replicas):
    a, b = replicas("a"), replicas("b")
    base = tick(10)
    ids = []
    for i in range(6):
        backend = (a, b)[i % 2]
        run = claim(backend, base + timedelta(seconds=i))
        ids.append(run.run_id)
        finish(backend, run)
    assert ids == sorted(ids) and len(set(ids)) == len(ids)


def test_one_batch_claims_many_jobs_in_one_call(replicas):
    a, b = replicas("a"), replicas("b")
    # A second old: past the 0.1 s in which a burst is shared out, so every tick
    # is anyone's (a tick of the current second could fall in b's share).
    t = tick(1)
    requests = [
        ClaimRequest(
            key=k, name=f"job{k}", scheduled_at=t, intent=Intent.RUN, grace_s=30, skip_threshold=3
        )
        for k in range(100, 150)
    ]
    won_a = a.claim(requests, "a", capacity=100).every()
    won_b = b.claim(requests, "b", capacity=100).every()
    assert [r.outcome for r in won_a] == [Outcome.RUN] * 50
    assert [r.outcome for r in won_b] == [Outcome.LOST] * 50


def test_replicas_starting_together_create_the_schema_once(database_url):
    """N replicas migrating at the same moment: one creates, the others find it done."""
    import threading

    backends = [
        PostgresBackend(database_url, instance=f"m{i}", namespace=NAMESPACE, holder_timeout=30)
        for i in range(6)
    ]
    barrier = threading.Barrier(len(backends))
    found, errors = [], []

    def start(backend):
        barrier.wait()
        try:
            found.append(backend.migrate())
        except Exception as exc:  # pragma: no cover - the assertion below shows it
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(b,)) for b in backends]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for backend in backends:
        backend.ledger_engine.dispose()
    assert not errors
    assert sorted(found) == [0] + [CURRENT_VERSION] * (len(backends) - 1)


def test_an_older_schema_gets_todays_functions(database_url):
    """A ledger made by an earlier release is migrated in place: rows kept, functions replaced."""
    import psycopg

    backend = PostgresBackend(database_url, instance="m", namespace=NAMESPACE, holder_timeout=30)
    backend.migrate()
    backend.connect()
    won = claim(backend, tick())
    backend.close()
    plain = database_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(plain, autocommit=True) as conn:
        # What a version-1 ledger looked like: its own claim function, version 1.
        conn.execute("DROP FUNCTION scheduler_claim")
        conn.execute("DELETE FROM scheduler_schema")
        conn.execute("INSERT INTO scheduler_schema (version, applied_at) VALUES (1, now())")
    assert backend.migrate() == 1
    assert backend.migrate() == CURRENT_VERSION
    backend.connect()
    assert won.outcome is Outcome.RUN
    # The old row is still there and still counts.
    assert claim(backend, won.scheduled_at).outcome is Outcome.LOST
    backend.close()


def test_a_replica_wins_no_more_runs_than_its_free_workers(replicas):
    a, b = replicas("a"), replicas("b")
    t = tick(1)  # old enough for any replica to take any share
    requests = [
        ClaimRequest(
            key=k, name=f"job{k}", scheduled_at=t, intent=Intent.RUN, grace_s=30, skip_threshold=3
        )
        for k in range(200, 210)
    ]
    first = a.claim(requests, "a", capacity=3).every()
    assert [r.outcome for r in first].count(Outcome.RUN) == 3
    assert [r.outcome for r in first].count(Outcome.DEFERRED) == 7
    # The deferred ticks were never claimed: another replica can take them at once.
    second = b.claim(requests, "b", capacity=100).every()
    assert [r.outcome for r in second].count(Outcome.RUN) == 7
    assert [r.outcome for r in second].count(Outcome.LOST) == 3
    won_by_a = {r.key for r in first if r.outcome is Outcome.RUN}
    assert won_by_a == {r.key for r in second if r.outcome is Outcome.LOST}


def two_sessions(database_url: str) -> tuple[PostgresBackend, PostgresBackend]:
    """Replicas `a` and `b` on PostgreSQL, connected (shares are PostgreSQL's alone)."""
    a, b = (
        PostgresBackend(database_url, instance=name, namespace=NAMESPACE, holder_timeout=30)
        for name in "ab"
    )
    a.migrate()
    a.connect()
    b.connect()
    return a, b


def test_replicas_claiming_a_burst_first_try_their_own_shares(database_url):
    """PostgreSQL only: in embedded mode one SQLite writer at a time has nothing to spread."""
    a, b = two_sessions(database_url)
    t = tick(-5)  # a burst just due (a clock ahead fires early): shares apply
    requests = [
        ClaimRequest(
            key=k, name=f"job{k}", scheduled_at=t, intent=Intent.RUN, grace_s=30, skip_threshold=3
        )
        for k in range(300, 340)
    ]
    first = {r.key: r.outcome for r in a.claim(requests, "a", capacity=100).every()}
    second = {r.key: r.outcome for r in b.claim(requests, "b", capacity=100).every()}
    mine_a = {k for k, o in first.items() if o is Outcome.RUN}
    mine_b = {k for k, o in second.items() if o is Outcome.RUN}
    assert mine_a and mine_b and not mine_a & mine_b
    assert mine_a | mine_b == set(range(300, 340))  # every tick claimed, each once
    # a left b's share to b (tried again once anyone may take it); b found a's taken.
    assert {o for k, o in first.items() if k not in mine_a} == {Outcome.YIELDED}
    assert {o for k, o in second.items() if k not in mine_b} == {Outcome.LOST}
    # The server answers every tick, and shares the next burst out the same way.
    later = [replace(r, scheduled_at=r.scheduled_at + timedelta(seconds=1)) for r in requests]
    answer = a.claim(later, "a", capacity=100)
    assert {r.key for r in answer.answered} == mine_a and not answer.lost + answer.deferred
    assert {t.key for t in answer.yielded} == mine_b
    a.close()
    b.close()


def test_the_replicas_share_rule_is_the_servers(database_url):
    """shares.share_of is scheduler_share's twin: a replica leaves out of its claims only
    the ticks that the server would have answered `yielded` (another replica's share)."""
    import psycopg

    from scheduler.backends.shares import share_of

    backend = PostgresBackend(database_url, instance="m", namespace=NAMESPACE, holder_timeout=30)
    backend.migrate()
    keys = [1, 2, 3, 77, 1000, 65_535, 1 << 20, 2_147_483_646, 2_147_483_647]
    keys += list(range(10_000, 10_200))
    plain = database_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(plain, autocommit=True) as conn:
        for live in (1, 2, 3, 7, 100):
            found = conn.execute(
                "SELECT array_agg(scheduler_share(k, %s) ORDER BY o)"
                " FROM unnest(%s::integer[]) WITH ORDINALITY AS u(k, o)",
                (live, keys),
            ).fetchone()
            assert found is not None
            assert found[0] == [share_of(k, live) for k in keys], live
    backend.ledger_engine.dispose()


def test_a_burst_is_sent_as_the_replicas_own_share_once_it_knows_the_fleet(database_url):
    """Other replicas' young ticks are answered `yielded` without being sent: a job of
    b's share that is paused would be recorded `paused` by any replica it was sent to."""
    from scheduler.backends.shares import share_of
    from scheduler.fleet import pauses

    a, b = two_sessions(database_url)
    keys = range(400, 440)

    def burst(at: datetime) -> list[ClaimRequest]:
        return [
            ClaimRequest(
                key=k, name=f"job{k}", scheduled_at=at, intent=Intent.RUN, grace_s=30,
                skip_threshold=3,
            )
            for k in keys
        ]  # fmt: skip

    first = a.claim(burst(tick(-5)), "a", capacity=100)  # a learns the fleet's shape
    mine_a = {r.key for r in first.answered}
    mine_b = {t.key for t in first.yielded}
    assert mine_a and mine_b and mine_a | mine_b == set(keys)
    shape = a._shape
    assert shape is not None and shape.live == 2
    assert mine_b == {k for k in keys if share_of(k, 2) != shape.rank}
    theirs = min(mine_b)
    with a.ledger_engine.begin() as conn:
        pauses.pause(conn, theirs, f"job{theirs}", by="ops", reason=None, now=datetime.now(UTC))
    later = tick(-6)
    answer = a.claim(burst(later), "a", capacity=100)
    assert {r.key for r in answer.answered} == mine_a  # b's paused job was not sent
    assert {t.key for t in answer.yielded} == mine_b
    with a.ledger_engine.connect() as conn:
        recorded = conn.execute(
            text("SELECT count(*) FROM scheduler_ticks WHERE scheduled_at = :t"), {"t": later}
        ).scalar()
    assert recorded == len(mine_a)
    # Its owner records it paused, once for the fleet; a's answers for the rest stand.
    by_b = {r.key: r.outcome for r in b.claim(burst(later), "b", capacity=100).every()}
    assert by_b[theirs] is Outcome.PAUSED
    assert {k for k, o in by_b.items() if o is Outcome.RUN} == mine_b - {theirs}
    # A new session may have another rank: it learns the fleet again before leaving out.
    a.connect()
    assert a._shape is None
    a.close()
    b.close()


def test_a_claim_helping_with_other_shares_sends_only_the_ticks_not_taken(database_url):
    """Other replicas' ticks offered to help are probed first: the ones their owners
    recorded are answered `lost` without going through a claim; the rest are claimed."""
    from scheduler.backends.shares import share_of

    a, b = two_sessions(database_url)
    t = tick(2)  # anyone's by now
    requests = [
        ClaimRequest(
            key=k, name=f"job{k}", scheduled_at=t, intent=Intent.RUN, grace_s=30, skip_threshold=3
        )
        for k in range(500, 620)
    ]
    b.claim(requests[:70], "b", capacity=100)  # b took the first 70
    a.claim(requests[:1], "a", capacity=1)  # a reads the fleet's shape beside a claim
    shape = a._shape
    assert shape is not None and shape.live == 2
    sent: list[list[int]] = []
    decide = a._decide
    a._decide = lambda batch, *args: sent.append([r.key for r in batch]) or decide(batch, *args)
    answer = a.claim(requests[1:], "a", capacity=100)
    by_key = {r.key: r.outcome for r in answer.every()}
    assert {k for k, o in by_key.items() if o is Outcome.LOST} == set(range(501, 570))
    assert {k for k, o in by_key.items() if o is Outcome.RUN} == set(range(570, 620))
    theirs_taken = {k for k in range(501, 570) if share_of(k, 2) != shape.rank}
    assert len(theirs_taken) > 20
    (batch,) = sent
    assert not theirs_taken & set(batch)  # found taken by the probe, never claimed
    assert set(batch) == set(range(501, 620)) - theirs_taken
    a.close()
    b.close()


def test_a_claim_helping_probes_only_while_most_of_its_offer_is_found_taken(database_url):
    """Early in a large burst the other shares' ticks are mostly free: the probe would be a
    round trip for nothing, so it waits until a claim that helps finds half taken again."""
    from scheduler.backends.shares import share_of

    a, b = two_sessions(database_url)
    a.claim([burst_of(range(1, 2), tick(30))[0]], "a", capacity=1)  # a reads the fleet
    shape = a._shape
    assert shape is not None
    theirs = [k for k in range(1000, 1400) if share_of(k, 2) != shape.rank][:120]
    probes: list[int] = []
    probe = a._taken_first
    a._taken_first = lambda requests, helping: (
        probes.append(len(helping)) or probe(requests, helping)
    )

    def helps(at: datetime) -> dict[int, Outcome]:
        return {r.key: r.outcome for r in a.claim(burst_of(theirs, at), "a", 5).every()}

    first = helps(tick(3))  # none taken: probed once, and not next time
    assert probes == [120] and list(first.values()).count(Outcome.RUN) == 5
    helps(tick(4))
    assert probes == [120]
    taken = tick(5)  # one instant: `tick` reads the clock, which may pass a second
    b.claim(burst_of(theirs, taken), "b", capacity=200)
    assert set(helps(taken).values()) == {Outcome.LOST}  # found taken by the claim
    helps(taken)
    assert probes == [120, 120]  # so the next claim that helps probes first
    a.close()
    b.close()


def burst_of(keys, at: datetime) -> list[ClaimRequest]:
    return [
        ClaimRequest(
            key=k, name=f"job{k}", scheduled_at=at, intent=Intent.RUN, grace_s=30, skip_threshold=3
        )
        for k in keys
    ]


def test_errors_are_stored_exactly(replicas):
    a = replicas("a")
    error = 'ValueError: bad {"x": [1, 2]}, path C:\\temp\\x\nsecond line «ünïcode» NULL'
    run = claim(a, tick(2))
    finish(a, run, status="failed", error=error)
    assert rows(a)[run.scheduled_at]["error"] == error


def test_one_alert_per_streak_at_the_threshold_in_force(replicas):
    """Thresholds change while a streak goes on (a deploy, replicas that differ)."""
    a, b = replicas("a"), replicas("b")
    t0 = tick(15)
    assert claim(a, t0).outcome is Outcome.RUN
    # Lowered from 5 to 3 while the streak stands at 4: it alerts at once.
    assert not any(claim(b, t0 + timedelta(seconds=i), threshold=5).alert for i in range(1, 5))
    lowered = claim(b, t0 + timedelta(seconds=5), threshold=3)
    assert (lowered.consecutive_skips, lowered.alert) == (5, True)
    assert not claim(b, t0 + timedelta(seconds=6), threshold=3).alert

    other = KEY + 1
    assert claim(a, t0, key=other).outcome is Outcome.RUN
    alerts = [claim(b, t0 + timedelta(seconds=i), threshold=3, key=other).alert for i in (1, 2, 3)]
    assert alerts == [False, False, True]
    # Raised from 3 to 5 after the alert: the same streak never alerts again.
    raised = [claim(b, t0 + timedelta(seconds=i), threshold=5, key=other).alert for i in (4, 5, 6)]
    assert raised == [False, False, False]


def test_failure_alerts_follow_the_threshold_in_force(replicas):
    a = replicas("a")
    base = tick(20)
    failed = [
        finish(a, claim(a, base + timedelta(seconds=i)), status="failed", threshold=5)
        for i in range(4)
    ]
    assert not any(f.alert for f in failed)
    lowered = finish(a, claim(a, base + timedelta(seconds=4)), status="failed", threshold=3)
    assert (lowered.consecutive_failures, lowered.alert) == (5, True)
    again = finish(a, claim(a, base + timedelta(seconds=5)), status="failed", threshold=6)
    assert not again.alert


def test_a_tick_skipped_behind_a_run_asked_for_by_hand_counts_in_no_streak(replicas):
    """Recorded skipped (the job was running), but the job did not overrun its schedule."""
    a, b = replicas("a"), replicas("b")
    manual = claim(a, tick(), intent=Intent.MANUAL)
    assert manual.outcome is Outcome.RUN
    skipped = [claim(b, tick(-n), threshold=2) for n in (1, 2, 3)]
    assert [s.outcome for s in skipped] == [Outcome.SKIPPED] * 3
    assert [s.holder for s in skipped] == ["a"] * 3
    assert not any(s.alert for s in skipped)
    with a.ledger_engine.connect() as conn:
        from scheduler.ledger.job_states import job_states

        assert int(job_states(conn).get(KEY, {}).get("consecutive_skips") or 0) == 0
