"""`enabled: false` by a reload stops a job on real replicas: its pending retries too."""

from __future__ import annotations

import signal
import time

import pytest
import yaml

from tests.support import Fleet, wait_for

pytestmark = pytest.mark.fleet


def test_a_job_disabled_by_a_reload_runs_none_of_its_pending_retries(tmp_path, database_url):
    schedule = {"interval": "30s", "retries": 2, "retry_delay": "3s"}
    fleet = Fleet(
        tmp_path,
        database_url,
        {"stubborn": schedule},
        {"holder_timeout": 6},
        job_files=["policies.py"],
    )
    try:
        for name in ("d1", "d2"):
            fleet.start(name)
        fleet.wait_ready()

        def attempts() -> list[dict]:
            return [e for e in fleet.evidence() if e.get("event") == "attempt"]

        wait_for(lambda: attempts(), 60, "a first attempt")
        wait_for(
            lambda: any(r["retry_at"] is not None for r in fleet.ledger("stubborn")),
            30,
            "its retry to be pending",
        )
        config = tmp_path / "config.yaml"
        document = yaml.safe_load(config.read_text())
        document["jobs"]["stubborn"]["enabled"] = False
        config.write_text(yaml.safe_dump(document))
        for replica in fleet.replicas.values():
            replica.signal(signal.SIGHUP)
        wait_for(
            lambda: all("config.yaml reloaded" in r.log() for r in fleet.replicas.values()),
            30,
            "both replicas to reload",
        )
        reloaded_at = time.time()
        time.sleep(10)  # the retry was due within 3 s, and a second one 6 s after it
        late = [e for e in attempts() if e["at"] > reloaded_at]
        assert late == [], fleet.logs()
    finally:
        fleet.kill_all()
