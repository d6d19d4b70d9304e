"""Health, readiness and Prometheus metrics of a replica (docs/operating.md: Health and metrics)."""

from __future__ import annotations

import signal
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from tests.fleet.tools import require
from tests.support import Fleet, Proxy, free_port, host_port, wait_for

pytestmark = pytest.mark.fleet

JOBS = ["operations.py"]  # every_second (1 ms), always_fails (raises "disk full")


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


def test_health_readiness_and_metrics(tmp_path, database_url):
    promtool = require("promtool", "prometheus")
    host, port = host_port(database_url)
    proxy = Proxy(host, port)
    http_port = free_port()
    fleet = Fleet(
        tmp_path,
        database_url,
        {"every_second": {"interval": "1s"}},
        settings={"holder_timeout": 6},
        job_files=JOBS,
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
