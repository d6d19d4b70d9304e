"""`scheduler pause JOB [--reason] [--by]` and `scheduler resume JOB [--by]` (embedded ledger)."""

from __future__ import annotations

import json

import pytest

from scheduler.fleet import pauses


def paused_of(run, name: str) -> dict | None:
    code, out, _ = run("status", "--json")
    assert code == 0
    return next(j["paused"] for j in json.loads(out)["jobs"] if j["name"] == name)


def test_pause_is_shown_by_status_and_resume_ends_it(run):
    code, out, err = run("pause", "sync", "--reason", "upstream down", "--by", "alice@laptop")
    assert (code, err) == (0, "")
    assert "sync: paused by alice@laptop since " in out and ": upstream down" in out
    assert "a run going now is not stopped" in out
    found = paused_of(run, "sync")
    assert found is not None
    assert (found["by"], found["reason"]) == ("alice@laptop", "upstream down")
    assert paused_of(run, "report") is None
    code, out, _ = run("status")
    line = next(line for line in out.splitlines() if line.startswith("sync "))
    assert "by alice@laptop since" in line and "upstream down" in line
    code, out, err = run("resume", "sync", "--by", "bob@bastion")
    assert (code, err) == (0, "")
    assert out.startswith("sync: resumed by bob@bastion; it was paused by alice@laptop")
    assert paused_of(run, "sync") is None


def test_pausing_twice_keeps_the_first_pause_and_resuming_twice_says_so(run):
    run("pause", "sync", "--reason", "first", "--by", "alice")
    code, out, _ = run("pause", "sync", "--reason", "second", "--by", "bob")
    assert code == 0 and "already paused by alice" in out and "(unchanged)" in out
    assert paused_of(run, "sync")["reason"] == "first"
    run("resume", "sync")
    code, out, _ = run("resume", "sync")
    assert (code, out) == (0, "sync: not paused (unchanged)\n")


def test_the_default_actor_is_user_at_host(run):
    run("pause", "sync")
    assert paused_of(run, "sync")["by"] == pauses.default_actor()
    assert "@" in pauses.default_actor()


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (("pause", "nope"), "scheduler: no job named 'nope' (see `scheduler jobs`)"),
        (("resume", "nope"), "scheduler: no job named 'nope' (see `scheduler jobs`)"),
        (("pause", "x" * 5000), "scheduler: no job named 'xxxx"),
        (("pause", "sync", "--reason", "r" * 501), "--reason: at most 500 characters, got 501"),
        (("pause", "sync", "--by", "b" * 201), "--by: at most 200 characters, got 201"),
    ],
)
def test_bad_input_gets_one_line_and_exit_2_and_changes_nothing(run, args, expect):
    code, out, err = run(*args)
    assert code == 2 and out == ""
    assert expect in err and err.count("\n") == 1 and len(err) < 300
    assert paused_of(run, "sync") is None


def test_a_reason_with_control_characters_is_kept_escaped_and_shown_on_one_line(run):
    code, out, _ = run("pause", "sync", "--reason", "line one\nFAKE LOG LINE\x1b[2J")
    assert code == 0 and out.count("\n") == 2 and "\x1b" not in out
    assert paused_of(run, "sync")["reason"] == "line one\nFAKE LOG LINE\x1b[2J"
