"""One base for the errors the scheduler tells its user (`SchedulerError`): configuration
problems are `ConfigError`, a ledger that fails a command is `LedgerError`; the command
line shows each in one line and keeps its exit status (2, as SPEC says)."""

from __future__ import annotations

import pytest
from sqlalchemy.exc import OperationalError

import scheduler
from scheduler.backends.embedded import EmbeddedBackend
from scheduler.cli import commands as cli
from scheduler.config.parsing import Refused
from scheduler.errors import ConfigError, LedgerError, PoolerError, SchedulerError
from scheduler.fleet import pauses
from scheduler.fleet.housekeeping import NameInUse
from tests.unit.test_page_views import TOKEN, ask


def broken(*_args, **_kwargs):
    raise OperationalError("SELECT 1", {}, Exception("server closed the connection"))


def test_every_error_told_to_the_user_is_a_scheduler_error():
    for kind in (ConfigError, PoolerError, LedgerError, NameInUse, Refused):
        assert issubclass(kind, SchedulerError)
    assert not issubclass(LedgerError, ConfigError)  # a failing database is no bad config
    assert (scheduler.SchedulerError, scheduler.ConfigError) == (SchedulerError, ConfigError)


@pytest.mark.parametrize(
    ("command", "said"),
    [
        ("pause", "scheduler: cannot pause sync: server closed the connection\n"),
        ("resume", "scheduler: cannot resume sync: server closed the connection\n"),
    ],
)
def test_a_ledger_failing_a_pause_is_a_ledger_error_shown_in_one_line_exit_2(
    run, monkeypatch, tmp_path, command, said
):
    monkeypatch.setattr(pauses, command, broken)
    config = str(tmp_path / "config.yaml")
    with pytest.raises(LedgerError):
        cli._dispatch(cli._parser().parse_args([command, "sync", "--config", config]))
    assert run(command, "sync") == (2, "", said)


def test_an_unreachable_ledger_is_a_ledger_error_shown_in_one_line_exit_2(
    run, monkeypatch, tmp_path
):
    monkeypatch.setattr(EmbeddedBackend, "migrate", broken)
    config = str(tmp_path / "config.yaml")
    with pytest.raises(LedgerError):
        cli._dispatch(cli._parser().parse_args(["status", "--config", config]))
    said = "scheduler: cannot reach the ledger: server closed the connection\n"
    assert run("status") == (2, "", said)


def test_configuration_errors_stay_config_errors_exit_2(run, tmp_path):
    (tmp_path / "config.yaml").write_text("jobs: [1]\n")
    config = str(tmp_path / "config.yaml")
    with pytest.raises(ConfigError):
        cli._dispatch(cli._parser().parse_args(["check", "--config", config]))
    code, out, err = run("check")
    assert (code, out) == (2, "") and "jobs: must be a mapping" in err


def test_the_page_refuses_an_action_the_ledger_failed_with_its_message(project, monkeypatch):
    page = project(SCHEDULER_HTTP_TOKEN=TOKEN)
    monkeypatch.setattr(pauses, "pause", broken)
    reply = ask(page, "POST", "/jobs/sync/pause", "", authorization=f"Bearer {TOKEN}")
    assert reply.status == 400 and b"cannot pause sync: the ledger did not answer" in reply.body
