"""Fleets on one database are kept apart: a schema each, and clashes refused at start."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from tests.support import Fleet, assert_exactly_once, cli, parse_tick, wait_for, whole_seconds

pytestmark = pytest.mark.fleet


def project(root: Path, database_url: str, job: str, schema: str | None) -> Fleet:
    """A project whose only job has key 2001, named `job` (tests/fleet/jobs/apart_<job>.py)."""
    settings = {"schema": schema} if schema else {}
    return Fleet(
        root,
        database_url,
        {job: {"interval": "1s"}},
        settings=settings,
        job_files=[f"apart_{job}.py"],
    )


@pytest.fixture
def schemas(database_url):
    yield
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("DROP SCHEMA IF EXISTS fleet_a, fleet_b CASCADE")


def test_two_fleets_in_their_own_schemas_run_apart(tmp_path, database_url, schemas):
    a = project(tmp_path / "a", database_url, "billing_sync", "fleet_a")
    b = project(tmp_path / "b", database_url, "report_mail", "fleet_b")
    for fleet, names in ((a, ("a1", "a2")), (b, ("b1", "b2"))):
        for name in names:
            fleet.start(name)
    try:
        a.wait_ready()
        b.wait_ready()
        wait_for(lambda: len(a.starts()) >= 6 and len(b.starts()) >= 6, 60, "both fleets")
        status_a = cli(a, "status", "--json")
        codes = {**a.stop(), **b.stop()}
    finally:
        a.kill_all()
        b.kill_all()
    assert set(codes.values()) == {0}, a.logs() + b.logs()
    for fleet, job in ((a, "billing_sync"), (b, "report_mail")):
        starts = fleet.starts()
        assert {e["job"] for e in starts} == {job}
        ticks = sorted(parse_tick(e["tick"]) for e in starts)
        window = whole_seconds(ticks[1], ticks[-2])
        assert_exactly_once(fleet.evidence(), job, window, fleet.logs())
    with psycopg.connect(database_url) as conn:
        names = {
            schema: {
                r[0]
                for r in conn.execute(f"SELECT DISTINCT job_name FROM {schema}.scheduler_ticks")
            }
            for schema in ("fleet_a", "fleet_b")
        }
    assert names == {"fleet_a": {"billing_sync"}, "fleet_b": {"report_mail"}}
    assert '"a1"' in status_a.stdout and '"b1"' not in status_a.stdout


def test_a_key_a_live_replica_runs_under_another_name_refuses_to_start(
    tmp_path, database_url, schemas
):
    first = project(tmp_path / "a", database_url, "billing_sync", "fleet_a")
    other = project(tmp_path / "b", database_url, "report_mail", "fleet_a")  # same schema
    first.start("a1")
    try:
        first.wait_ready()
        refused = other.start("b1")
        code = refused.wait(60)
        clash = refused.log()
        # It waits 2 x holder_timeout + 5 s (9 s here) in case a1's session is its own
        # earlier one, still ending after a restart; a1 stays up: refused.
        same_name = first.start(
            "a1-again", env={"SCHEDULER_INSTANCE_NAME": "a1", "SCHEDULER_HOLDER_TIMEOUT": "2"}
        )
        same_code = same_name.wait(60)
    finally:
        first.kill_all()
        other.kill_all()
    assert code == 2, clash
    assert "job key 2001" in clash and "billing_sync" in clash and "report_mail" in clash
    assert "a1" in clash and "Traceback" not in clash
    assert same_code == 2, same_name.log()
    assert "instance_name 'a1' is in use by a live replica" in same_name.log()
    # Once no replica runs the old name, the rename is allowed (as docs/jobs.md promises).
    renamed = project(tmp_path / "c", database_url, "billing_sync_v2", "fleet_a")
    renamed.start("c1")
    try:
        renamed.wait_ready()
        wait_for(lambda: renamed.starts(), 30, "the renamed job to run")
    finally:
        renamed.kill_all()


def test_check_reports_the_schema(tmp_path, database_url, schemas):
    fleet = project(tmp_path, database_url, "billing_sync", "fleet_b")
    result = cli(fleet, "check")
    assert result.returncode == 0, result.stdout + result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("schema"))
    assert "fleet_b" in line and "lock namespace" in line
    assert "can create schema fleet_b" in result.stdout
