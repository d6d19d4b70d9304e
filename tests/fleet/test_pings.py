"""Dead man's switch pings: `/start`, success and `/fail`, from exactly one replica per tick
(docs/configuration.md: `ping_url`)."""

from __future__ import annotations

import time

import pytest

from tests.support import Fleet, Receiver, wait_for

pytestmark = pytest.mark.fleet

JOBS = ["operations.py"]  # every_second (1 ms), always_fails (raises "disk full")


def test_pings_come_from_exactly_one_replica_per_tick(tmp_path, database_url):
    receiver = Receiver()
    fleet = Fleet(
        tmp_path,
        database_url,
        {
            "every_second": {"interval": "1s", "ping_url": receiver.url("/ping/ok-uuid")},
            "always_fails": {"interval": "2s", "ping_url": receiver.url("/ping/bad-uuid")},
        },
        job_files=JOBS,
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
