"""The ledger tells the truth, whatever a job says or does, on real replicas.

- A job's error text with NUL bytes or a lone surrogate neither stops the other
  jobs of the replica nor keeps a lock; it is stored, readable.
- A run that stops early when told to raises `scheduler.Interrupted`: it is
  recorded `interrupted`, with what it was told, and no failure.
- A job that overruns its schedule alerts once and recovers once, when a run
  keeps up again, however many runs overran in between.
"""

from __future__ import annotations

import json
import signal
import time

import psycopg
import pytest

from tests.support import Fleet, Receiver, cli, parse_tick, wait_for

pytestmark = pytest.mark.fleet

# healthy; poisoned (an error text with NUL and a lone surrogate); careful (raises
# Interrupted once told); overrun (its first two runs take 8 s on a 2 s grid); lingering
# (leaves a thread running, and its error text tries to forge a log line).
JOBS = ["truth.py"]


@pytest.mark.parametrize("backend", ["postgresql", "embedded"])
def test_a_poisoned_error_text_stops_nothing_else(tmp_path, request, backend):
    url = request.getfixturevalue("database_url") if backend == "postgresql" else None
    fleet = Fleet(
        tmp_path,
        url,
        {"healthy": {"interval": "1s"}, "poisoned": {"interval": "1s"}},
        settings={"fail_alert_after": 1000},
        job_files=JOBS,
    )
    fleet.start("r1")
    try:
        fleet.wait_ready()
        wait_for(lambda: len(fleet.starts()) >= 6, 60, "six healthy runs")
        history = cli(fleet, "history", "--json", "--limit", "200")
        codes = fleet.stop()
    finally:
        fleet.kill_all()
    assert codes == {"r1": 0}, fleet.logs()
    assert history.returncode == 0, history.stderr
    rows = json.loads(history.stdout)
    healthy = [r for r in rows if r["job"] == "healthy"]
    poisoned = [r for r in rows if r["job"] == "poisoned"]
    assert {r["status"] for r in healthy} <= {"succeeded", "running"}, healthy
    assert len([r for r in healthy if r["status"] == "succeeded"]) >= 5
    failed = [r for r in poisoned if r["status"] == "failed"]
    assert failed, poisoned
    # NUL and the surrogate are escaped (no database can store them), the rest kept as is.
    assert "upstream said: \\x00\x01 garbage in report-\\udcff.csv" in failed[0]["error"]
    after = json.loads(cli(fleet, "history", "--json", "--limit", "200").stdout)
    assert not [r for r in after if r["status"] == "running"], after


def test_a_run_that_stops_when_told_is_recorded_interrupted(tmp_path, database_url):
    fleet = Fleet(
        tmp_path,
        database_url,
        {"careful": {"interval": "2s"}},
        settings={"shutdown_grace": 20, "fail_alert_after": 1},
        job_files=JOBS,
    )
    replica = fleet.start("r1")
    try:
        fleet.wait_ready()
        first = wait_for(lambda: fleet.starts(), 30, "the first run")[0]
        with psycopg.connect(database_url, autocommit=True) as admin:  # its session is killed
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE application_name = 'r1' AND datname = current_database()"
            )
        second = wait_for(
            lambda: [e for e in fleet.starts() if e["run_id"] != first["run_id"]],
            60,
            "a run on the new session",
        )[0]
        replica.signal(signal.SIGTERM)  # this one is told the daemon is stopping
        assert replica.wait(30) == 0, fleet.logs()
    finally:
        fleet.kill_all()
    rows = {r["run_id"]: r for r in fleet.ledger("careful") if r["run_id"]}
    told = [rows[e["run_id"]] for e in (first, second)]
    assert [r["status"] for r in told] == ["interrupted", "interrupted"], told
    assert [r["told"] for r in told] == ["lock_lost", "stopping"], told
    assert all(r["error"].startswith("told to stop") for r in told), told
    history = cli(fleet, "history", "careful", "--json")
    shown = {r["run_id"]: r for r in json.loads(history.stdout)}
    assert shown[second["run_id"]]["told"] == "stopping"
    with psycopg.connect(database_url) as conn:
        (failures,) = conn.execute(
            "SELECT consecutive_failures FROM scheduler_jobs WHERE job_key = 73"
        ).fetchone()
    assert failures == 0  # an interruption is no failure


def test_an_overrunning_job_alerts_once_and_recovers_once_when_it_keeps_up(tmp_path, database_url):
    receiver = Receiver()
    fleet = Fleet(
        tmp_path,
        database_url,
        {"overrun": {"interval": "2s"}},
        settings={"skip_alert_after": 3, "alert_webhook_url": receiver.url("/hook")},
        job_files=JOBS,
    )
    fleet.start("r1")
    fleet.start("r2")
    try:
        fleet.wait_ready()
        wait_for(lambda: receiver.bodies("job.recovered"), 90, "the recovery")
        time.sleep(4)  # a few more quick runs: no more notices
        codes = fleet.stop()
    finally:
        fleet.kill_all()
        receiver.close()
    assert codes == {"r1": 0, "r2": 0}, fleet.logs()
    alerts = receiver.bodies("job.skips_exceeded")
    assert len(alerts) == 1, receiver.received
    assert "overrunning its schedule" in alerts[0]["text"]
    recovered = receiver.bodies("job.recovered")
    assert len(recovered) == 1, receiver.received
    skipped = [r for r in fleet.ledger("overrun") if r["status"] == "skipped"]
    assert recovered[0]["consecutive_skips"] == len(skipped) >= 5  # both overruns' skips
    slow_ends = sorted(parse_tick(e["tick"]) for e in fleet.ends() if e["at"])
    assert len(slow_ends) >= 3


def test_a_job_can_neither_forge_log_lines_nor_keep_the_replica_from_exiting(
    tmp_path, database_url
):
    fleet = Fleet(tmp_path, database_url, {"lingering": {"interval": "1h"}}, job_files=JOBS)
    replica = fleet.start("r1")
    try:
        fleet.wait_ready()
        ran = cli(fleet, "trigger", "lingering", "--here", timeout=60)  # in the CLI process
        replica.signal(signal.SIGTERM)
        code = replica.wait(30)
        history = cli(fleet, "history", "lingering")
    finally:
        fleet.kill_all()
    assert ran.returncode == 1, ran.stdout + ran.stderr  # the job failed; the CLI still exited
    assert code == 0
    for text in (ran.stdout + ran.stderr, history.stdout):
        assert "\x1b" not in text
        assert not [line for line in text.splitlines() if line.startswith("2026-01-01")], text
    assert "boom\\n2026-01-01" in history.stdout
