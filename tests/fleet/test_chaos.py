"""What happens when things break (docs/faults.md: Faults): frozen, cut-off and killed replicas,
killed sessions, a database restart, and signals. No tick runs twice; a replica that lost
its lock is told, and its late finish changes nothing; the others take over and go on; a
stopping replica starts nothing new. Real replicas, real PostgreSQL."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from datetime import UTC, datetime

import psycopg
import pytest

from tests import clusters
from tests.support import Fleet, Proxy, host_port, parse_tick, wait_for

pytestmark = pytest.mark.fleet

JOBS = ["chaos.py"]  # long_job (20 s), quick (1 ms), three_seconds (3 s)


def assert_no_tick_twice(fleet: Fleet) -> None:
    counts = Counter((e["job"], e["tick"]) for e in fleet.starts())
    twice = {k: n for k, n in counts.items() if n > 1}
    assert not twice, f"ticks run twice: {twice}\n{fleet.logs()}"


def test_a_frozen_replica_loses_its_lock_and_its_late_finish_changes_nothing(
    tmp_path, database_url
):
    fleet = Fleet(
        tmp_path,
        database_url,
        {"long_job": {"interval": "2s"}},
        settings={"holder_timeout": 6},
        job_files=JOBS,
    )
    fleet.start("r1")
    fleet.start("r2")
    try:
        fleet.wait_ready()
        first = wait_for(lambda: fleet.starts(), 30, "the long job to start")[0]
        victim = fleet.replicas[first["instance"]]
        survivor = next(r for r in fleet.replicas.values() if r is not victim)
        victim.signal(signal.SIGSTOP)
        frozen_at = time.time()

        taken = wait_for(lambda: fleet.starts(survivor.name), 30, "a takeover")[0]
        assert taken["at"] - frozen_at <= 12, f"took {taken['at'] - frozen_at:.1f} s"
        assert taken["run_id"] > first["run_id"]
        survivor_row = _row(fleet, taken["tick"])
        assert (survivor_row["status"], survivor_row["instance"]) == ("running", survivor.name)

        victim.signal(signal.SIGCONT)
        resumed_at = time.time()
        late = wait_for(lambda: fleet.ends(victim.name), 40, "the stale run to finish")[0]
        assert late["lock_lost"], "the stale run was never told it lost its lock"
        assert late["lock_lost_at"] - resumed_at <= 5, "lock_lost came too late"
        # Its late finish changed no one else's record.
        stale_row = _row(fleet, first["tick"])
        assert (stale_row["status"], stale_row["instance"]) == ("crashed", victim.name)
        after = _row(fleet, taken["tick"])
        assert (after["instance"], after["run_id"]) == (survivor.name, taken["run_id"])
        assert after["status"] in ("running", "succeeded")
        codes = fleet.stop()
    finally:
        fleet.kill_all()
    assert codes == {"r1": 0, "r2": 0}, fleet.logs()
    assert_no_tick_twice(fleet)
    # Overlap happened only with the run that had lost its lock.
    assert all(e["instance"] == survivor.name for e in fleet.starts() if e.get("overlap"))


def test_killing_every_session_keeps_replicas_up_and_ticks_resume(tmp_path, database_url):
    fleet = Fleet(tmp_path, database_url, {"quick": {"interval": "1s"}}, job_files=JOBS)
    fleet.start("r1")
    fleet.start("r2")
    try:
        fleet.wait_ready()
        wait_for(lambda: len(fleet.starts()) >= 3, 30, "a few runs")
        with psycopg.connect(database_url, autocommit=True) as admin:
            killed = admin.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            ).fetchone()[0]
        killed_at = time.time()
        assert killed >= 2
        resumed = wait_for(
            lambda: [e for e in fleet.starts() if e["at"] > killed_at + 0.01], 30, "a new run"
        )[0]
        assert resumed["at"] - killed_at <= 3, f"ticks resumed after {resumed['at'] - killed_at} s"
        time.sleep(3)
        assert all(r.process.poll() is None for r in fleet.replicas.values()), fleet.logs()
        codes = fleet.stop()
    finally:
        fleet.kill_all()
    assert codes == {"r1": 0, "r2": 0}, fleet.logs()
    assert "lock session lost" in fleet.logs()
    assert_no_tick_twice(fleet)


def test_sigterm_mid_run_lets_the_run_finish_and_starts_nothing_new(tmp_path, database_url):
    fleet = Fleet(tmp_path, database_url, {"three_seconds": {"interval": "4s"}}, job_files=JOBS)
    replica = fleet.start("r1")
    try:
        fleet.wait_ready()
        first = wait_for(lambda: fleet.starts(), 30, "the run to start")[0]
        wait_for(lambda: time.time() >= first["at"] + 1, 5, "one second into the run")
        replica.signal(signal.SIGTERM)
        signalled_at = time.time()
        code = replica.wait(30)
    finally:
        fleet.kill_all()
    assert code == 0, fleet.logs()
    finished = fleet.ends()
    assert [e["run_id"] for e in finished] == [first["run_id"]], fleet.logs()
    assert not [e for e in fleet.starts() if e["at"] > signalled_at]
    assert _row(fleet, first["tick"])["status"] == "succeeded"
    assert "every lock released" in replica.log()


def test_a_second_signal_exits_at_once(tmp_path, database_url):
    fleet = Fleet(tmp_path, database_url, {"long_job": {"interval": "2s"}}, job_files=JOBS)
    replica = fleet.start("r1")
    try:
        fleet.wait_ready()
        wait_for(lambda: fleet.starts(), 30, "the run to start")
        replica.signal(signal.SIGTERM)
        wait_for(lambda: "stopping" in replica.log(), 10, "the first signal to be handled")
        replica.signal(signal.SIGINT)
        code = replica.wait(5)
    finally:
        fleet.kill_all()
    assert code == 128 + signal.SIGINT


def _signal_thread(pid: int, tid: int, signum: int) -> None:
    """What the kernel may do with a process's signal: hand it to any of its threads."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    sys_tgkill = 234  # x86_64
    if libc.syscall(sys_tgkill, pid, tid, signum) != 0:
        raise OSError(ctypes.get_errno(), "tgkill failed")


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="tgkill's number is x86_64's")
def test_sigterm_received_by_another_thread_still_stops_the_replica(tmp_path, database_url):
    fleet = Fleet(tmp_path, database_url, {"quick": {"interval": "1s"}}, job_files=JOBS)
    replica = fleet.start("r1")
    try:
        fleet.wait_ready()
        wait_for(lambda: fleet.starts(), 30, "the run to start")
        threads = [int(t) for t in os.listdir(f"/proc/{replica.pid}/task") if int(t) != replica.pid]
        _signal_thread(replica.pid, max(threads), signal.SIGTERM)
        code = replica.wait(30)
    finally:
        fleet.kill_all()
    assert code == 0, replica.log()
    assert "stopped cleanly" in replica.log()


def test_a_cut_off_replica_loses_its_lock_then_rejoins(tmp_path, database_url):
    host, port = host_port(database_url)
    proxy = Proxy(host, port)
    fleet = Fleet(
        tmp_path,
        database_url,
        {"long_job": {"interval": "2s"}},
        settings={"holder_timeout": 6},
        job_files=JOBS,
    )
    cut_off = fleet.start("cut", env={"SCHEDULER_DATABASE_URL": proxy.url(database_url)})
    try:
        fleet.wait_ready()
        first = wait_for(lambda: fleet.starts("cut"), 30, "the long job to start")[0]
        other = fleet.start("other")
        fleet.wait_ready()
        proxy.cut()
        cut_at = time.time()
        taken = wait_for(lambda: fleet.starts("other"), 30, "a takeover")[0]
        assert taken["at"] - cut_at <= 12, f"took {taken['at'] - cut_at:.1f} s"
        # The cut-off run is told, by its own replica, within about holder_timeout.
        told = wait_for(lambda: "can no longer be proven" in cut_off.log(), 15, "lock_lost")
        assert told
        proxy.restore()
        wait_for(lambda: cut_off.log().count("lock session up") >= 2, 30, "a reconnection")
        late = wait_for(lambda: fleet.ends("cut"), 40, "the stale run to finish")[0]
        assert late["lock_lost"] and late["lock_lost_at"] - cut_at <= 9
        assert _row(fleet, first["tick"])["status"] == "crashed"
        assert cut_off.process.poll() is None and other.process.poll() is None
        codes = fleet.stop()
    finally:
        fleet.kill_all()
        proxy.close()
    assert codes == {"cut": 0, "other": 0}, fleet.logs()
    assert_no_tick_twice(fleet)


@pytest.fixture
def own_server():
    """A cluster of this test's own: restarting the shared server would hit other tests."""
    reason = clusters.available()
    if reason:
        pytest.skip(f"cannot make a cluster here: {reason}")
    cluster = clusters.Cluster("restart")
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.remove()


def test_replicas_survive_a_database_restart(tmp_path, own_server):
    fleet = Fleet(tmp_path, own_server.url(), {"quick": {"interval": "1s"}}, job_files=JOBS)
    fleet.start("r1")
    fleet.start("r2")
    try:
        fleet.wait_ready()
        wait_for(lambda: len(fleet.starts()) >= 3, 30, "a few runs")
        own_server.restart()
        restarted_at = time.time()
        wait_for(
            lambda: [e for e in fleet.starts() if e["at"] > restarted_at], 30, "runs after restart"
        )
        time.sleep(3)
        assert all(r.process.poll() is None for r in fleet.replicas.values()), fleet.logs()
        codes = fleet.stop()
    finally:
        fleet.kill_all()
    assert codes == {"r1": 0, "r2": 0}, fleet.logs()
    assert_no_tick_twice(fleet)


def test_catch_up_latest_runs_the_tick_missed_while_the_fleet_was_down(tmp_path, database_url):
    # Every 30 s: the fleet runs the jobs, is down over one tick, and is back within grace.
    schedule = {"interval": "30s", "misfire_grace": "1m"}
    fleet = Fleet(
        tmp_path,
        database_url,
        {"quick": {**schedule, "catch_up": "latest"}, "three_seconds": schedule},
        job_files=JOBS,
    )
    fleet.start("r1")
    fleet.start("r2")
    try:
        fleet.wait_ready()
        assert fleet.stop() == {"r1": 0, "r2": 0}, fleet.logs()
        down = datetime.now(UTC)
        missed = datetime.fromtimestamp((int(down.timestamp()) // 30 + 1) * 30, UTC)
        time.sleep((missed - datetime.now(UTC)).total_seconds() + 2)
        back = datetime.now(UTC)
        fleet.start("r1")
        fleet.start("r2")
        fleet.wait_ready()
        ran = wait_for(
            lambda: [e for e in fleet.starts() if parse_tick(e["tick"]) > down],
            30,
            "the caught-up run",
        )
        time.sleep(2)
        codes = fleet.stop()
    finally:
        fleet.kill_all()
    assert codes == {"r1": 0, "r2": 0}
    after = [(e["job"], parse_tick(e["tick"])) for e in fleet.starts()]
    # The tick of the downtime ran once, caught up; no other job's did (later ticks may run).
    caught_up = [(job, tick) for job, tick in after if down < tick < back]
    assert caught_up == [("quick", missed)], (after, fleet.logs())
    assert len(ran) == 1, ran


def _row(fleet: Fleet, tick: str) -> dict:
    rows = [r for r in fleet.ledger() if r["scheduled_at"] == parse_tick(tick)]
    assert len(rows) == 1, rows
    return rows[0]
