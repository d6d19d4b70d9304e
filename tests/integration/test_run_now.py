"""Run-now requests on both backends: the fleet hears of one, exactly one replica takes it,
and what became of it is read from the ledger by whoever looks."""

from __future__ import annotations

import select
from datetime import UTC, datetime, timedelta

from sqlalchemy.exc import OperationalError

from scheduler.backends.base import ClaimRequest, FinishRequest, Intent
from scheduler.config.settings import Settings
from scheduler.fleet import run_now
from scheduler.fleet.housekeeping import Housekeeping
from scheduler.ledger.orphans import mark_crashed
from scheduler.ledger.run_now import RunRequest, settle_ended_requests, settle_request
from scheduler.registry.catalog import Catalog
from scheduler.statuses import CRASHED_FOUND_BY_SWEEP
from tests.integration.test_gate_protocol import die
from tests.support import FakeMonotonic, make_job, wait_for

KEY = 91


def ask(backend, key: int = KEY) -> int:
    with backend.ledger_engine.begin() as conn:
        return run_now.ask(conn, key, "job", by="ops", now=datetime.now(UTC), namespace=4242)


def hears(backend) -> bool:
    """What the dispatcher does: a readable lock-session socket is read, then asked."""
    fd = backend.fileno()
    if fd is not None and select.select([fd], [], [], 0)[0]:
        backend.check_alive()
    return backend.requests_pending()


def test_a_request_is_heard_and_taken_by_exactly_one_replica(backends):
    a, b = backends("a"), backends("b")
    a.take_requests("a", [KEY])  # what a fresh session looks for: nothing yet
    b.take_requests("b", [KEY])
    request = ask(a)
    wait_for(lambda: hears(a) and hears(b), 10, "both replicas to hear of the request")
    first, second = a.take_requests("a", [KEY]), b.take_requests("b", [KEY])
    assert [r.id for r in first] == [request] and second == []
    with a.ledger_engine.begin() as conn:
        assert run_now.state(conn, request)["taken_by"] == "a"
        assert not run_now.withdraw(conn, request)  # taken: the command cannot withdraw it


def test_a_request_for_a_job_a_replica_does_not_run_is_left_to_others(backends):
    a = backends("a")
    request = ask(a, key=4444)
    assert a.take_requests("a", [KEY]) == []
    with a.ledger_engine.begin() as conn:
        assert run_now.withdraw(conn, request)  # nobody took it: the command withdraws it
        assert run_now.state(conn, request) is None


def test_the_heartbeat_finds_a_request_a_notification_missed(backends):
    a = backends("a")
    a.take_requests("a", [KEY])
    with a.ledger_engine.begin() as conn:  # no NOTIFY: as if the session was away
        run_now.ask(conn, KEY, "job", by="ops", now=datetime.now(UTC), namespace=None)
    a.heartbeat()
    wait_for(a.requests_pending, 5, "the heartbeat to see the request")
    assert len(a.take_requests("a", [KEY])) == 1


# -- what became of a request: read from the ledger, by whoever looks ------------------


def manual(backend, key: int = KEY):
    """What the taker's gate does with a request: a manual tick of its own, lock first."""
    now = datetime.now(UTC)
    at = now.replace(microsecond=now.microsecond // 1000 * 1000)
    request = ClaimRequest(key, "job", at, Intent.MANUAL, grace_s=30.0, skip_threshold=3)
    (result,) = backend.claim([request], backend.instance, capacity=1).every()
    return result


def finish(backend, run, status: str = "succeeded", error: str | None = None) -> None:
    done = FinishRequest(run.key, run.scheduled_at, run.run_id, status, error, True, 3)
    (result,) = backend.finish([done])
    assert result.recorded


def taken(backend, key: int = KEY) -> int:
    request = ask(backend, key)
    (took,) = backend.take_requests(backend.instance, [key])
    assert took.id == request
    return request


def look(backend, request: int, *, later: float = 0.0, record: bool = True) -> run_now.Answer:
    with backend.ledger_engine.begin() as conn:
        now = backend.now(conn) + timedelta(seconds=later)
        return run_now.look(conn, request, now=now, holder_timeout=30, record=record)


def test_a_request_whose_run_ended_is_settled_from_the_run_row_by_whoever_looks(backends):
    """The replica ran it but never wrote the outcome (it died, or its write failed)."""
    a = backends("a")
    request = taken(a)
    run = manual(a)
    assert look(a, request).phase is run_now.Phase.RUNNING
    finish(a, run, "failed", "ValueError: no")
    shown = look(a, request, record=False)  # a reader that writes nothing says the same
    assert (shown.phase, shown.run_id, shown.status) == ("settled", run.run_id, "failed")
    with a.ledger_engine.connect() as conn:
        assert run_now.state(conn, request)["finished_at"] is None
    answer = look(a, request)
    assert (answer.phase, answer.outcome, answer.status) == ("settled", "run", "failed")
    assert answer.line() == f"job: run {run.run_id} failed on a: ValueError: no"
    with a.ledger_engine.connect() as conn:
        row = run_now.state(conn, request)
    assert (row["outcome"], row["status"], row["run_id"]) == ("run", "failed", run.run_id)


def test_a_run_marked_crashed_settles_its_request_in_housekeeping(backends):
    """The taker died mid-run and came back under its name: its request learns nothing
    from the replica, and the sweep's crashed row says what happened."""
    a = backends("a")
    request = taken(a)
    run = manual(a)
    with a.ledger_engine.begin() as conn:
        now = a.now(conn)
        assert mark_crashed(conn, KEY, run.run_id, CRASHED_FOUND_BY_SWEEP, now)
        assert settle_ended_requests(conn, now) == 1
        assert settle_ended_requests(conn, now) == 0  # once
    answer = look(a, request)
    assert (answer.phase, answer.status, answer.run_id) == ("settled", "crashed", run.run_id)


def test_a_taken_request_with_no_run_is_unknown_after_the_patience_and_never_settled(backends):
    a = backends("a")
    request = taken(a)
    assert look(a, request).phase is run_now.Phase.TAKEN
    answer = look(a, request, later=run_now.patience(30) + 1)
    assert answer.phase is run_now.Phase.UNKNOWN and answer.final
    assert "a took the request at " in answer.line() and "outcome unknown" in answer.line()
    with a.ledger_engine.connect() as conn:
        assert run_now.state(conn, request)["finished_at"] is None


def test_an_untaken_request_is_withdrawn_after_the_patience(backends):
    a = backends("a")
    request = ask(a)
    assert look(a, request).phase is run_now.Phase.WAITING
    assert look(a, request, later=36, record=False).phase is run_now.Phase.WITHDRAWN
    assert look(a, request).phase is run_now.Phase.WAITING  # a reader withdrew nothing
    assert look(a, request, later=36).phase is run_now.Phase.WITHDRAWN
    assert look(a, request).phase is run_now.Phase.GONE


def test_a_run_is_the_request_s_only_when_no_other_request_may_have_become_it(backends):
    """Two requests taken at once: the first runs, the second meets the running job and
    its replica's word of it is lost."""
    a = backends("a")
    first, second = ask(a), ask(a)
    assert [r.id for r in a.take_requests("a", [KEY])] == [first, second]  # in that order
    run = manual(a)
    assert (look(a, first).phase, look(a, first).run_id) == ("running", run.run_id)
    assert look(a, second).phase is run_now.Phase.RUNNING  # it may be its run: it waits
    finish(a, run)
    assert look(a, second, record=False).phase is run_now.Phase.TAKEN  # not sure whose
    assert (look(a, first).phase, look(a, first).status) == ("settled", "succeeded")
    assert look(a, second).phase is run_now.Phase.TAKEN  # the first request's run
    assert look(a, second, later=36).phase is run_now.Phase.UNKNOWN
    later = taken(a)  # taken after the run: it is not its run either
    assert look(a, later).phase is run_now.Phase.TAKEN


def test_another_replica_s_run_is_never_the_request_s(backends):
    a, b = backends("a"), backends("b")
    request = taken(a)
    finish(b, manual(b))
    assert look(a, request).phase is run_now.Phase.TAKEN


def test_a_run_a_later_request_became_is_not_an_earlier_one_s(backends):
    """A request that met the job's lock held, whose outcome was lost, is not the next
    run's: that run is the request its replica settled with it."""
    a = backends("a")
    lost = taken(a)
    request = taken(a)
    run = manual(a)
    with a.ledger_engine.begin() as conn:
        settle_request(
            conn,
            request,
            outcome="run",
            status=None,
            run_id=run.run_id,
            error=None,
            now=a.now(conn),
        )
    assert look(a, lost).phase is run_now.Phase.TAKEN


def test_a_request_that_meets_its_job_running_says_where_and_since_when(backends):
    a = backends("a")
    first, second = taken(a), taken(a)
    run = manual(a)
    desk = run_now.Desk(a.ledger_engine, lambda: None, lambda: datetime.now(UTC))
    desk.settle(RunRequest(second, KEY, "job", "ops"), "held", None, None, "held by a")
    answer = look(a, second)
    since = run.started_at.isoformat(timespec="milliseconds")
    assert answer.line() == f"job: not run: already running on a (run {run.run_id}, since {since})"
    assert look(a, first).phase is run_now.Phase.RUNNING


def test_the_wait_ends_when_a_run_stays_running_with_nobody_holding_its_lock(backends):
    """No replica is left to record the run crashed: the command says it does not know."""
    a, reader = backends("a"), backends("reader", connect=False)
    request = taken(a)
    run = manual(a)
    die(a)
    clock = FakeMonotonic()
    looks = []

    def sleep(seconds: float) -> None:
        looks.append(clock.now)
        clock.now += seconds

    answer = run_now.wait(
        reader, request, job="job", holder_timeout=30, monotonic=clock, sleep=sleep
    )
    assert (answer.phase, answer.run_id) == (run_now.Phase.UNKNOWN, run.run_id)
    assert "nobody holds the job's lock" in answer.line()
    waited = clock.now - 1000.0
    assert run_now.orphan_patience(30) < waited <= run_now.orphan_patience(30) + 1


def test_the_wait_ends_when_the_ledger_does_not_answer():
    class Unreachable:  # a ledger whose every connection fails, as with the network cut
        class ledger_engine:
            @staticmethod
            def begin():
                raise OperationalError("SELECT 1", {}, OSError("connection refused"))

    clock = FakeMonotonic()

    def sleep(seconds: float) -> None:
        clock.now += seconds

    answer = run_now.wait(
        Unreachable(), 7, job="job", holder_timeout=30, monotonic=clock, sleep=sleep
    )
    assert answer.phase is run_now.Phase.UNKNOWN
    assert answer.line().startswith("job: outcome unknown: the ledger: ")
    assert "connection refused" in answer.line()
    assert run_now.patience(30) < clock.now - 1000.0 <= run_now.patience(30) + 1


def test_housekeeping_records_the_crash_and_settles_the_request_in_one_pass(backends):
    """The taker died mid-run and no command is waiting: the sweep of another replica."""
    a, b = backends("a"), backends("b", connect=False)
    request = taken(a)
    run = manual(a)
    die(a)
    keeper = Housekeeping(
        b, Catalog((make_job(KEY, lambda ctx: None, name="job"),)), Settings(instance_name="b")
    )
    done = keeper.run_once()
    assert (done["crashed"], done["requests"]) == (1, 1)
    with b.ledger_engine.connect() as conn:
        row = run_now.state(conn, request)
    assert (row["outcome"], row["status"], row["run_id"]) == ("run", "crashed", run.run_id)
    assert row["error"] == CRASHED_FOUND_BY_SWEEP
