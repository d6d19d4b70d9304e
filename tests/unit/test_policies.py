"""Retries and catch-up: the delays, the plan, the config errors, and the gate's flow over
the embedded backend (docs/run-policies.md)."""

from __future__ import annotations

import itertools
import json
import threading
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from scheduler.config.settings import JobConfig
from scheduler.fleet.catch_up import fleet_up, plan
from scheduler.gate import Gate
from scheduler.ledger import tables
from scheduler.ledger.registrations import Registration
from scheduler.observers import events
from scheduler.registry.catalog import CatalogJob, schedule_text
from scheduler.registry.jobs import JobSpec
from scheduler.statuses import Status
from tests.support import FakeMonotonic, JobsDesk, Recorder, make_job, now_tick, settle, wait_for


def job(**schedule: Any) -> CatalogJob:
    spec = JobSpec(key=5, name="j5", func=lambda: None, takes_context=False,
                   is_async=False, source="t")  # fmt: skip
    retries = schedule.pop("retries", 0)
    return CatalogJob(spec=spec, schedule=JobConfig(**schedule), timezone="UTC",
                      skip_threshold=3, fail_threshold=3, misfire_grace=timedelta(seconds=30),
                      retries=retries, retry_delay=timedelta(seconds=10),
                      retry_delay_max=timedelta(seconds=60))  # fmt: skip


def test_retry_delays_double_up_to_the_most_and_stop_after_the_last_retry():
    j = job(interval="1h", retries=5)
    delays = [j.retry_in(n) for n in range(1, 7)]
    assert [d.total_seconds() if d else None for d in delays] == [10, 20, 40, 60, 60, None]


def test_settings_give_every_job_its_retry_policy_and_a_job_overrides_it(run, tmp_path):
    from scheduler.config.settings import load_config

    (tmp_path / "config.yaml").write_text(
        "scheduler:\n  retries: 2\n  retry_delay: 5\n  retry_delay_max: 30\n"
        "jobs:\n  a:\n    interval: 1h\n  b:\n    interval: 1h\n    retries: 0\n"
        "  c:\n    interval: 1h\n    retry_delay: 1m\n"
    )
    config = load_config(str(tmp_path / "config.yaml"))
    policy = {name: config.settings.retry_policy(j) for name, j in config.jobs.items()}
    assert policy["a"] == (2, timedelta(seconds=5), timedelta(seconds=30))
    assert policy["b"][0] == 0
    assert policy["c"] == (2, timedelta(minutes=1), timedelta(minutes=1))  # at least the delay


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("retries", "-1"),
        ("retries", "101"),
        ("retries", "many"),
        ("retry_delay", "0s"),
        ("retry_delay", "2d"),
        ("retry_delay_max", "soon"),
        ("catch_up", "sometimes"),
        ("catch_up_window", "8d"),
    ],
)
def test_a_bad_policy_field_is_one_line_naming_it(run, tmp_path, field, value):
    extra = "    catch_up: all\n" if field.startswith("catch_up_") else ""
    (tmp_path / "config.yaml").write_text(
        f"jobs:\n  sync:\n    interval: 1h\n{extra}    {field}: {value}\n"
    )
    code, _, err = run("check")
    assert code == 2 and f"jobs.sync.{field}" in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("lines", "says"),
    [
        ("    retry_delay: 5m\n    retry_delay_max: 1m\n", "retry_delay_max"),
        ("    catch_up_limit: 5\n", "catch_up: all"),
        ("    catch_up: latest\n    catch_up_window: 1h\n", "catch_up: all"),
        ("    catch_up: all\n    catch_up_limit: 0\n", "catch_up_limit"),
    ],
)
def test_policy_fields_that_contradict_are_one_line(run, tmp_path, lines, says):
    (tmp_path / "config.yaml").write_text(f"jobs:\n  sync:\n    interval: 1h\n{lines}")
    code, _, err = run("check")
    assert code == 2 and "jobs.sync" in err and says in err and err.count("\n") == 1, err


def in_force(j: CatalogJob, since: datetime, instance: str = "r1") -> list[Registration]:
    """The job's own schedule, registered by one replica at `since`."""
    return [Registration(instance, j.key, j.name, schedule_text(j), since, None)]


def test_catch_up_plans_the_newest_missing_ticks_oldest_first_and_misses_the_rest():
    j = job(interval="2s", catch_up="all", catch_up_window="1m", catch_up_limit=3)
    now = datetime(2026, 11, 30, 12, 0, 0, 500000, tzinfo=UTC)
    grid = [now.replace(microsecond=0) - timedelta(seconds=2 * n) for n in range(30)]
    have = set(grid[8:])  # the ledger has every tick up to 16 s ago
    to_run, missed = plan(j, in_force(j, now - timedelta(hours=1)), now, now, have)
    assert to_run == sorted(grid[:3])
    assert missed == sorted(grid[3:8])


def test_catch_up_looks_at_every_missing_tick_of_the_window_not_the_newest_few():
    """The fleet ran two ticks, then was down: every later tick of the window is judged,
    so no pass leaves an older missing tick for a later pass to run out of order."""
    j = job(interval="2s", catch_up="all", catch_up_window="1m", catch_up_limit=3)
    minute = datetime(2026, 12, 2, 0, 45, tzinfo=UTC)
    at = [minute + timedelta(seconds=s) for s in range(60)]
    now = at[29] + timedelta(microseconds=70000)
    to_run, missed = plan(j, in_force(j, at[11]), now, now, {at[12], at[14]})
    assert to_run == [at[24], at[26], at[28]]
    assert missed == [at[16], at[18], at[20], at[22]]


def test_catch_up_looks_no_further_back_than_the_window_or_the_schedule_in_force():
    j = job(interval="2s", catch_up="all", catch_up_window="10s", catch_up_limit=10)
    now = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)
    to_run, missed = plan(j, in_force(j, now - timedelta(hours=1)), now, now, set())
    assert to_run[0] > now - timedelta(seconds=10) and len(to_run) == 5 and not missed
    to_run, _ = plan(j, in_force(j, now - timedelta(seconds=3)), now, now, set())
    assert to_run == [now - timedelta(seconds=2), now]


def test_catch_up_leaves_the_ticks_after_the_fleet_came_up_to_the_replicas_that_fire_them():
    j = job(interval="2s", catch_up="all", catch_up_window="1m", catch_up_limit=3)
    now = datetime(2026, 11, 30, 12, 0, 0, 500000, tzinfo=UTC)
    up = now - timedelta(seconds=5)
    to_run, _ = plan(j, in_force(j, now - timedelta(hours=1)), now, up, set())
    assert to_run == [now - timedelta(seconds=s, microseconds=500000) for s in (10, 8, 6)]
    registered = in_force(j, now - timedelta(hours=1))
    live = [{"name": "r1", "since": up}, {"name": "runs-others", "since": up - timedelta(1)}]
    assert fleet_up(now, live, registered, {"r1", "runs-others"}) == up
    # A replica whose rows another took over while it started: taken to fire the job.
    live.append({"name": "r2", "since": up - timedelta(seconds=1)})
    assert fleet_up(now, live, registered, {"r1", "runs-others"}) == up - timedelta(seconds=1)
    assert fleet_up(now, [], registered, {"r1"}) == now


def test_the_gate_retries_a_failed_tick_with_the_attempt_in_its_context(tmp_path):
    from scheduler.backends.embedded import EmbeddedBackend

    seen_attempts: list[int] = []
    wall = [datetime.now(UTC)]  # the ledger's and the gate's clock, moved by the test
    started: list[datetime] = []

    def flaky(ctx):
        seen_attempts.append(ctx.attempt)
        started.append(wall[0])
        if ctx.attempt < 3:
            raise RuntimeError(f"attempt {ctx.attempt}")

    policy = {"retries": 2, "retry_delay": timedelta(seconds=1)}
    work = replace(make_job(31, flaky), **policy)
    seen, clock = Recorder(), FakeMonotonic()
    backend = EmbeddedBackend(tmp_path / "s.db", instance="u1", namespace=77,
                              clock=lambda: wall[0], monotonic=clock)  # fmt: skip
    backend.migrate()
    gate = Gate(backend, instance="u1", max_workers=2, holder_timeout=30, listeners=[seen],
                clock=lambda: wall[0], monotonic=clock, desk=JobsDesk(work))  # fmt: skip
    try:
        gate.submit(work, now_tick(-1))

        def stepped_to(n: int) -> bool:
            if not gate.running_jobs():  # time passes between runs: the retry delays
                clock.now += 0.5
                wall[0] += timedelta(seconds=0.5)
            gate.step()
            return len(seen.of(events.RunFinished)) >= n

        for n in (1, 2, 3):
            wait_for(lambda n=n: stepped_to(n), 20, f"attempt {n} to finish", every=0.01)
        finished = seen.of(events.RunFinished)
        assert [f.status for f in finished] == [Status.FAILED, Status.FAILED, Status.SUCCEEDED]
        assert [f.attempt for f in finished] == [1, 2, 3]
        assert [f.retry_in_s for f in finished] == [1.0, 2.0, None]
        waited = [(b - a).total_seconds() for a, b in itertools.pairwise(started)]
        assert waited[0] >= 1.0 and waited[1] >= 2.0  # each retry after its delay, not before
        assert seen_attempts == [1, 2, 3]
        assert [s.attempt for s in seen.of(events.RunStarted)] == [1, 2, 3]
        assert len({s.run_id for s in seen.of(events.RunStarted)}) == 3
    finally:
        backend.close()


def test_a_manual_run_is_not_retried(gate_over_file):
    gate, seen, _, _ = gate_over_file()

    def failing(ctx):
        raise RuntimeError("no")

    work = replace(make_job(32, failing), retries=3)
    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.append(gate.trigger(work, timeout=10)))
    worker.start()
    settle(gate, lambda: result, "the manual run")
    worker.join()
    assert result[0].status is Status.FAILED
    assert [f.status for f in seen.of(events.RunFinished)] == [Status.FAILED]


def test_retries_and_caught_up_runs_are_counted_and_kept_out_of_lateness():
    from scheduler.observers.metrics import Metrics

    metrics = Metrics(["j"])
    at = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    base = dict(job="j", key=5, scheduled_at=at, run_id=1, instance="u1", lateness_s=300.0,
                manual=False, crashed=0, skips_ended=0, ping_url=None)  # fmt: skip
    metrics.run_started(events.RunStarted(**base, attempt=2))
    metrics.run_started(events.RunStarted(**base, caught_up=True))
    metrics.run_started(events.RunStarted(**{**base, "lateness_s": 0.01}))
    text = metrics.render().decode()
    assert 'scheduler_job_retries_total{job="j"} 1.0' in text
    assert 'scheduler_job_caught_up_total{job="j"} 1.0' in text
    assert 'scheduler_job_lateness_seconds_count{job="j"} 1.0' in text


def test_history_shows_a_retried_ticks_attempts_under_it(run, tmp_path):
    from scheduler.backends.base import ClaimRequest, FinishRequest, Intent
    from scheduler.backends.embedded import EmbeddedBackend
    from scheduler.statuses import CRASHED_LOST_LOCK

    backend = EmbeddedBackend(tmp_path / "scheduler.db", instance="r1", namespace=1396918340)
    backend.migrate()
    backend.connect()
    try:
        at = now_tick(-5)
        request = ClaimRequest(2001, "sync", at, Intent.RUN, grace_s=60, skip_threshold=3)
        (first,) = backend.claim([request], "r1", capacity=1).every()

        def fail(result, retry_in):
            backend.finish([FinishRequest(2001, at, result.run_id, Status.FAILED, "boom 1",
                                          True, 3, retry_in_s=retry_in)])  # fmt: skip

        fail(first, 0.0)
        code, out, _ = run("history", "sync")
        assert code == 0 and "next attempt" in out
        (second,) = backend.claim_retries("r1", [2001], 1, CRASHED_LOST_LOCK).started
        backend.finish([FinishRequest(2001, at, second.run_id, Status.SUCCEEDED, None, True, 3)])
    finally:
        backend.close()
    code, out, _ = run("history", "sync")
    header, *lines = out.splitlines()
    assert code == 0 and "ATTEMPT" in header
    assert len(lines) == 2 and "succeeded" in lines[0] and "failed" in lines[1]
    assert lines[0].split()[3] == "2" and lines[1].split()[3] == "1"
    assert "boom 1" in lines[1] and "next attempt" not in out
    code, out, _ = run("history", "sync", "--json")
    (row,) = json.loads(out)
    assert row["attempt"] == 2 and [a["attempt"] for a in row["attempts"]] == [1]


def test_a_retry_due_while_the_jobs_next_tick_runs_is_taken_when_that_run_ends(tmp_path):
    """A look for retries leaves out the jobs running here; once the run ends, the retry
    that fell due meanwhile is taken at once, not at the next heartbeat."""
    from sqlalchemy import update

    from scheduler.backends.embedded import EmbeddedBackend

    release = threading.Event()
    attempts: list[tuple[datetime, int]] = []

    def flaky(ctx):
        attempts.append((ctx.scheduled_at, ctx.attempt))
        if len(attempts) == 1:
            raise RuntimeError("the first attempt fails")
        if len(attempts) == 2:
            release.wait(10)  # the next tick's run, going on while the retry falls due

    work = replace(make_job(33, flaky), retries=1, retry_delay=timedelta(seconds=60))
    other = make_job(34, lambda: None, name="other")
    backend = EmbeddedBackend(tmp_path / "s.db", instance="u1", namespace=77)
    backend.migrate()
    seen, clock = Recorder(), FakeMonotonic()
    gate = Gate(backend, instance="u1", max_workers=2, holder_timeout=30, listeners=[seen],
                monotonic=clock, desk=JobsDesk(work, other))  # fmt: skip
    try:
        first = now_tick(-2)
        gate.submit(work, first)
        wait_for(lambda: gate.step() or seen.of(events.RunFinished), 10, "the first attempt")
        gate.submit(work, now_tick(-1))
        wait_for(lambda: gate.step() or len(attempts) == 2, 10, "the next tick's run")
        with backend.ledger_engine.begin() as conn:  # the retry falls due meanwhile
            conn.execute(
                update(tables.ticks)
                .where(tables.ticks.c.job_key == 33, tables.ticks.c.scheduled_at == first)
                .values(retry_at=datetime.now(UTC) - timedelta(seconds=1))
            )
        gate.retries.due_in(0)
        gate.step()  # the look leaves the running job out
        release.set()
        wait_for(lambda: gate.step() or len(attempts) == 3, 10, "the retry")
        assert attempts[2] == (first, 2)
    finally:
        release.set()
        backend.close()
