"""What the commands print: a reader that goes away, `history --limit`, help that is true."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import create_engine, insert

from scheduler.backends import EMBEDDED_FILE
from scheduler.cli.commands import main
from scheduler.ledger import tables


@pytest.mark.parametrize(
    "args",
    [["check"], ["jobs", "--next", "1000"], ["status"], ["history"], ["--help"], ["run", "-h"]],
)
def test_a_reader_that_goes_away_is_no_traceback(run, tmp_path, args):
    """`scheduler check | head -1`: the rest of the output goes nowhere, quietly."""
    run("status")  # the ledger exists
    if args[0] not in ("--help", "run"):
        args = [*args, "--config", str(tmp_path / "config.yaml")]
    command = subprocess.Popen(
        [sys.executable, "-m", "scheduler", *args],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    command.stdout.close()  # gone before the first line
    _, err = command.communicate(timeout=60)
    assert err.decode() == ""
    # As for a tool the closed pipe's SIGPIPE ends; help printed is no error either way.
    assert command.returncode == 141 or (args[-1] in ("--help", "-h") and command.returncode == 0)


def test_run_help_says_the_port_serves_the_page_and_the_api_too(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    said = " ".join(capsys.readouterr().out.split())
    assert "the page, its API, /healthz, /readyz and /metrics" in said


def retried_ticks(tmp_path, count: int) -> None:
    """`count` ticks of sync, each on its second attempt, the first failed."""
    engine = create_engine(f"sqlite:///{tmp_path / EMBEDDED_FILE}")
    start = datetime(2026, 3, 1, tzinfo=UTC)
    with engine.begin() as conn:
        for i in range(count):
            at = start + timedelta(minutes=i)
            common = {"job_key": 2001, "scheduled_at": at, "instance": "r1"}
            conn.execute(
                insert(tables.ticks).values(
                    **common, job_name="sync", status="succeeded", attempt=2, run_id=10 + 2 * i
                )
            )
            conn.execute(
                insert(tables.attempts).values(
                    **common, attempt=1, status="failed", run_id=9 + 2 * i, error="boom"
                )
            )
    engine.dispose()


def test_history_limit_counts_the_lines_shown_and_in_json_the_ticks(run, tmp_path):
    run("status")
    retried_ticks(tmp_path, 6)
    code, out, _ = run("history", "--limit", "4")
    lines = out.splitlines()
    assert code == 0 and lines[0].startswith("SCHEDULED_AT") and len(lines) == 1 + 4
    # Newest first, each retried tick followed by its earlier attempt.
    assert [line.split()[2:4] for line in lines[1:]] == [
        ["succeeded", "2"],
        ["failed", "1"],
        ["succeeded", "2"],
        ["failed", "1"],
    ]
    code, out, _ = run("history", "--limit", "4", "--json")
    ticks = json.loads(out)
    assert len(ticks) == 4 and all(len(t["attempts"]) == 1 for t in ticks)
    code, out, _ = run("history", "--limit", "3")
    assert len(out.splitlines()) == 1 + 3  # a tick's earlier attempts cut after the limit
