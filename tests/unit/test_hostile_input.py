"""Hostile and mistaken input: one clear line, exit 2, no traceback, no secret printed.

Each bad input is checked in-process against `check`, `jobs`, `status` and
`history` (cheap), and a representative subset against real `python -m
scheduler run` and `check` processes, which must exit 2 before starting.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
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
ONE_JOB = "jobs:\n  close_invoices:\n    interval: 5m\n"


@dataclass(frozen=True)
class Case:
    """A project that must be refused: exit 2, one line naming `expect`, none of `secrets`."""

    config: str | bytes = ONE_JOB
    env: dict[str, str] = field(default_factory=dict)
    jobs: dict[str, str] = field(default_factory=dict)
    outside: dict[str, str] = field(default_factory=dict)  # files beside, not in, jobs/
    links: dict[str, str] = field(default_factory=dict)  # jobs/<name> -> target
    expect: tuple[str, ...] = ()
    secrets: tuple[str, ...] = ()


def _setting(name: str, value: str) -> str:
    return f"scheduler:\n  {name}: {value}\n" + ONE_JOB


def _job_field(name: str, value: str) -> str:
    return ONE_JOB + f"    {name}: {value}\n"


def _interval(value: str) -> str:
    return f"jobs:\n  close_invoices:\n    interval: {value}\n"


def _url(url: str, *expect: str, secrets: tuple[str, ...] = ()) -> Case:
    return Case(
        env={"SCHEDULER_DATABASE_URL": url},
        expect=("SCHEDULER_DATABASE_URL", *expect),
        secrets=secrets,
    )


def _bomb(levels: int) -> str:
    """The "billion laughs": each anchored list holds ten aliases of the one before."""
    lines = ["    cron:", "      - &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for level in range(1, levels):
        refs = ", ".join([f"*l{level - 1}"] * 10)
        lines.append(f"      - &l{level} [{refs}]")
    return ONE_JOB + "\n".join(lines) + "\n"


PING = "https://hc-ping.com{port}/5e1c0ffe-secret-uuid"
HOOK = "https://hooks.slack.com{port}/services/T0/B0/XXSECRETXX"
RANGE_INTERVAL = ("jobs.close_invoices.interval", "between 1 s and 3650 days")

CASES: dict[str, Case] = {
    # 1. Database URLs: refused at configuration time, the password never shown.
    "password with @ and #": _url(
        "postgresql://postgres:p@ss#w:rd@127.0.0.1/db",
        "percent-encoded",
        "%40",
        secrets=("ss#w", "p@ss", "w:rd"),
    ),
    "password with a bad percent escape": _url(
        "postgresql://u:ab%zzcret@127.0.0.1/db",
        "percent",
        secrets=("ab%zz", "zzcret"),
    ),
    "password with a slash": _url(
        "postgresql://u:pw/secret1@127.0.0.1/db", "percent-encoded", secrets=("secret1",)
    ),
    "query password with a bad escape": _url(
        "postgresql://u@127.0.0.1/db?password=se%zzcret", "percent", secrets=("zzcret",)
    ),
    "port out of range": _url(
        "postgresql://u:hunter2@127.0.0.1:99999/db", "port", secrets=("hunter2",)
    ),
    "not a postgresql URL": _url(
        "mysql://user:hunter2@db/x", "postgresql://", secrets=("hunter2",)
    ),
    "database URL in config.yaml": Case(
        config=_setting("database_url", '"postgresql://u:p@ss#word@127.0.0.1/db"'),
        expect=("config.yaml", "scheduler.database_url", "%40"),
        secrets=("ss#word", "p@ss"),
    ),
    # 2. YAML.
    "anchor and alias": Case(
        config="jobs:\n  close_invoices: &every5\n    interval: 5m\n  nightly-report: *every5\n",
        expect=("config.yaml", "line 2", "anchors and aliases"),
    ),
    "billion laughs": Case(config=_bomb(6), expect=("config.yaml", "anchors and aliases")),
    "deeply nested": Case(config="jobs: " + "[" * 10000 + "\n", expect=("config.yaml", "nested")),
    "not UTF-8": Case(
        config=b"jobs:\n  close_invoices:\n    interval: 5m # caf\xe9\n",
        expect=("config.yaml", "UTF-8", "line 3"),
    ),
    "job defined twice": Case(
        config=ONE_JOB + "  close_invoices:\n    interval: 10m\n",
        expect=("config.yaml", "'close_invoices'", "line 2", "line 4"),
    ),
    "setting given twice": Case(
        config="scheduler:\n  max_workers: 5\n  max_workers: 6\n" + ONE_JOB,
        expect=("config.yaml", "'max_workers'", "line 2", "line 3"),
    ),
    "very long value": Case(
        config=_job_field("cron", "x" * 5000),
        expect=("jobs.close_invoices.cron", "…"),
    ),
    "very long field name": Case(
        config=ONE_JOB + "    ? " + "y" * 5000 + "\n    : 1\n",  # an explicit key: any length
        expect=("jobs.close_invoices.", "unknown field", "…"),
    ),
    "number too long for Python": Case(
        config=_setting("max_workers", "1" * 5000), expect=("config.yaml", "line 2", "digits")
    ),
    "date that does not exist": Case(
        config=_job_field("start", "2020-13-45"), expect=("config.yaml", "line 4", "month")
    ),
    # 3. Numbers.
    "skip threshold beyond an integer": Case(
        config=_setting("skip_alert_after", "3000000000"),
        expect=("scheduler.skip_alert_after", "between 1 and 1000000", "3000000000"),
    ),
    "job skip threshold beyond an integer": Case(
        config=_job_field("skip_alert_after", "3000000000"),
        expect=("jobs.close_invoices.skip_alert_after", "between 1 and 1000000"),
    ),
    "fail threshold a boolean": Case(
        config=_setting("fail_alert_after", "true"),
        expect=("scheduler.fail_alert_after", "whole number"),
    ),
    "holder_timeout infinite": Case(
        config=_setting("holder_timeout", ".inf"),
        expect=("scheduler.holder_timeout", "between 2 and 3600"),
    ),
    "holder_timeout huge": Case(
        config=_setting("holder_timeout", "1.0e+12"),
        expect=("scheduler.holder_timeout", "between 2 and 3600"),
    ),
    "holder_timeout NaN from the environment": Case(
        env={"SCHEDULER_HOLDER_TIMEOUT": "nan"},
        expect=("SCHEDULER_HOLDER_TIMEOUT", "between 2 and 3600"),
    ),
    "interval 1e308": Case(config=_interval("1.0e+308"), expect=RANGE_INTERVAL),
    "interval 1e308 as text": Case(config=_interval("1e308"), expect=RANGE_INTERVAL),
    "interval infinite": Case(config=_interval(".inf"), expect=RANGE_INTERVAL),
    "interval NaN": Case(config=_interval(".nan"), expect=RANGE_INTERVAL),
    "interval a microsecond": Case(config=_interval("0.000001"), expect=RANGE_INTERVAL),
    "interval below a microsecond": Case(config=_interval("0.0000001"), expect=RANGE_INTERVAL),
    "interval of centuries": Case(config=_interval("4000d"), expect=RANGE_INTERVAL),
    "interval beyond timedelta": Case(config=_interval("99999999999999d"), expect=RANGE_INTERVAL),
    "interval a boolean": Case(config=_interval("true"), expect=("jobs.close_invoices.interval",)),
    "misfire_grace setting infinite": Case(
        config=_setting("misfire_grace", ".inf"), expect=("scheduler.misfire_grace", "86400")
    ),
    "misfire_grace job field of two days": Case(
        config=_job_field("misfire_grace", "2d"),
        expect=("jobs.close_invoices.misfire_grace", "1 day"),
    ),
    "misfire_grace job field infinite": Case(
        config=_job_field("misfire_grace", ".inf"),
        expect=("jobs.close_invoices.misfire_grace", "1 day"),
    ),
    "shutdown_grace NaN": Case(
        config=_setting("shutdown_grace", ".nan"),
        expect=("scheduler.shutdown_grace", "between 0 and 86400"),
    ),
    "retention_days infinite": Case(
        config=_setting("retention_days", ".inf"), expect=("scheduler.retention_days", "36500")
    ),
    "max_workers huge": Case(
        config=_setting("max_workers", "20000"),
        expect=("scheduler.max_workers", "between 1 and 10000"),
    ),
    "max_workers a boolean": Case(
        config=_setting("max_workers", "true"), expect=("scheduler.max_workers", "whole number")
    ),
    "http_port a boolean": Case(
        config=_setting("http_port", "true"), expect=("scheduler.http_port", "whole number")
    ),
    # 4. Notice URLs: the webhook is never echoed; a ping URL shows its scheme and host only.
    "ping_url port out of range": Case(
        config=_job_field("ping_url", PING.format(port=":99999")),
        expect=("jobs.close_invoices.ping_url", "port"),
        secrets=("5e1c0ffe",),
    ),
    "ping_url without a host": Case(
        config=_job_field("ping_url", "https:///5e1c0ffe-secret-uuid"),
        expect=("jobs.close_invoices.ping_url", "host"),
        secrets=("5e1c0ffe",),
    ),
    "ping_url not http": Case(
        config=_job_field("ping_url", "ftp://hc-ping.com/5e1c0ffe-secret-uuid"),
        expect=("jobs.close_invoices.ping_url", "http"),
        secrets=("5e1c0ffe",),
    ),
    "webhook port out of range": Case(
        config=_setting("alert_webhook_url", HOOK.format(port=":99999")),
        expect=("scheduler.alert_webhook_url", "port"),
        secrets=("XXSECRETXX", "T0/B0", "hooks.slack"),
    ),
    "webhook without a scheme": Case(
        env={"SCHEDULER_ALERT_WEBHOOK_URL": "hooks.slack.com/services/T0/B0/XXSECRETXX"},
        expect=("SCHEDULER_ALERT_WEBHOOK_URL", "http"),
        secrets=("XXSECRETXX", "T0/B0"),
    ),
    # 5. A misspelled setting never echoes its value.
    "misspelled database_url": Case(
        config=_setting("database_uri", "postgresql://u:secret@127.0.0.1/db"),
        expect=("scheduler.database_uri", "unknown setting", "database_url"),
        secrets=("secret",),
    ),
    # 6. Instance names.
    "instance name with slashes": Case(
        env={"SCHEDULER_INSTANCE_NAME": "../../tmp/x"},
        expect=("SCHEDULER_INSTANCE_NAME", "letters, digits"),
    ),
    "instance name not ASCII": Case(
        env={"SCHEDULER_INSTANCE_NAME": "réplica-1"},
        expect=("SCHEDULER_INSTANCE_NAME", "letters, digits"),
    ),
    "instance name too long": Case(
        env={"SCHEDULER_INSTANCE_NAME": "r" * 64}, expect=("SCHEDULER_INSTANCE_NAME", "63")
    ),
    # 8. A bare @job.
    "bare @job": Case(
        jobs={"bare.py": "from scheduler import job\n\n@job\ndef forgotten(ctx):\n    pass\n"},
        expect=("bare.py", "forgotten", "@job(key="),
    ),
    # 10. Job files linked from outside the jobs folder.
    "job file linked from outside": Case(
        outside={"elsewhere.py": "from scheduler import job\n@job(key=5)\ndef far(): pass\n"},
        links={"far.py": "../elsewhere.py"},
        expect=("far.py", "elsewhere.py", "outside the jobs folder"),
    ),
}


def project(tmp_path: Path, case: Case) -> Path:
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    (jobs / "billing.py").write_text(textwrap.dedent(GOOD_JOBS))
    for name, text in case.jobs.items():
        (jobs / name).write_text(text)
    for name, text in case.outside.items():
        (tmp_path / name).write_text(text)
    for name, target in case.links.items():
        (jobs / name).symlink_to(target)
    config = tmp_path / "config.yaml"
    if isinstance(case.config, bytes):
        config.write_bytes(case.config)
    else:
        config.write_text(case.config)
    return config


def clean_environment(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for var in list(os.environ):
        if var.startswith("SCHEDULER_"):
            monkeypatch.delenv(var)
    for var, value in env.items():
        monkeypatch.setenv(var, value)


def assert_refused(case: Case, code: int, out: str, err: str) -> None:
    assert code == 2, (out, err[:2000])
    assert "Traceback" not in out + err, err[:2000]
    assert err.startswith("scheduler: ") and err.count("\n") == 1, err[:2000]
    assert len(err) < 600, f"{len(err)} characters: {err[:300]}…"
    for fragment in case.expect:
        assert fragment in err, f"{fragment!r} not in {err!r}"
    for secret in case.secrets:
        assert secret not in out + err, f"{secret!r} shown in {out + err!r}"


@pytest.mark.parametrize("command", ["check", "jobs", "status", "history"])
@pytest.mark.parametrize("name", list(CASES))
def test_refused_in_process(name, command, tmp_path, capsys, monkeypatch):
    case = CASES[name]
    config = project(tmp_path, case)
    clean_environment(monkeypatch, case.env)
    code = main([command, "--config", str(config)])
    captured = capsys.readouterr()
    assert_refused(case, code, captured.out, captured.err)


# Connection-time messages of `scheduler check`: the URL is valid, the database is not there.


def check_database(url: str, tmp_path, capsys, monkeypatch) -> tuple[int, str]:
    config = project(tmp_path, Case())
    clean_environment(monkeypatch, {"SCHEDULER_DATABASE_URL": url})
    code = main(["check", "--config", str(config)])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return code, captured.out + captured.err


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u@127.0.0.1:1/db?password=s3cr3tpw",
        "postgresql://u@127.0.0.1:1/db?sslmode=disable&sslpassword=s3cr3tpw",
        "postgresql://u:s3cr3tpw@127.0.0.1:1/db",
        "postgresql://u:s3cr3tpw@127.0.0.1:1/db?nosuchoption=1",
        "postgresql://u:s3cr3tpw@127.0.0.1:1,127.0.0.1:2/db?target_session_attrs=read-write",
    ],
)
def test_check_never_shows_the_password_when_it_cannot_connect(url, tmp_path, capsys, monkeypatch):
    code, text = check_database(url, tmp_path, capsys, monkeypatch)
    assert code == 2
    connect = [line for line in text.splitlines() if line.startswith("connect")]
    assert len(connect) == 1 and "FAIL" in connect[0], text
    assert "s3cr3tpw" not in text and "3cr3" not in text


def test_check_scrubs_the_password_from_driver_errors(tmp_path, capsys, monkeypatch):
    import scheduler.cli.checks

    def refuse(url: str, instance: str) -> None:
        raise psycopg.ProgrammingError('invalid option: "pw=s3cr3t/pw" and "s3cr3t%2Fpw"')

    monkeypatch.setattr(scheduler.cli.checks, "short_connection", refuse)
    code, text = check_database(
        "postgresql://u:s3cr3t%2Fpw@127.0.0.1:1/db", tmp_path, capsys, monkeypatch
    )
    assert code == 2 and "invalid option" in text
    assert "s3cr3t" not in text


def test_check_reports_any_error_as_one_line(tmp_path, capsys, monkeypatch):
    import scheduler.cli.checks

    def broken(url: str, instance: str) -> None:
        raise ValueError("something unexpected\nsecond line")

    monkeypatch.setattr(scheduler.cli.checks, "short_connection", broken)
    code, text = check_database("postgresql://u@127.0.0.1:1/db", tmp_path, capsys, monkeypatch)
    assert code == 2
    connect = [line for line in text.splitlines() if line.startswith("connect")]
    assert len(connect) == 1, text
    assert "FAIL" in connect[0] and connect[0].endswith("/db: something unexpected")
    assert "second line" not in text


# scheduler/config/urls.py and scheduler/observers/posting.py on their own.

GOOD_DATABASE_URLS = [
    "postgresql://u:p%40ss%23w%3Ard@db.internal:5432/app",
    "postgres://db/app",
    "postgresql+psycopg://u@db/app?sslmode=require&application_name=x",
    "postgresql://a:5432,b:5433/db?target_session_attrs=read-write",
    "postgresql://u:pw@[::1]:5432,[fe80::1]/db",
    "postgresql:///app?host=/var/run/postgresql",
    "postgresql://%2Fvar%2Frun%2Fpostgresql/app",
    "postgresql://u:pa:ss@db/app",
    "postgresql://",
]
BAD_DATABASE_URLS = {
    "postgresql://postgres:p@ss#w:rd@host/db": "%40",
    "postgresql://u:p@ss@h/db": "%40",
    "postgresql://u:ab%zz@h/db": "percent",
    "postgresql://u:abc%@h/db": "percent",
    "postgresql://u:pw@h:99999/db": "port",
    "postgresql://u:pw@h:0/db": "port",
    "postgresql://u:pw@h:/db": "port",
    "postgresql://u:pw/secret1@h/db": "percent-encoded",
    "postgresql://u:pw@a:5432,b:abc/db": "port",
    "postgresql://u:pw@h/db?port=70000": "port",
    "postgresql://u:pw@h/db?password": "=",
    "postgresql://u:p w@h/db": "space",
    "postgresql://u:pw@[::1/db": "]",
    "mysql://u:pw@h/db": "postgresql://",
    "u:pw@h/db": "postgresql://",
}


@pytest.mark.parametrize("url", GOOD_DATABASE_URLS)
def test_database_urls_accepted(url):
    from scheduler.config.urls import validate_database_url

    assert validate_database_url(url) == url


@pytest.mark.parametrize("url", list(BAD_DATABASE_URLS))
def test_database_urls_refused_without_showing_the_password(url):
    from scheduler.config.urls import validate_database_url

    with pytest.raises(ValueError) as raised:
        validate_database_url(url)
    message = str(raised.value)
    assert BAD_DATABASE_URLS[url] in message
    assert "\n" not in message
    for secret in ("ss#w", "p@ss", "ab%zz", "secret1", "p w", "abc%"):
        assert secret not in message


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://u:secret@db:5432/app", "postgresql://u:***@db:5432/app"),
        ("postgresql+psycopg://u:secret@db/app", "postgresql://u:***@db/app"),
        ("postgres://u@db/app?password=secret", "postgresql://u@db/app?password=***"),
        (
            "postgresql://u@db/app?sslmode=require&sslpassword=secret",
            "postgresql://u@db/app?sslmode=require&sslpassword=***",
        ),
        (
            "postgresql://u:secret@a:5432,b:5432/db?target_session_attrs=read-write",
            "postgresql://u:***@a:5432,b:5432/db?target_session_attrs=read-write",
        ),
        ("postgresql://u@db/app", "postgresql://u@db/app"),
        ("postgresql://postgres:p@ss#w:rd@host/db", "postgresql://…"),
        ("postgresql://u:ab%zz@h/db", "postgresql://…"),
        ("not a url: secret", "postgresql://…"),
        ("", "postgresql://…"),
    ],
)
def test_redact_database_url(url, shown):
    from scheduler.config.urls import redact_database_url

    assert redact_database_url(url) == shown


def test_scrub_removes_secrets_and_their_decoded_forms():
    from scheduler.config.urls import database_url_secrets, scrub

    url = "postgresql://u:s3cr%40t@h/db?sslpassword=k3y%2Fpass"
    secrets = database_url_secrets(url)
    text = 'failed: "s3cr@t" and s3cr%40t; key k3y/pass or k3y%2Fpass, user u'
    cleaned = scrub(text, secrets)
    assert "s3cr" not in cleaned and "k3y" not in cleaned
    assert cleaned.startswith("failed: ") and cleaned.endswith(", user u")
    assert scrub("nothing to hide", []) == "nothing to hide"


@pytest.mark.parametrize(
    "url",
    [
        "http://h:99999/x",
        "http://[::1/x",
        "nonsense",
        "ftp://h/x",
        "http:///x",
        "http://h\u00e9\u0000/x",
        "",
    ],
)
def test_posting_never_raises(url):
    from scheduler.observers.posting import post, redact_url

    assert post(url, b"{}", deadline_s=2) is not None
    shown = redact_url(url)
    assert "/x" not in shown


def test_posting_reports_a_server_that_hangs_up(tmp_path):
    import socket
    import threading

    from scheduler.observers.posting import post

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def answer_garbage() -> None:
        conn, _ = server.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort")
        conn.close()

    thread = threading.Thread(target=answer_garbage)
    thread.start()
    try:
        reason = post(f"http://127.0.0.1:{port}/secret-path", b"{}", deadline_s=10)
    finally:
        thread.join(10)
        server.close()
    assert reason is not None and "secret-path" not in reason


@pytest.mark.parametrize(
    "text",
    [
        "cannot connect to postgresql://postgres:p@ss#w:rd@host/db: refused",
        "invalid connection option: host=h password=ss#w:rd user=u",
        "postgresql://u@h/db?sslpassword=ss#w:rd&sslmode=require: no",
    ],
)
def test_one_line_hides_every_password(text):
    from scheduler.errors import one_line

    line = one_line(RuntimeError(text + "\nsecond line"))
    assert "ss#w" not in line and "rd@" not in line and "second line" not in line
    assert "***" in line


# `scheduler run` against a database that refuses it: what no retry mends ends the start.


def run_against(url: str, tmp_path: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    config = project(tmp_path, Case())
    return subprocess.run(
        [sys.executable, "-m", "scheduler", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={"PATH": "/usr/bin:/bin", "SCHEDULER_DATABASE_URL": url},
        cwd=tmp_path,
    )
