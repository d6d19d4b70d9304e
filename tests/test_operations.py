"""Operating a fleet: health and metrics, pings, JSON logs without secrets, PgBouncer."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support import Fleet, Proxy, Receiver, cli, free_port, host_port, wait_for

pytestmark = pytest.mark.fleet

QUICK = """
@job(key=61)
def every_second(ctx: RunContext) -> None:
    exclusive(ctx, 0.001)
"""
FAILING = """
@job(key=62)
def always_fails(ctx: RunContext) -> None:
    record(ctx, event="start")
    raise RuntimeError("disk full")
"""


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        named = line.startswith(name + "{") or line.startswith(name + " ")
        if named and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _require(tool: str, package: str) -> str:
    path = shutil.which(tool)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{tool} is required in CI (apt-get install {package})")
        pytest.skip(f"{tool} not installed (apt-get install {package})")
    return path


def test_health_readiness_and_metrics(tmp_path, database_url):
    promtool = _require("promtool", "prometheus")
    host, port = host_port(database_url)
    proxy = Proxy(host, port)
    http_port = free_port()
    fleet = Fleet(
        tmp_path,
        database_url,
        {"every_second": {"interval": "1s"}},
        settings={"holder_timeout": 6},
        job_code=QUICK,
    )
    replica = fleet.start(
        "web-1",
        env={"SCHEDULER_DATABASE_URL": proxy.url(database_url)},
        args=["--http-port", str(http_port)],
    )
    base = f"http://127.0.0.1:{http_port}"
    try:
        fleet.wait_ready()
        wait_for(lambda: get(base + "/readyz")[0] == 200, 20, "readiness")
        assert get(base + "/healthz")[0] == 200
        wait_for(lambda: len(fleet.ends()) >= 3, 20, "a few runs")

        # A run is counted once its end is recorded in the ledger, a moment after
        # the job itself has returned (and written its end).
        def counted() -> float:
            text = get(base + "/metrics")[1]
            return metric(text, "scheduler_job_runs_total", job="every_second", status="succeeded")

        wait_for(lambda: counted() >= 3, 20, "the runs counted in the metrics")
        status, text = get(base + "/metrics")
        assert status == 200
        checked = subprocess.run(
            [promtool, "check", "metrics"], input=text, text=True, capture_output=True
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr
        runs = metric(text, "scheduler_job_runs_total", job="every_second", status="succeeded")
        ran = len(fleet.ends())
        assert 3 <= runs <= ran, (runs, ran)
        for name in (
            "scheduler_job_skips_total",
            "scheduler_job_consecutive_skips",
            "scheduler_job_duration_seconds_bucket",
            "scheduler_job_lateness_seconds_bucket",
            "scheduler_job_last_success_timestamp_seconds",
            "scheduler_lock_session_up",
            "scheduler_lock_lost_total",
        ):
            assert name in text, name
        assert metric(text, "scheduler_lock_session_up") == 1
        assert (
            metric(text, "scheduler_job_last_success_timestamp_seconds", job="every_second")
            > time.time() - 60
        )

        proxy.cut()  # the database is unreachable
        wait_for(lambda: get(base + "/readyz")[0] == 503, 30, "readiness to drop")
        assert get(base + "/healthz")[0] == 200  # alive, and waiting
        proxy.restore()
        wait_for(lambda: get(base + "/readyz")[0] == 200, 30, "readiness to return")
        text = get(base + "/metrics")[1]
        assert metric(text, "scheduler_lock_lost_total") >= 1
        replica.signal(signal.SIGTERM)
        assert replica.wait(30) == 0
    finally:
        fleet.kill_all()
        proxy.close()


def test_pings_come_from_exactly_one_replica_per_tick(tmp_path, database_url):
    receiver = Receiver()
    fleet = Fleet(
        tmp_path,
        database_url,
        {
            "every_second": {"interval": "1s", "ping_url": receiver.url("/ping/ok-uuid")},
            "always_fails": {"interval": "2s", "ping_url": receiver.url("/ping/bad-uuid")},
        },
        job_code=QUICK + FAILING,
    )
    fleet.start("r1")
    fleet.start("r2")
    try:
        fleet.wait_ready()
        wait_for(
            lambda: len([r for r in receiver.received if r["path"] == "/ping/bad-uuid/fail"]) >= 2,
            30,
            "failure pings",
        )
        wait_for(
            lambda: len(fleet.ends()) >= 5,
            30,
            "a few good runs",
        )
        codes = fleet.stop()
        time.sleep(1)
    finally:
        fleet.kill_all()
        receiver.close()
    assert codes == {"r1": 0, "r2": 0}, fleet.logs()
    paths = [r["path"] for r in receiver.received]
    good_runs = [e for e in fleet.starts() if e["job"] == "every_second"]
    assert paths.count("/ping/ok-uuid/start") == len(good_runs)
    assert paths.count("/ping/ok-uuid") == len(good_runs)  # every run finished with success
    bad_runs = [e for e in fleet.evidence() if e["job"] == "always_fails"]
    assert paths.count("/ping/bad-uuid/start") == len(bad_runs)
    assert paths.count("/ping/bad-uuid/fail") == len(bad_runs)
    assert "/ping/bad-uuid" not in paths and "/ping/ok-uuid/fail" not in paths
    fail_body = next(r for r in receiver.received if r["path"] == "/ping/bad-uuid/fail")["body"]
    assert "disk full" in str(fail_body)


def test_json_logs_parse_and_no_secret_ever_appears(tmp_path, database_url):
    password, token = "pa55-w0rd-XYZ", "hook-t0ken-QQQ"
    # Trust authentication ignores the password, so the replicas still connect.
    secret_url = database_url.replace(
        "postgresql://postgres@", f"postgresql://postgres:{password}@"
    )
    webhook = f"http://127.0.0.1:{free_port()}/services/{token}"
    fleet = Fleet(
        tmp_path,
        secret_url,
        {
            "every_second": {"interval": "1s", "skip_alert_after": 1},
            "always_fails": {"interval": "1s", "fail_alert_after": 1},
        },
        settings={"alert_webhook_url": webhook, "log_format": "json"},
        job_code=QUICK + FAILING,
    )
    replica = fleet.start("r1")
    outputs = []
    try:
        fleet.wait_ready()
        wait_for(lambda: "not delivered" in replica.log(), 30, "a failed webhook delivery")
        for args in (
            ["check"],
            ["jobs"],
            ["status"],
            ["history", "--limit", "20"],
            ["status", "--json"],
            ["trigger", "every_second"],
        ):
            result = cli(fleet, *args)
            outputs.append(result.stdout + result.stderr)
            assert result.returncode in (0, 3), result.stderr
        bad = cli(fleet, "check", "--config", str(tmp_path / "missing.yaml"))
        outputs.append(bad.stdout + bad.stderr)
        replica.signal(signal.SIGTERM)
        assert replica.wait(30) == 0
    finally:
        fleet.kill_all()
    lines = [line for line in replica.log().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    assert {"time", "level", "logger", "message"} <= set(records[0])
    started = [r for r in records if r["message"].startswith("run started")]
    assert started and {"job", "key", "scheduled_at", "run_id", "instance"} <= set(started[0])
    assert any(r["level"] == "error" and r.get("alert") == "job.failures_exceeded" for r in records)
    everything = "\n".join([replica.log(), *outputs])
    assert password not in everything
    assert token not in everything


@contextmanager
def pgbouncer(mode: str, database_url: str) -> Iterator[str]:
    """Debian's pgbouncer in front of the test database; yields its URL."""
    binary = _require("pgbouncer", "pgbouncer")
    host, port = host_port(database_url)
    listen = free_port()
    # Outside pytest's private tmp_path: as root, pgbouncer runs as nobody.
    folder = Path(tempfile.mkdtemp(prefix=f"pgbouncer-{mode}-"))
    folder.chmod(0o777)
    ini = folder / "pgbouncer.ini"
    ini.write_text(
        f"[databases]\n* = host={host} port={port} user=postgres\n"
        f"[pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {listen}\n"
        f"auth_type = any\npool_mode = {mode}\nunix_socket_dir =\n"
        f"logfile = {folder}/pgbouncer.log\npidfile = {folder}/pgbouncer.pid\n"
    )
    command = [binary, *(["-u", "nobody"] if os.geteuid() == 0 else []), str(ini)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    log = folder / "pgbouncer.log"
    try:
        wait_for(lambda: log.exists() and "listening on" in log.read_text(), 15, "pgbouncer")
        yield f"postgresql://postgres@127.0.0.1:{listen}/{database_url.rsplit('/', 1)[1]}"
    finally:
        process.terminate()
        process.wait(10)
        shutil.rmtree(folder, ignore_errors=True)


def test_pgbouncer_in_transaction_mode_is_refused(tmp_path, database_url):
    with pgbouncer("transaction", database_url) as url:
        fleet = Fleet(tmp_path, url, {"every_second": {"interval": "1s"}}, job_code=QUICK)
        check = cli(fleet, "check")
        assert check.returncode == 2, check.stdout + check.stderr
        assert "PgBouncer" in check.stdout and "pool_mode = session" in check.stdout
        replica = fleet.start("r1")
        try:
            assert replica.wait(60) == 2, replica.log()
        finally:
            fleet.kill_all()
        assert "PgBouncer" in replica.log() and "session" in replica.log()
        assert "Traceback" not in replica.log()
        assert not fleet.evidence()


def test_pgbouncer_in_session_mode_works(tmp_path, database_url):
    with pgbouncer("session", database_url) as url:
        fleet = Fleet(tmp_path, url, {"every_second": {"interval": "1s"}}, job_code=QUICK)
        check = cli(fleet, "check")
        assert check.returncode == 0, check.stdout + check.stderr
        fleet.start("r1")
        try:
            fleet.wait_ready()
            wait_for(lambda: len(fleet.evidence()) >= 2, 30, "runs through PgBouncer")
            assert fleet.stop() == {"r1": 0}
        finally:
            fleet.kill_all()
