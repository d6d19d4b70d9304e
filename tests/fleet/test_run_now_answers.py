"""`scheduler trigger` always answers, within a stated bound, and says what is true
(docs/changing.md: Run now).

Real replicas and a real command: the replica that took the request is killed
mid-run and comes back under the same name; its database connection is cut
for seconds mid-run (it is absent from the live sessions, and its run goes
on); its writes of the outcome fail. In each case the command's answer is the
run's row in the ledger, with its exit code, never a guess from who is live.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import psycopg
import pytest

from scheduler.fleet import run_now
from tests.support import Fleet, Proxy, cli, host_port, wait_for

pytestmark = pytest.mark.fleet

JOBS = ["run_now.py"]  # lingers: 15 s, whatever it is told
SCHEDULES = {"lingers": {"interval": "1d"}}  # it runs only when asked
SLACK = 20  # seconds a loaded machine may add to a bound


@dataclass
class Trigger:
    """`scheduler trigger lingers` going in the background."""

    process: subprocess.Popen[str]
    asked: float  # monotonic

    def answer(self, timeout: float) -> tuple[int, str, float]:
        """(exit code, what it printed, when it answered: monotonic)."""
        try:
            out, err = self.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            out, err = self.process.communicate()
            raise AssertionError(f"no answer within {timeout:g} s: {out}{err}") from None
        return self.process.returncode, out.strip() + err.strip(), time.monotonic()


def trigger(fleet: Fleet) -> Trigger:
    process = subprocess.Popen(
        [sys.executable, "-m", "scheduler", "trigger", "lingers"],
        cwd=fleet.root,
        env=fleet.env("cli"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return Trigger(process, time.monotonic())


def started(fleet: Fleet, count: int = 1) -> dict:
    wait_for(lambda: len(fleet.starts()) >= count, 60, "the run to start")
    return fleet.starts()[count - 1]


def row_of(fleet: Fleet, run_id: int) -> dict:
    (row,) = [r for r in fleet.ledger("lingers") if r["run_id"] == run_id]
    return row


def request_rows(fleet: Fleet) -> list[dict]:
    with psycopg.connect(fleet.database_url) as conn:
        cur = conn.cursor(row_factory=psycopg.rows.dict_row)
        return list(cur.execute("SELECT * FROM scheduler_requests ORDER BY id"))


def said_of(row: dict) -> str:
    return f"lingers: run {row['run_id']} {row['status']} on {row['instance']}"


def test_a_taker_killed_mid_run_and_back_under_its_name_gets_its_run_recorded_crashed(
    tmp_path, database_url
):
    settings = {"holder_timeout": 10}
    fleet = Fleet(tmp_path, database_url, SCHEDULES, settings=settings, job_files=JOBS)
    fleet.start("r1")
    try:
        fleet.wait_ready()
        asked = trigger(fleet)
        run = started(fleet)
        fleet.replicas["r1"].signal(signal.SIGKILL)
        fleet.replicas["r1"].wait(10)
        killed = time.monotonic()
        fleet.start("r1")  # the same name, as compose and Kubernetes give it
        bound = run_now.orphan_patience(10)
        code, said, answered = asked.answer(timeout=bound + SLACK + 10)
        fleet.wait_ready()
        row = row_of(fleet, run["run_id"])
        requests = request_rows(fleet)
        codes = fleet.stop()
    finally:
        fleet.kill_all()
    assert codes == {"r1": 0}, fleet.logs()
    assert row["status"] == "crashed", row
    assert (code, said) == (1, f"{said_of(row)}: {row['error']}"), fleet.logs()
    assert answered - killed < bound + SLACK
    (request,) = requests
    assert (request["outcome"], request["status"], request["run_id"]) == (
        "run",
        "crashed",
        run["run_id"],
    )


def test_a_taker_cut_off_for_seconds_mid_run_is_not_called_gone(tmp_path, database_url):
    """Absent from the live sessions for longer than the command's old look interval;
    the run goes on. The answer is its row, whatever the row says."""
    proxy = Proxy(*host_port(database_url))
    settings = {"holder_timeout": 10}
    fleet = Fleet(tmp_path, database_url, SCHEDULES, settings=settings, job_files=JOBS)
    fleet.start("r1", env={"SCHEDULER_DATABASE_URL": proxy.url(database_url)})
    try:
        fleet.wait_ready()
        asked = trigger(fleet)
        run = started(fleet)
        proxy.cut()
        time.sleep(1)
        proxy.restore()  # the server sees the sessions end ...
        proxy.cut()  # ... and new ones hang: the replica is away
        wait_for(lambda: not _live(fleet), 10, "r1 to be absent from the live sessions")
        time.sleep(7)
        proxy.restore()
        code, said, _ = asked.answer(timeout=60)
        ends = fleet.ends()
        row = row_of(fleet, run["run_id"])
        codes = fleet.stop()
    finally:
        fleet.kill_all()
        proxy.close()
    assert codes == {"r1": 0}, fleet.logs()
    (end,) = ends
    assert end["lock_lost"], end  # it was cut off during the run, and went on
    assert row["status"] in ("succeeded", "crashed"), row
    expected = said_of(row) + (f": {row['error']}" if row["error"] else "")
    assert (code, said) == ({"succeeded": 0, "crashed": 1}[row["status"]], expected)
    assert "gone" not in said


def _live(fleet: Fleet) -> list[str]:
    status = cli(fleet, "status", "--json")
    return [i["name"] for i in json.loads(status.stdout)["instances"]]


REFUSE_SETTLES = """
CREATE FUNCTION refuse_settles() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'the disk is full (a test)';
END;
$$;
CREATE TRIGGER refuse_settles BEFORE UPDATE ON scheduler_requests FOR EACH ROW
    WHEN (NEW.finished_at IS NOT NULL AND current_setting('application_name') = 'r1')
    EXECUTE FUNCTION refuse_settles();
"""


def test_outcomes_the_taker_cannot_write_are_read_from_the_ledger_or_said_unknown(
    tmp_path, database_url
):
    """The replica's every write of an outcome fails. A run's outcome is its row; a
    request that met the job running (it has no row) is unknown once the patience has
    passed; and the second request says where the job runs, when the write works."""
    settings = {"holder_timeout": 6}
    fleet = Fleet(tmp_path, database_url, SCHEDULES, settings=settings, job_files=JOBS)
    fleet.start("r1")
    try:
        fleet.wait_ready()
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(REFUSE_SETTLES)
        first = trigger(fleet)
        run = started(fleet)
        second = trigger(fleet)  # meets the job running on r1; its outcome is lost
        code2, said2, answered2 = second.answer(timeout=60)
        code1, said1, _ = first.answer(timeout=60)
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute("DROP TRIGGER refuse_settles ON scheduler_requests")
        third = trigger(fleet)
        run = started(fleet, 2)
        fourth = cli(fleet, "trigger", "lingers")  # meets the job running; said truly
        code3, said3, _ = third.answer(timeout=60)
        row = row_of(fleet, fleet.starts()[0]["run_id"])
        again = row_of(fleet, run["run_id"])
        codes = fleet.stop()
    finally:
        fleet.kill_all()
    assert codes == {"r1": 0}, fleet.logs()
    assert "cannot record the outcome of run-now request" in fleet.replicas["r1"].log()
    assert (code1, said1) == (0, said_of(row)), fleet.logs()
    assert (code2, said2.split(":")[:2]) == (4, ["lingers", " outcome unknown"]), said2
    assert "r1 took the request at " in said2
    assert answered2 - second.asked < run_now.patience(6) + SLACK
    assert (code3, said3) == (0, said_of(again))
    since = again["started_at"].isoformat(timespec="milliseconds")
    assert (fourth.returncode, fourth.stdout.strip()) == (
        3,
        f"lingers: not run: already running on r1 (run {again['run_id']}, since {since})",
    )
