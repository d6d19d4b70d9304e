"""JSON logs parse line by line, and no password or webhook secret ever appears in a
replica's log or a command's output (docs/operating.md: Logs)."""

from __future__ import annotations

import json
import signal

import pytest

from tests.support import Fleet, cli, free_port, wait_for

pytestmark = pytest.mark.fleet

JOBS = ["operations.py"]  # every_second (1 ms), always_fails (raises "disk full")


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
        job_files=JOBS,
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
            ["trigger", "every_second", "--here"],
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
