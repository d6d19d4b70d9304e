"""A PostgreSQL primary fails over to its standby under a running fleet (docs/faults.md: Failover).

Each test builds its own primary and standby (tests/fleet/replication.py), starts
three replicas with a multi-host URL, jobs every second and a long run, kills
the primary (`pg_ctl stop -m immediate`) right after a claim, and promotes the
standby. Every replica follows the primary without a restart and claims again
within seconds; the long run is told its lock is lost; the ledger on the new
primary explains every tick. With synchronous replication no tick runs twice;
with asynchronous replication, the WAL held back for the last seconds, the
ticks that ran twice are counted and reported (the window docs/faults.md tells).
"""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from scheduler.backends.postgres import PostgresBackend
from scheduler.config.settings import Settings
from scheduler.fleet.housekeeping import MISSED_MARGIN, Housekeeping
from scheduler.ledger.job_states import job_states
from scheduler.registry.catalog import Catalog
from tests import clusters
from tests.fleet.replication import Pair
from tests.support import Fleet, cli, free_port, make_job, parse_tick, wait_for, whole_seconds

# `-m "not failover"` leaves them out; without the server binaries they skip (CI: fail).
pytestmark = [pytest.mark.fleet, pytest.mark.failover]

SECOND = timedelta(seconds=1)
JOBS = ["failover.py"]  # every_second, each_second (1 ms), long_run (6 s)
# every_second: catch_up off (the ticks fired during the switch are claimed once a node
# takes writes, oldest first, within misfire_grace; the sweep records missed those no
# replica took); each_second: catch_up all (each of them runs).
SCHEDULES = {
    "every_second": {"interval": "1s"},
    "each_second": {"interval": "1s", "catch_up": "all"},
    "long_run": {"interval": "2s"},
}
REPLICAS = ("r1", "r2", "r3")
RESUME_WITHIN_S = 10
SWITCH_S = 2  # no node takes writes for this long: ticks fall due with no primary
# Asynchronous: the WAL of this many seconds before the failover is lost (0: none held).
HELD_S = float(os.environ.get("FAILOVER_HOLD_WAL_S", "2"))


@pytest.fixture
def pairs():
    """Builds a primary and its standby (`pairs(synchronous)`); both stopped in teardown."""
    made: list[Pair] = []

    def build(synchronous: bool) -> Pair:
        reason = clusters.available()
        if reason and os.environ.get("CI"):
            pytest.fail(f"CI needs the PostgreSQL server binaries: {reason}")
        if reason:
            pytest.skip(f"cannot build a primary and a standby here: {reason}")
        made.append(Pair(synchronous))
        return made[-1]

    yield build
    for pair in made:
        pair.remove()


@dataclass
class Failover:
    """What a fleet did across one failover: its evidence, and the new primary's ledger."""

    fleet: Fleet
    failed_at: float  # the primary was stopped
    held_at: float | None  # the WAL stopped reaching the standby (asynchronous test)
    promoted_at: float  # the standby answered as the primary
    resumed_at: float  # the first run claimed on the new primary started
    lag: tuple[int, float]  # the standby's replay lag just before: WAL bytes, seconds
    long_run: dict[str, Any]  # the start of the run that was going at the failover
    ledger: list[dict[str, Any]]

    def resumed_in(self) -> float:
        """Seconds from the primary's death to the first run claimed on the new primary."""
        return self.resumed_at - self.failed_at

    def lost(self, tick: datetime) -> bool:
        """Whether a claim of `tick` may have been lost with the WAL held back."""
        lost_from = self.held_at or self.failed_at
        return lost_from - 1 < tick.timestamp() < self.failed_at

    def runs(self, job: str) -> list[dict[str, Any]]:
        return _runs(self.fleet, job)

    def twice(self, job: str) -> dict[datetime, int]:
        counts = Counter(parse_tick(e["tick"]) for e in self.runs(job))
        return {tick: n for tick, n in counts.items() if n > 1}

    def window(self, job: str) -> list[datetime]:
        """The job's ticks from its first run to its last, shortly before the fleet stopped."""
        ticks = sorted(parse_tick(e["tick"]) for e in self.runs(job))
        return whole_seconds(ticks[0], ticks[-1])


def fail_over_under_a_fleet(tmp_path, pair: Pair, hold_wal_s: float = 0) -> Failover:
    """Three replicas, a failover, a few more seconds; every replica stops cleanly.

    `hold_wal_s`: for that long before the primary dies, its WAL does not reach
    the standby (asynchronous replication only: a synchronous primary would wait).
    """
    fleet = Fleet(tmp_path, pair.url(), SCHEDULES, job_files=JOBS)
    for name in REPLICAS:
        fleet.start(name)
    try:
        fleet.wait_ready()
        pids = {name: replica.pid for name, replica in fleet.replicas.items()}
        long_run = wait_for(lambda: _runs(fleet, "long_run"), 30, "the long run to start")[0]
        wait_for(lambda: len(_runs(fleet, "every_second")) >= 3, 30, "a few ticks")
        held_at = None
        if hold_wal_s:
            pair.hold_wal()
            held_at = time.time()
            time.sleep(hold_wal_s)
        lag = pair.replay_lag()
        # A long run that began moments ago, so it is still going when the primary dies
        # even if stopping the primary is slow on a loaded machine.
        long_run = _fresh_run(fleet, "long_run")
        # The primary dies right after a claim: the worst moment for the last commits.
        seen = len(_runs(fleet, "every_second"))
        wait_for(lambda: len(_runs(fleet, "every_second")) > seen, 10, "a fresh claim", 0.005)
        failed_at = time.time()
        pair.fail_over(detection_s=SWITCH_S)
        promoted_at = time.time()
        for replica in fleet.replicas.values():
            wait_for(
                lambda r=replica: r.log().count("lock session up") >= 2,
                30,
                f"{replica.name} to reconnect to the new primary\n{fleet.logs()}",
            )
        assert _sessions_on(pair.standby_url()) >= set(REPLICAS), fleet.logs()
        resumed = wait_for(
            lambda: [e for e in _runs(fleet, "every_second") if e["at"] > promoted_at],
            30,
            "claims on the new primary",
        )
        assert resumed[0]["at"] - failed_at <= RESUME_WITHIN_S, fleet.logs()
        told = wait_for(lambda: _end_of(fleet, long_run), 30, "the long run's late finish")
        assert told["lock_lost"], f"the long run was not told its lock is lost\n{fleet.logs()}"
        time.sleep(2)  # ticks claimed on the new primary, in the steady state
        # `catch_up: all` claims the ticks of the switch one at a time, each after the
        # run before it: on a loaded machine that outlasts the steady state above.
        until = datetime.fromtimestamp(resumed[0]["at"], UTC)
        wait_for(
            lambda: not _without_row(fleet, "each_second", until),
            90,
            f"catch-up to give each_second's ticks up to {until:%H:%M:%S} a row",
            0.5,
        )
        assert {n: r.pid for n, r in fleet.replicas.items()} == pids
        assert all(r.process.poll() is None for r in fleet.replicas.values()), fleet.logs()
        codes = fleet.stop()
    finally:
        fleet.kill_all()
    assert codes == dict.fromkeys(REPLICAS, 0), fleet.logs()
    failover = Failover(fleet, failed_at, held_at, promoted_at, resumed[0]["at"], lag, long_run, [])
    record_missed_ticks(failover, pair.url())
    failover.ledger = fleet.ledger()
    return failover


def _runs(fleet: Fleet, job: str) -> list[dict[str, Any]]:
    return [e for e in fleet.starts() if e["job"] == job]


def _fresh_run(fleet: Fleet, job: str, within_s: float = 1.0) -> dict[str, Any]:
    """A run of `job` that started less than `within_s` ago and has not ended.

    The 6 s job runs back to back, so one starts every six to eight seconds.
    """
    runs = wait_for(
        lambda: [
            s
            for s in _runs(fleet, job)
            if time.time() - s["at"] < within_s and _end_of(fleet, s) is None
        ],
        30,
        f"a {job} run that has just started",
        0.05,
    )
    return max(runs, key=lambda s: s["at"])


def _end_of(fleet: Fleet, start: dict[str, Any]) -> dict[str, Any] | None:
    """The end of that run: by job, tick, replica and run_id, as a run_id of the lost WAL
    may be handed out again on the new primary (asynchronous replication)."""
    same = ("job", "tick", "instance", "run_id")
    ends = [e for e in fleet.ends() if all(e[k] == start[k] for k in same)]
    return ends[0] if ends else None


def _without_row(fleet: Fleet, job: str, until: datetime) -> list[datetime]:
    """The ticks of `job` from its first row to `until` that have no row yet."""
    have = {r["scheduled_at"] for r in fleet.ledger(job)}
    return [t for t in whole_seconds(min(have), until) if t not in have] if have else [until]


def _sessions_on(url: str) -> set[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute("SELECT application_name FROM pg_stat_activity").fetchall()
    return {name for (name,) in rows}


def assert_ledger_explains_every_tick(
    failover: Failover, job: str, ran_twice_allowed: bool
) -> None:
    """Each tick of the window has its row on the new primary, and the row says what ran.

    With asynchronous replication (`ran_twice_allowed`) a run claimed in the WAL the
    standby never got is unknown to the new primary: a catch-up beyond its limit records
    the tick `missed` although it ran, and a claim that finds the job's lock held (by a
    run of another tick) records it `skipped` (docs/faults.md: Failover).
    """
    rows = {r["scheduled_at"]: r for r in failover.ledger if r["job_name"] == job}
    runs: dict[datetime, list[int]] = {}
    for e in failover.runs(job):
        runs.setdefault(parse_tick(e["tick"]), []).append(e["run_id"])
    logs = failover.fleet.logs()
    for tick in failover.window(job):
        row = rows.get(tick)
        assert row is not None, f"{tick}: no row on the new primary\n{logs}"
        ran = runs.get(tick, [])
        if row["status"] in ("missed", "skipped", "paused"):
            forgotten = (
                row["status"] in ("missed", "skipped") and ran_twice_allowed and failover.lost(tick)
            )
            assert not ran or forgotten, f"{tick}: recorded {row['status']} but ran {ran}\n{logs}"
        elif row["status"] == "succeeded":
            assert row["run_id"] in ran, f"{tick}: run {row['run_id']} recorded, ran {ran}"
            assert ran_twice_allowed or len(ran) == 1, f"{tick}: ran {ran}\n{logs}"
        else:  # a claim committed as the primary died: its replica never saw it, or was told
            assert row["status"] == "crashed", f"{tick}: {row['status']}\n{logs}"
            assert len(ran) <= (2 if ran_twice_allowed else 1), f"{tick}: ran {ran}\n{logs}"


def record_missed_ticks(failover: Failover, url: str) -> int:
    """The fleet's missed-tick sweep on the new primary, run now as it runs once the grace is over.

    The ticks a job fired while no node took writes are claimed once one does, oldest
    first (docs/faults.md: Faults); those no replica took are recorded `missed` by the
    sweep after `misfire_grace`. This sweep judges them with a grace of 1 s (the fleet's is 30 s,
    which the test does not wait for), once the ledger's clock is past it: no sweep
    records a tick missed before it is due by that clock.
    """
    window = failover.window("every_second")
    job = replace(make_job(61, lambda ctx: None, name="every_second"), misfire_grace=SECOND)
    backend = PostgresBackend(url, instance="sweep", namespace=1, holder_timeout=30)
    keeper = Housekeeping(backend, Catalog((job,)), Settings(instance_name="sweep"))
    beyond = job.misfire_grace + MISSED_MARGIN
    wait_for(lambda: datetime.now(UTC) > window[-1] + beyond + SECOND, 30, "the grace to pass")
    try:
        with backend.ledger_engine.begin() as conn:
            states = job_states(conn)
            return keeper.sweep_missed(conn, states, window[0] + beyond, window[-1] + beyond)
    finally:
        backend.ledger_engine.dispose()


def assert_only_the_switch_missed(failover: Failover, job: str) -> None:
    """Ticks recorded missed fell due while no node took writes, or before replicas were back."""
    missed = [
        r["scheduled_at"]
        for r in failover.ledger
        if r["job_name"] == job and r["status"] == "missed"
    ]
    outside = [
        t for t in missed if not failover.failed_at - 1 < t.timestamp() < failover.resumed_at
    ]
    assert not outside, f"ticks missed outside the failover: {outside}\n{failover.fleet.logs()}"


def run_ids_across(failover: Failover) -> tuple[int, int]:
    """The highest run_id handed out before the failover, and the lowest after it."""
    starts = failover.fleet.starts()
    before = max(e["run_id"] for e in starts if e["at"] < failover.failed_at)
    after = min(e["run_id"] for e in starts if e["at"] > failover.promoted_at)
    return before, after


def test_a_failover_with_synchronous_replication_runs_no_tick_twice(tmp_path, pairs):
    sync_pair = pairs(synchronous=True)
    assert_a_standby_is_refused(tmp_path, sync_pair)
    report = cli_check(tmp_path, sync_pair.url())
    assert report.returncode == 0, report.stdout + report.stderr
    assert line_of(report.stdout, "replication").split()[1:3] == ["ok", "synchronous"]

    failover = fail_over_under_a_fleet(tmp_path / "fleet", sync_pair)
    print(f"synchronous replication: claiming resumed {failover.resumed_in():.1f} s after")

    for job in ("every_second", "each_second"):
        assert not failover.twice(job), f"{job} ran twice: {failover.twice(job)}"
        assert_ledger_explains_every_tick(failover, job, ran_twice_allowed=False)
    assert_only_the_switch_missed(failover, "every_second")
    missed = [r for r in failover.ledger if r["status"] == "missed"]
    assert all(r["job_name"] == "every_second" for r in missed), f"caught up: {missed}"
    before, after = run_ids_across(failover)
    assert after > before, f"run_id went back across the failover: {before} then {after}"
    tick = parse_tick(failover.long_run["tick"])
    row = next(
        r for r in failover.ledger if r["job_name"] == "long_run" and r["scheduled_at"] == tick
    )
    # Crashed if a claim or the sweep found its lock free first; else its own late finish,
    # which says it was told. Either way the row is that run's (run_id), no later one's.
    assert row["run_id"] == failover.long_run["run_id"], row
    assert row["status"] == "crashed" or row["told"] == "lock_lost", row


def test_a_failover_with_asynchronous_replication_counts_the_ticks_run_twice(
    tmp_path, pairs, record_property
):
    async_pair = pairs(synchronous=False)
    report = cli_check(tmp_path, async_pair.url())
    assert report.returncode == 0, report.stdout + report.stderr
    assert line_of(report.stdout, "replication").split()[1:3] == ["warn", "asynchronous"]

    failover = fail_over_under_a_fleet(tmp_path / "fleet", async_pair, hold_wal_s=HELD_S)

    lost_from = failover.held_at or failover.failed_at  # claims after this may be lost
    counted = {}
    for job in ("every_second", "each_second"):
        twice = failover.twice(job)
        # Only a claim lost with the WAL the standby never got can run again.
        outside = [
            t for t in twice if not failover.held_at - 1 < t.timestamp() < failover.failed_at
        ]
        assert not outside, f"{job}: ticks claimed outside the lost WAL ran twice: {outside}"
        counted[job] = (len(twice), len(failover.window(job)))
        record_property(f"{job}_ticks_run_twice", len(twice))
    assert_ledger_explains_every_tick(failover, "each_second", ran_twice_allowed=True)
    # every_second (catch_up off) does not run a lost tick again: the new primary has no
    # record of that run, and the sweep records the tick missed.
    forgotten = forgotten_runs(failover, "every_second")
    assert all(lost_from - 1 < t.timestamp() < failover.failed_at for t in forgotten)
    record_property("every_second_runs_forgotten", len(forgotten))
    before, after = run_ids_across(failover)
    print(
        f"asynchronous replication, the WAL of the last {HELD_S:g} s held back "
        f"({failover.lag[0]} bytes behind): ticks run twice / in the window: {counted}; "
        f"every_second runs the new primary knows nothing of: {len(forgotten)}; "
        f"run_id {before} before the failover, {after} after it; "
        f"claiming resumed {failover.resumed_in():.1f} s after the primary died"
    )


def forgotten_runs(failover: Failover, job: str) -> list[datetime]:
    """Ticks that ran, though the new primary's ledger holds no row of that run."""
    recorded = {r["run_id"] for r in failover.ledger if r["job_name"] == job and r["run_id"]}
    return [parse_tick(e["tick"]) for e in failover.runs(job) if e["run_id"] not in recorded]


def cli_check(tmp_path, url: str):
    """`scheduler check` against `url`, in a folder of its own (no job runs there)."""
    fleet = Fleet(tmp_path / "check", url, {"every_second": {"interval": "1s"}}, job_files=JOBS)
    return cli(fleet, "check")


def line_of(report: str, check: str) -> str:
    lines = [line for line in report.splitlines() if line.split()[:1] == [check]]
    assert len(lines) == 1, report
    return lines[0]


def assert_a_standby_is_refused(tmp_path, pair: Pair) -> None:
    """A replica pointed at the standby alone claims nothing, is not ready, and check says why."""
    url = pair.standby_url()
    fleet = Fleet(tmp_path / "standby", url, {"every_second": {"interval": "1s"}}, job_files=JOBS)
    port = free_port()
    replica = fleet.start("on-standby", env={"SCHEDULER_HTTP_PORT": str(port)})
    try:
        wait_for(lambda: "standby" in replica.log() or "read-only" in replica.log(), 30, "refusal")
        assert _status(port, "/readyz") == 503
        assert _status(port, "/healthz") == 200
        report = cli(fleet, "check")
        assert report.returncode == 2, report.stdout + report.stderr
        named = f"127.0.0.1:{pair.standby.port}"
        assert named in report.stdout and "standby" in report.stdout, report.stdout
        assert not fleet.starts(), "a replica claimed on a standby"
        assert fleet.stop() == {"on-standby": 0}, replica.log()
    finally:
        fleet.kill_all()
    assert "lock session up" not in replica.log(), replica.log()


def _status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return exc.code
