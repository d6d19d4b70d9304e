"""Bad input exits 2 with one clear message naming the file, job, field and value."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest

from scheduler.cli.commands import main

GOOD_JOBS = """
from scheduler import job

@job(key=1001)
def close_invoices(ctx):
    pass

@job(key=1002, name="nightly-report")
async def report(ctx):
    pass
"""


def project(tmp_path: Path, config: str, jobs: str = GOOD_JOBS, extra: dict | None = None):
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "billing.py").write_text(textwrap.dedent(jobs))
    for name, text in (extra or {}).items():
        (tmp_path / "jobs" / name).write_text(textwrap.dedent(text))
    (tmp_path / "config.yaml").write_text(textwrap.dedent(config))
    return tmp_path / "config.yaml"


def check(config: Path, capsys, monkeypatch) -> tuple[int, str]:
    for var in ("SCHEDULER_DATABASE_URL", "SCHEDULER_CONFIG", "SCHEDULER_JOBS_PATH"):
        monkeypatch.delenv(var, raising=False)
    code = main(["check", "--config", str(config)])
    return code, capsys.readouterr().err


CASES = {
    "unknown job field": (
        "jobs:\n  close_invoices:\n    interval: 5m\n    intervall: 10m\n",
        ["jobs.close_invoices.intervall", "unknown field"],
    ),
    "unknown setting": (
        "scheduler:\n  skip_alert_afer: 3\njobs: {}\n",
        ["scheduler.skip_alert_afer", "unknown setting"],
    ),
    "unknown top-level field": ("schedulr: {}\n", ["schedulr"]),
    "bad cron": (
        'jobs:\n  nightly-report:\n    cron: "0 2 * *"\n',
        ["jobs.nightly-report.cron", "5 fields", "0 2 * *"],
    ),
    "bad cron value": (
        'jobs:\n  nightly-report:\n    cron: "0 25 * * *"\n',
        ["jobs.nightly-report.cron", "0 25 * * *"],
    ),
    "bad interval": (
        "jobs:\n  close_invoices:\n    interval: 5x\n",
        ["jobs.close_invoices.interval", "5x"],
    ),
    "zero interval": (
        "jobs:\n  close_invoices:\n    interval: 0\n",
        ["jobs.close_invoices.interval", "longer than zero"],
    ),
    "unknown time zone": (
        'jobs:\n  nightly-report:\n    cron: "0 2 * * *"\n    timezone: Mars/Olympus\n',
        ["jobs.nightly-report.timezone", "Mars/Olympus", "unknown time zone"],
    ),
    "unknown default time zone": (
        "scheduler:\n  timezone: Nowhere/City\njobs: {}\n",
        ["scheduler.timezone", "Nowhere/City"],
    ),
    "both cron and interval": (
        'jobs:\n  close_invoices:\n    interval: 5m\n    cron: "* * * * *"\n',
        ["jobs.close_invoices", "exactly one of `cron` or `interval`"],
    ),
    "neither cron nor interval": (
        "jobs:\n  close_invoices:\n    enabled: true\n",
        ["jobs.close_invoices", "exactly one of `cron` or `interval`"],
    ),
    "job that does not exist": (
        "jobs:\n  close_invoice:\n    interval: 5m\n",
        ["jobs.close_invoice", "no job named 'close_invoice'", "close_invoices"],
    ),
    "broken yaml": (
        "jobs:\n  close_invoices:\n    interval: [5m\n",
        ["config.yaml", "invalid YAML", "line"],
    ),
    "bad setting type": (
        "scheduler:\n  holder_timeout: soon\njobs: {}\n",
        ["scheduler.holder_timeout", "soon"],
    ),
    "bad skip threshold": (
        "jobs:\n  close_invoices:\n    interval: 5m\n    skip_alert_after: 0\n",
        ["jobs.close_invoices.skip_alert_after", "0"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_config_exits_2_with_a_clear_message(case, tmp_path, capsys, monkeypatch):
    text, expected = CASES[case]
    code, err = check(project(tmp_path, text), capsys, monkeypatch)
    assert code == 2
    assert "Traceback" not in err
    assert err.startswith("scheduler: ") and "config.yaml" in err
    for fragment in expected:
        assert fragment in err, f"{fragment!r} not in {err!r}"


JOB_CASES = {
    "module fails to import": (
        {"broken.py": "import nonexistent_module_xyz\n"},
        GOOD_JOBS,
        ["broken.py", "failed to import", "ModuleNotFoundError", "nonexistent_module_xyz"],
    ),
    "syntax error": (
        {"broken.py": "def f(:\n"},
        GOOD_JOBS,
        ["broken.py", "SyntaxError", "line 1"],
    ),
    "key out of range": (
        {"big.py": "from scheduler import job\n@job(key=2147483648)\ndef big(): pass\n"},
        GOOD_JOBS,
        ["big.py", "big", "between 1 and 2147483647", "2147483648"],
    ),
    "key not a number": (
        {"k.py": "from scheduler import job\n@job(key='7')\ndef seven(): pass\n"},
        GOOD_JOBS,
        ["k.py", "seven", "whole number", "'7'"],
    ),
    "duplicate key": (
        {"other.py": "from scheduler import job\n@job(key=1001)\ndef other(): pass\n"},
        GOOD_JOBS,
        ["job key 1001 is used twice", "close_invoices", "other", "billing.py", "other.py"],
    ),
    "duplicate name": (
        {
            "other.py": "from scheduler import job\n@job(key=7, name='nightly-report')\n"
            "def other(): pass\n"
        },
        GOOD_JOBS,
        ["job name 'nightly-report' is used twice", "billing.py", "other.py"],
    ),
    "bad name": (
        {"n.py": "from scheduler import job\n@job(key=8, name='a b')\ndef n(): pass\n"},
        GOOD_JOBS,
        ["n.py", "'a b'", "letters, digits"],
    ),
    "too many parameters": (
        {"p.py": "from scheduler import job\n@job(key=9)\ndef two(a, b): pass\n"},
        GOOD_JOBS,
        ["p.py", "two", "no argument or one"],
    ),
}


@pytest.mark.parametrize("case", list(JOB_CASES))
def test_bad_jobs_exit_2_with_a_clear_message(case, tmp_path, capsys, monkeypatch):
    extra, jobs, expected = JOB_CASES[case]
    config = project(tmp_path, "jobs: {}\n", jobs=jobs, extra=extra)
    code, err = check(config, capsys, monkeypatch)
    assert code == 2
    assert "Traceback" not in err
    for fragment in expected:
        assert fragment in err, f"{fragment!r} not in {err!r}"


def test_environment_errors_name_the_variable(tmp_path, capsys, monkeypatch):
    config = project(tmp_path, "jobs: {}\n")
    monkeypatch.setenv("SCHEDULER_MAX_WORKERS", "many")
    code = main(["check", "--config", str(config)])
    err = capsys.readouterr().err
    assert code == 2
    assert "SCHEDULER_MAX_WORKERS" in err and "many" in err


def test_secrets_are_never_echoed(tmp_path, capsys, monkeypatch):
    config = project(tmp_path, "jobs: {}\n")
    monkeypatch.setenv("SCHEDULER_DATABASE_URL", "mysql://user:hunter2@db/x")
    code = main(["check", "--config", str(config)])
    err = capsys.readouterr().err
    assert code == 2
    assert "SCHEDULER_DATABASE_URL" in err and "hunter2" not in err


def test_missing_config_file(tmp_path, capsys, monkeypatch):
    code, err = check(tmp_path / "nope.yaml", capsys, monkeypatch)
    assert code == 2 and "nope.yaml" in err and "not found" in err


def test_a_real_process_prints_no_traceback(tmp_path):
    config = project(tmp_path, "jobs:\n  close_invoices:\n    interval: 5x\n")
    result = subprocess.run(
        [sys.executable, "-m", "scheduler", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "jobs.close_invoices.interval" in result.stderr and "5x" in result.stderr


def test_a_good_config_checks_clean(tmp_path, capsys, monkeypatch):
    config = project(
        tmp_path,
        "scheduler:\n  skip_alert_after: 4\njobs:\n  close_invoices:\n    interval: 1h30m\n"
        '  nightly-report:\n    cron: "0 2 * * 1-5"\n    timezone: Europe/Berlin\n',
    )
    code, _ = check(config, capsys, monkeypatch)
    assert code == 0


def load(tmp_path: Path, config: str, monkeypatch, **env: str):
    from scheduler.config.settings import load_config

    for var in [v for v in os.environ if v.startswith("SCHEDULER_")]:
        monkeypatch.delenv(var)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    return load_config(str(project(tmp_path, config)))


def test_log_format_in_any_case(tmp_path, monkeypatch):
    config = load(tmp_path, "scheduler:\n  log_format: JSON\njobs: {}\n", monkeypatch)
    assert config.settings.log_format == "json"


def test_log_format_from_the_environment_in_any_case(tmp_path, monkeypatch):
    config = load(tmp_path, "jobs: {}\n", monkeypatch, SCHEDULER_LOG_FORMAT="Text")
    assert config.settings.log_format == "text"


def test_the_ends_of_every_range_are_accepted(tmp_path, monkeypatch):
    config = load(
        tmp_path,
        "scheduler:\n  skip_alert_after: 1000000\n  fail_alert_after: 1\n"
        "  holder_timeout: 3600\n  shutdown_grace: 0\n  misfire_grace: 86400\n"
        "  retention_days: 36500\n  max_workers: 10000\n  http_port: 65535\n"
        "jobs:\n  close_invoices:\n    interval: 1s\n    misfire_grace: 1d\n"
        "  nightly-report:\n    interval: 3650d\n    skip_alert_after: 1000000\n",
        monkeypatch,
        SCHEDULER_HOLDER_TIMEOUT="2",
    )
    settings = config.settings
    assert settings.holder_timeout == 2  # the environment wins over config.yaml
    assert (settings.skip_alert_after, settings.max_workers, settings.http_port) == (
        1_000_000,
        10_000,
        65535,
    )
    assert (settings.shutdown_grace, settings.misfire_grace, settings.retention_days) == (
        0,
        86400,
        36500,
    )
    assert config.jobs["close_invoices"].interval == timedelta(seconds=1)
    assert config.jobs["close_invoices"].misfire_grace == timedelta(days=1)
    assert config.jobs["nightly-report"].interval == timedelta(days=3650)


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://a:5432,b:5432/db?target_session_attrs=read-write",
        "postgresql://scheduler:p%40ss%23w%3Ard@db.internal:5432/app",
        "postgres://db/app?sslmode=require&password=x",
        "postgresql+psycopg://[::1]:5432/app",
    ],
)
def test_good_database_urls_are_accepted(url, tmp_path, monkeypatch):
    config = load(tmp_path, "jobs: {}\n", monkeypatch, SCHEDULER_DATABASE_URL=url)
    assert config.settings.database_url is not None
    assert config.settings.database_url.get_secret_value() == url


def test_the_default_instance_name_is_a_valid_one(monkeypatch):
    import socket

    from scheduler.config.settings import INSTANCE_NAME, Settings, default_instance_name

    monkeypatch.setattr(socket, "gethostname", lambda: "rack 7/nœud.example" + "x" * 80)
    name = default_instance_name()
    assert INSTANCE_NAME.fullmatch(name), name
    assert name.startswith("rack-7-n-ud.example") and name.endswith(f"-{os.getpid()}")
    for var in [v for v in os.environ if v.startswith("SCHEDULER_")]:
        monkeypatch.delenv(var)
    assert Settings().instance_name == name


def test_an_unknown_environment_variable_is_never_echoed(tmp_path, capsys, monkeypatch):
    config = project(tmp_path, "jobs: {}\n")
    for var in [v for v in os.environ if v.startswith("SCHEDULER_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("SCHEDULER_DATABASE_URI", "postgresql://u:s3cr3tpw@db/app")
    main(["check", "--config", str(config)])
    captured = capsys.readouterr()
    assert "s3cr3tpw" not in captured.out + captured.err


def test_the_version_is_one_line(capsys):
    from scheduler import __version__

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"scheduler {__version__}"
