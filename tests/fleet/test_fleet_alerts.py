"""A skipped tick is recorded once for the fleet; one alert after N in a row; one recovery
notice when the job runs again. Webhooks never block scheduling (docs/operating.md: Alerts
and notices)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from tests.support import Fleet, Receiver, cli, free_port, parse_tick, wait_for

pytestmark = pytest.mark.fleet

# sometimes_slow: the first run takes 7 s, every later one is instant: about 6 ticks
# find it going.
JOBS = ["alerts.py"]


def test_skips_are_recorded_once_and_alert_once_for_the_fleet(tmp_path, database_url):
    receiver = Receiver()
    fleet = Fleet(
        tmp_path,
        database_url,
        {"sometimes_slow": {"interval": "1s"}},
        settings={"skip_alert_after": 3, "alert_webhook_url": receiver.url("/hook")},
        job_files=JOBS,
    )
    for name in ("r1", "r2", "r3"):
        fleet.start(name)
    try:
        fleet.wait_ready()
        wait_for(lambda: receiver.bodies("job.recovered"), 60, "the recovery notice")
        wait_for(
            lambda: len(fleet.ends()) >= 4,
            30,
            "a few instant runs after the slow one",
        )
        history = cli(fleet, "history", "--json", "--limit", "500")
        codes = fleet.stop()
    finally:
        fleet.kill_all()
        receiver.close()
    assert codes == {"r1": 0, "r2": 0, "r3": 0}, fleet.logs()
    assert history.returncode == 0, history.stderr
    rows = json.loads(history.stdout)
    ticks = Counter(row["scheduled_at"] for row in rows)
    assert max(ticks.values()) == 1, f"a tick appears twice in history: {ticks}"

    skipped = [r for r in rows if r["status"] == "skipped"]
    assert 4 <= len(skipped) <= 8, rows  # about 6: the 7 s run covers ~6 ticks
    assert {r["holder"] for r in skipped} == {rows[-1]["instance"]}  # the slow run's replica

    exceeded = receiver.bodies("job.skips_exceeded")
    assert len(exceeded) == 1, receiver.received
    alert = exceeded[0]
    assert (alert["job"], alert["key"], alert["consecutive_skips"], alert["threshold"]) == (
        "sometimes_slow",
        31,
        3,
        3,
    )
    assert alert["holder"] == rows[-1]["instance"] and alert["text"]
    assert parse_tick(alert["scheduled_at"]) in {parse_tick(r["scheduled_at"]) for r in skipped}
    recovered = receiver.bodies("job.recovered")
    assert len(recovered) == 1
    assert recovered[0]["consecutive_skips"] == len(skipped), (recovered, rows)
    # The ERROR log line names job, key, count and holder, on exactly one replica.
    alert_lines = [line for line in fleet.logs().splitlines() if "ALERT job.skips_exceeded" in line]
    assert len(alert_lines) == 1 and "sometimes_slow" in alert_lines[0]
    assert alert["holder"] in alert_lines[0]
    starts = Counter(e["tick"] for e in fleet.starts())
    assert max(starts.values()) == 1
    assert not [e for e in fleet.evidence() if e.get("overlap")]


def test_a_webhook_that_is_down_does_not_block_scheduling_and_delivers_later(
    tmp_path, database_url
):
    port = free_port()
    secret = "T0KEN-abc123-SECRET"
    fleet = Fleet(
        tmp_path,
        database_url,
        {"sometimes_slow": {"interval": "1s", "skip_alert_after": 2}},
        settings={"alert_webhook_url": f"http://127.0.0.1:{port}/hooks/{secret}"},
        job_files=JOBS,
    )
    fleet.start("r1")
    fleet.start("r2")
    receiver = None
    try:
        fleet.wait_ready()
        wait_for(lambda: "not delivered" in fleet.logs(), 30, "a failed delivery")
        # Scheduling went on while the webhook failed: runs still start every second.
        wait_for(
            lambda: len(fleet.ends()) >= 3,
            30,
            "runs to go on",
        )
        receiver = Receiver(port)
        wait_for(lambda: receiver.bodies("job.skips_exceeded"), 60, "the delayed alert")
        codes = fleet.stop()
    finally:
        fleet.kill_all()
        if receiver:
            receiver.close()
    assert codes == {"r1": 0, "r2": 0}, fleet.logs()
    assert len(receiver.bodies("job.skips_exceeded")) == 1
    logs = fleet.logs()
    assert secret not in logs
    assert f"http://127.0.0.1:{port}/…" in logs
    starts = Counter(e["tick"] for e in fleet.starts())
    assert max(starts.values()) == 1


def test_status_names_the_replica_running_a_job(tmp_path, database_url):
    fleet = Fleet(tmp_path, database_url, {"sometimes_slow": {"interval": "1s"}}, job_files=JOBS)
    (fleet.evidence_path.parent / "slow-run-seconds").write_text("30")  # still on when read
    fleet.start("r1")
    fleet.start("r2")
    try:
        fleet.wait_ready()
        first = wait_for(
            lambda: fleet.starts(),
            30,
            "the slow run to start",
        )[0]
        result = cli(fleet, "status", "--json")
        assert result.returncode == 0, result.stderr
        status = json.loads(result.stdout)
        job = status["jobs"][0]
        assert job["running"]["instance"] == first["instance"]
        assert job["running"]["lock_held_by"] == first["instance"]
        assert job["running"]["run_id"] == first["run_id"]
        assert sorted(i["name"] for i in status["instances"]) == ["r1", "r2"]
        text = cli(fleet, "status")
        assert first["instance"] in text.stdout and "sometimes_slow" in text.stdout
        codes = fleet.stop()
    finally:
        fleet.kill_all()
    assert codes == {"r1": 0, "r2": 0}, fleet.logs()
