"""`history` and `status` flags: bad values are one line and exit 2; durations as people
read them; text status shows what JSON does (embedded ledger)."""

from __future__ import annotations

import pytest

from scheduler.cli.tables import duration


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (("--status", "failed,exploded"), "--status: 'failed,exploded': expected some of"),
        (("--status", ","), "--status: ','"),
        (("--since", "yesterday"), "--since: expected an age such as 12h or 30m"),
        (("--since", "12parsecs"), "--since: expected an age"),
        (("--until", "2026-13-45"), "--until: expected"),
        (
            ("--until", "0001-01-01T00:00:00+14:00"),
            "--until: '0001-01-01T00:00:00+14:00' is out of range",
        ),
        (("--since", "x" * 5000 + "\x00"), "--since: expected an age"),
        (("--tz", "Mars/Olympus"), "--tz: 'Mars/Olympus': unknown time zone"),
        (("nope",), "no job named 'nope'"),
        (("--limit", "\u00b2"), "--limit: expected a whole number from 1 to 1000000, got '\u00b2'"),
        (("--limit", "99999999999999999999999"), "--limit: expected a whole number from 1"),
        (("--limit", "0"), "--limit: expected a whole number from 1"),
        (("--limit", "1" * 5000), "--limit: expected a whole number from 1"),
        (("--until", "9999-12-31T23:59:59-14:00"), "is out of range"),
        (("--until", "0001-01-01"), "--until: '0001-01-01' is out of range"),
        (("--since", "99999999999999d"), "--since: '99999999999999d' is out of range"),
        (("--since", "\u0663h"), "--since: expected an age"),  # an Arabic-Indic three
        (("--instance", "a\x00b"), "--instance: expected a replica's name"),
        (("--instance", "r" * 64), "--instance: expected a replica's name"),
    ],
)
def test_bad_history_flags_are_one_line_and_exit_2(run, args, expect):
    code, out, err = run("history", *args)
    assert code == 2 and out == ""
    assert expect in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [(None, ""), (0.0001, "0s"), (0.004, "0.004s"), (1.2149, "1.21s"), (42.49, "42.5s"),
     (185.2, "3m05s"), (7265, "2h01m")],
)  # fmt: skip
def test_durations_are_rounded_for_people(seconds, shown):
    assert duration(seconds) == shown


def test_text_status_shows_failures_schedules_and_pauses_in_one_zone(run):
    run("pause", "report", "--by", "ops", "--reason", "audit")
    code, out, _ = run("status", "--tz", "America/New_York")
    assert code == 0
    header = next(line for line in out.splitlines() if line.startswith("JOB"))
    for column in ("SCHEDULE", "SKIPS", "FAILURES", "PAUSED", "NEXT_TICK"):
        assert column in header.split()
    sync = next(line for line in out.splitlines() if line.startswith("sync "))
    report = next(line for line in out.splitlines() if line.startswith("report "))
    assert "every 1m" in sync and "0/3" in sync and ("-05:00" in sync or "-04:00" in sync)
    assert "by ops since" in report and "audit" in report and "(paused)" in report


def test_text_status_and_history_say_what_is_known_of_a_dead_replicas_runs(run, tmp_path):
    from datetime import UTC, datetime, timedelta

    from scheduler.backends.embedded import EmbeddedBackend
    from scheduler.ledger import tables

    run("check")  # the ledger exists
    backend = EmbeddedBackend(tmp_path / "scheduler.db", instance="t", namespace=0)
    backend.migrate()
    at = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=5)
    base = {"instance": "gone-1", "started_at": at, "run_id": 1, "duration_s": None}
    with backend.ledger_engine.begin() as conn:
        conn.execute(
            tables.ticks.insert(),
            [
                {**base, "job_key": 2001, "job_name": "sync", "scheduled_at": at,
                 "status": "running"},
                {**base, "job_key": 2002, "job_name": "report", "scheduled_at": at,
                 "status": "crashed", "duration_s": 185.0},
            ],
        )  # fmt: skip
    backend.ledger_engine.dispose()
    code, out, _ = run("status")
    sync = next(line for line in out.splitlines() if line.startswith("sync "))
    assert code == 0 and "on gone-1 since" in sync and "replica gone, not yet marked" in sync
    code, out, _ = run("history", "report")
    assert code == 0 and "at least 3m05s" in out
