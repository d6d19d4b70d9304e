"""The page's JSON API over real HTTP and PostgreSQL (docs/operating.md: The page):
`/api/history` answers what `scheduler history --json` answers for the same filters; a
script's POST (a bearer token) is answered its outcome as JSON; every error of `/api/*`
is JSON; `status --json` and `/api/status` link each job's page (`job_url`)."""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from urllib.parse import urlencode

import pytest

from scheduler.cli.commands import main
from scheduler.config.settings import load_config
from scheduler.ledger import tables
from scheduler.registry.catalog import load_catalog
from scheduler.web import mount
from scheduler.web.server import HealthServer
from tests.unit.conftest import two_jobs
from tests.unit.test_page_views import TOKEN

STATUSES = ["succeeded", "failed", "skipped", "missed", "crashed", "succeeded"]


@pytest.fixture
def api(tmp_path, monkeypatch, database_url) -> Iterator[str]:
    """The page of a two-job project on its own port, over PostgreSQL with 600 ticks of
    the last hour (sync and report, from r1, r2 and r3); its base URL."""
    path = two_jobs(tmp_path, monkeypatch)
    monkeypatch.setenv("SCHEDULER_DATABASE_URL", database_url)
    monkeypatch.setenv("SCHEDULER_INSTANCE_NAME", "api-1")
    monkeypatch.setenv("SCHEDULER_HTTP_TOKEN", TOKEN)
    monkeypatch.chdir(tmp_path)
    config = load_config(path)
    catalog = load_catalog(config)
    from scheduler.backends import open_backend

    backend = open_backend(config.settings)
    backend.migrate()
    rng = random.Random(11)
    now = datetime.now(UTC).replace(microsecond=0)
    rows = [
        {
            "job_key": key,
            "job_name": name,
            "scheduled_at": now - timedelta(seconds=12 * i),
            "status": rng.choice(STATUSES),
            "instance": rng.choice(["r1", "r2", "r3"]),
        }
        for i in range(300)
        for key, name in ((2001, "sync"), (2002, "report"))
    ]
    with backend.ledger_engine.begin() as conn:
        conn.execute(tables.ticks.insert(), rows)
    server = HealthServer("127.0.0.1", 0, live=lambda: True, ready=lambda: True, metrics=bytes)
    mount(server, backend, lambda: catalog, config.settings)
    server.start()
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        server.stop()
        backend.ledger_engine.dispose()


def call(url: str, form: dict[str, str] | None = None, **headers: str):
    """(status, content type, the JSON or text answered) of a GET, or a POST of `form`."""
    body = None if form is None else urlencode(form).encode()
    request = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            status, kind, data = reply.status, reply.headers["Content-Type"], reply.read()
    except urllib.error.HTTPError as error:
        status, kind, data = error.code, error.headers["Content-Type"], error.read()
    return status, kind, json.loads(data) if kind == "application/json" else data.decode()


def command(*args: str, capsys) -> object:
    assert main([*args, "--config", "config.yaml", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_fleet_history_answers_what_the_history_command_does(api, capsys):
    now = datetime.now(UTC)
    since, until = (now - timedelta(minutes=m) for m in (30, 20))
    asked = [
        ({}, []),  # the newest 50
        ({"status": "failed,crashed", "since": since.isoformat()}, ["--status", "failed,crashed"]),
        ({"instance": "r2", "until": until.isoformat(), "limit": "7"}, ["--instance", "r2"]),
        ({"job": "sync", "status": "skipped", "until": until.isoformat()}, ["sync"]),
    ]
    for query, flags in asked:
        status, kind, rows = call(f"{api}/api/history?{urlencode(query)}")
        assert (status, kind) == (200, "application/json"), rows
        for name in ("since", "until", "status", "limit"):
            if name in query and f"--{name}" not in flags:
                flags = [*flags, f"--{name}", query[name]]
        expected = command("history", *flags, capsys=capsys)
        assert rows == expected and rows, query
    _, _, rows = call(f"{api}/api/history?since=2h")  # a span without a limit: all of it,
    assert len(rows) == 600  # up to 1000


def test_api_errors_are_json_with_one_line(api):
    for target, code, said in (
        ("/api/history?status=nope", 400, "status: 'nope': expected some of"),
        ("/api/history?since=yesterday", 400, "since: expected an age"),
        ("/api/history?limit=5000", 400, "limit: expected a whole number from 1 to 1000"),
        ("/api/history?job=nope", 404, "no such job"),
        ("/api/jobs/nope/history", 404, "no such job"),
        ("/api/nothing-here", 404, "not found"),
    ):
        status, kind, answer = call(api + target)
        assert (status, kind) == (code, "application/json"), (target, answer)
        assert said in answer["error"], (target, answer)
    status, kind, answer = call(f"{api}/api/status", {})  # a POST where only GET is served
    assert (status, kind, answer) == (405, "application/json", {"error": "method not allowed"})
    status, kind, _ = call(f"{api}/jobs/nope")  # the page's own errors stay pages
    assert status == 404 and kind.startswith("text/html")


def test_a_script_is_answered_the_outcome_of_its_post_as_json(api):
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    status, kind, outcome = call(f"{api}/jobs/sync/pause", {"reason": "upgrade"}, **bearer)
    assert (status, kind) == (200, "application/json")
    assert outcome == {
        "job": "sync",
        "action": "pause",
        "done": "paused",
        "said": "Paused for the fleet.",
        "page": "/jobs/sync?done=paused",
    }
    assert call(f"{api}/jobs/sync/pause", {}, **bearer)[2]["done"] == "already"
    assert call(f"{api}/jobs/sync/resume", {}, **bearer)[2]["done"] == "resumed"
    # Refusals too: no live replica takes a run now; a wrong token; no such job.
    status, kind, answer = call(f"{api}/jobs/sync/run", {}, **bearer)
    assert (status, kind) == (400, "application/json")
    assert answer["error"].startswith("sync: not run: no live replica runs it")
    wrong = {"Authorization": "Bearer " + "x" * 32}
    status, _, answer = call(f"{api}/jobs/sync/pause", {}, **wrong)
    assert status == 403 and "log in with the token first" in answer["error"]
    assert call(f"{api}/jobs/nope/pause", {}, **bearer)[:2] == (404, "application/json")
    # A browser's form without a session is still answered a page.
    status, kind, _ = call(f"{api}/jobs/sync/pause", {"reason": "x"})
    assert status == 403 and kind.startswith("text/html")


def test_status_links_each_job_to_its_page(api, capsys):
    listed = command("status", capsys=capsys)
    assert isinstance(listed, dict)
    assert {j["name"]: j["job_url"] for j in listed["jobs"]} == {
        "sync": "/jobs/sync",
        "report": "/jobs/report",
    }
    _, _, answered = call(f"{api}/api/status")
    for job in answered["jobs"]:
        status, kind, _ = call(api + job["job_url"])
        assert status == 200 and kind.startswith("text/html")
