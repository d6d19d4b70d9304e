"""Hostile input that reaches a real database: exit 2, one line, no secret printed."""

from __future__ import annotations

import pytest

from tests.unit.test_hostile_input import check_database, run_against


def test_check_shows_the_url_without_its_query_password(
    run_database, tmp_path, capsys, monkeypatch
):
    code, text = check_database(
        run_database + "?password=s3cr3tpw&sslmode=disable", tmp_path, capsys, monkeypatch
    )
    assert code == 0, text
    assert "s3cr3tpw" not in text
    assert "password=***" in text and "sslmode=disable" in text


@pytest.mark.parametrize(
    ("change", "expect"),
    [
        (lambda base: base.replace("postgres@", "nosuchrole:s3cr3tpw@"), "nosuchrole"),
        (lambda base: base.rsplit("/", 1)[0] + "/no_such_database", "no_such_database"),
    ],
    ids=["unknown role", "unknown database"],
)
def test_run_exits_2_on_an_error_no_retry_mends(change, expect, run_database, tmp_path):
    result = run_against(change(run_database), tmp_path, timeout=60)
    lines = [line for line in result.stderr.splitlines() if line.startswith("scheduler: ")]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and expect in lines[0], result.stderr
    assert "Traceback" not in result.stderr and "s3cr3tpw" not in result.stderr
