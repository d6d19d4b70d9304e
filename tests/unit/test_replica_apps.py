"""`Replica.asgi()` and `Replica.wsgi()`: the page, /api, /metrics and the probes under a
mount prefix, with the token rules of the replica's own server; called in-process (the
recipes with real servers: tests/integration/test_recipes.py)."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlencode

import pytest

from scheduler import Replica
from tests.unit.test_replica import project

TOKEN = "t" * 32


def asgi_get(
    app: Any,
    path: str,
    root: str = "/scheduler",
    method: str = "GET",
    body: bytes = b"",
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """One request as a server mounting the app at `root` hands it over (path with the root,
    as the ASGI spec says)."""
    target, _, query = path.partition("?")
    scope = {
        "type": "http",
        "method": method,
        "path": root + target,
        "raw_path": (root + target).encode(),
        "root_path": root,
        "query_string": query.encode(),
        "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
        "client": ("127.0.0.1", 5000),
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start, reply = sent
    found = {k.decode(): v.decode() for k, v in start["headers"]}
    return start["status"], found, reply["body"]


def wsgi_get(
    app: Any,
    path: str,
    root: str = "/scheduler",
    method: str = "GET",
    body: bytes = b"",
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    target, _, query = path.partition("?")
    environ: dict[str, Any] = {
        "REQUEST_METHOD": method,
        "SCRIPT_NAME": root,
        "PATH_INFO": target,
        "QUERY_STRING": query,
        "REMOTE_ADDR": "127.0.0.1",
        "wsgi.input": io.BytesIO(body),
        "CONTENT_LENGTH": str(len(body)) if body else "",
    }
    for name, value in (headers or {}).items():
        environ["HTTP_" + name.upper().replace("-", "_")] = value
    said: list[Any] = []
    chunks = app(environ, lambda status, pairs: said.extend([status, pairs]))
    return int(said[0].split()[0]), {k.lower(): v for k, v in said[1]}, b"".join(chunks)


CALLS = [asgi_get, wsgi_get]


@pytest.fixture
def replica(tmp_path, monkeypatch) -> Iterator[Replica]:
    config = project(tmp_path, monkeypatch)
    subject = Replica(config=config, host_lock=str(tmp_path / "host.lock"), http_token=TOKEN)
    with subject:
        yield subject


def apps(replica: Replica) -> list[tuple[Any, Any]]:
    return [(replica.asgi(), asgi_get), (replica.wsgi(), wsgi_get)]


def test_probes_and_metrics_answer_under_the_prefix(replica):
    for app, get in apps(replica):
        assert get(app, "/healthz")[0::2] == (200, b"ok\n")
        assert get(app, "/readyz")[0::2] == (200, b"ok\n")
        status, headers, body = get(app, "/metrics")
        assert status == 200 and headers["content-type"].startswith("text/plain")
        assert b"scheduler_job_runs_total" in body
        assert b"scheduler_replica_active 1\n" in body


def test_the_page_links_forms_and_assets_follow_the_prefix(replica):
    for app, get in apps(replica):
        status, _, body = get(app, "/")
        assert status == 200
        page = body.decode()
        assert 'href="/scheduler/static/page.css"' in page
        assert 'href="/scheduler/jobs/tick"' in page
        assert 'href="/jobs/' not in page and 'action="/' not in page.replace("/scheduler/", "")
        assert get(app, "/static/page.css")[0] == 200
        status, _, body = get(app, "/jobs/tick")
        assert status == 200 and 'href="/scheduler/login?next=/jobs/tick"' in body.decode()
        status, headers, _ = get(app, "", root="/scheduler")
        assert (status, headers["location"]) == (308, "/scheduler/")


def test_actions_need_the_token_and_answer_under_the_prefix(replica):
    for app, get in apps(replica):
        form = urlencode({"reason": "maintenance"}).encode()
        kind = {"content-type": "application/x-www-form-urlencoded"}
        status, _, _ = get(app, "/jobs/tick/pause", method="POST", body=form, headers=kind)
        assert status == 403
        wrong = {**kind, "authorization": "Bearer " + "w" * 32}
        status, headers, body = get(
            app, "/jobs/tick/pause", method="POST", body=form, headers=wrong
        )
        assert (status, headers["content-type"]) == (403, "application/json")
        assert "log in with the token first" in json.loads(body)["error"]
        bearer = {**kind, "authorization": f"Bearer {TOKEN}"}
        status, headers, body = get(
            app, "/jobs/tick/pause", method="POST", body=form, headers=bearer
        )
        assert status == 200 and "location" not in headers
        assert json.loads(body)["page"].startswith("/scheduler/jobs/tick?done=")
        get(app, "/jobs/tick/resume", method="POST", body=form, headers=bearer)


def test_the_api_under_the_prefix_links_each_job_and_answers_errors_as_json(replica):
    for app, get in apps(replica):
        status, _, body = get(app, "/api/status")
        (tick,) = [job for job in json.loads(body)["jobs"] if job["name"] == "tick"]
        assert (status, tick["job_url"]) == (200, "/scheduler/jobs/tick")
        assert get(app, tick["job_url"].removeprefix("/scheduler"))[0] == 200
        for path, method, code in (("/api/nope", "GET", 404), ("/api/status", "POST", 405)):
            status, headers, body = get(app, path, method=method)
            assert (status, headers["content-type"]) == (code, "application/json")
            assert json.loads(body)["error"]
        status, _, body = get(app, "/api/history?job=tick&limit=5")
        assert status == 200 and isinstance(json.loads(body), list)


def test_reading_behind_the_token_with_http_protect_all(tmp_path, monkeypatch):
    config = project(tmp_path, monkeypatch)
    replica = Replica(config=config, host_lock="off", http_token=TOKEN, http_protect="all")
    with replica:
        for app, get in apps(replica):
            status, headers, _ = get(app, "/")
            location = headers.get("location")
            assert (status, location) == (303, "/scheduler/login?next=/")
            assert get(app, "/api/status")[0] == 401
            bearer = {"authorization": f"Bearer {TOKEN}"}
            assert get(app, "/api/status", headers=bearer)[0] == 200
            assert get(app, "/healthz")[0] == 200  # the probes stay open


def test_a_standby_says_so_and_a_stopped_replica_is_unavailable(replica, tmp_path):
    assert replica.config is not None
    standby = Replica(
        config=replica.config.path, host_lock=str(tmp_path / "host.lock"), instance_name="b"
    ).start()
    try:
        assert standby.standby
        for app, get in apps(replica):  # the active replica's page names the standby
            status, _, body = get(app, "/api/status")
            assert status == 200 and json.loads(body)["standbys"] == ["b"]
            assert "On standby on this replica's host" in get(app, "/")[2].decode()
        for app, get in apps(standby):
            assert get(app, "/healthz")[0::2] == (200, b"standby\n")
            assert get(app, "/readyz")[0::2] == (200, b"standby\n")
            assert b"scheduler_replica_active 0\n" in get(app, "/metrics")[2]
            status, _, body = get(app, "/api/status")  # read from the ledger, on demand
            assert status == 200 and b'"tick"' in body
    finally:
        standby.stop()
    for app, get in apps(standby):
        assert get(app, "/healthz")[0::2] == (503, b"stopped\n")
        assert get(app, "/")[0] == 503
        assert get(app, "/nowhere")[0] == 404


def test_bodies_beyond_the_budget_and_other_methods_are_refused(replica):
    for app, get in apps(replica):
        assert get(app, "/jobs/tick/pause", method="POST", body=b"x" * 20_000)[0] == 413
        assert get(app, "/", method="DELETE")[0] == 501
