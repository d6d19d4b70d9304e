"""The page without a browser: the timeline's SVG, the token's rules, the routes over an
embedded ledger (docs/operating.md: The page)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from scheduler.ledger import tables
from scheduler.web import timeline
from scheduler.web.auth import Guard
from scheduler.web.routes import Page
from scheduler.web.server import MAX_BODY, HealthServer, Reply, Request, find_route
from scheduler.web.window import BUCKETS, LANE_DETAIL, Lane, Tick, Window, read_lanes
from tests.unit.conftest import PAGE_NOW as NOW

TOKEN = "unit-test-token-0123456789"
XSS = "<script>alert(1)</script> & <b>x</b>"


def tick(instance: str, status: str, minutes_ago: float, **extra) -> Tick:
    at = NOW - timedelta(minutes=minutes_ago)
    fields = {
        "job": "sync",
        "key": 2001,
        "instance": instance,
        "status": status,
        "scheduled_at": at,
        "started_at": at,
        "finished_at": at + timedelta(seconds=20),
        "duration_s": 20.0,
        "error": None,
        "run_id": 7,
        "manual": False,
    }
    return Tick(**{**fields, **extra})


def test_the_timeline_draws_a_lane_per_replica_a_bar_per_run_and_escapes_errors():
    window = Window(NOW - timedelta(hours=1), NOW)
    lanes = [
        Lane("r1", "r1", "replica", [tick("r1", "succeeded", 10, run_id=41)], total=1),
        Lane("r2", "r2", "replica", [tick("r2", "failed", 5, run_id=42, error=XSS)], total=1),
        Lane("r3", "r3", "replica", [tick("r3", "skipped", 3, run_id=None)], total=1),
        Lane("-", "not run (missed, paused)", "not-run", [tick("r1", "missed", 2)], total=1),
    ]
    svg = timeline.render(lanes, window, NOW)
    assert 'class="mark s-skipped"' in svg and 'class="mark s-missed"' in svg
    assert svg.count('class="lane replica"') == 3 and 'class="lane not-run"' in svg
    assert 'data-run="41"' in svg and 'class="run s-failed"' in svg
    assert "<script>" not in svg and "&lt;script&gt;alert(1)&lt;/script&gt;" in svg
    assert "run_id 42" in svg and "duration 20.00 s" in svg
    assert 'class="now"' in svg


def test_a_dense_window_is_drawn_in_bounded_size():
    window = Window(NOW - timedelta(hours=24), NOW)
    statuses = {"succeeded": 400, "failed": 3, "crashed": 1, "skipped": 2}
    buckets = {i: dict(statuses) for i in range(BUCKETS)}
    lanes = [Lane(f"r{i}", f"r{i}", "replica", buckets=buckets, total=10**6) for i in range(10)]
    svg = timeline.render(lanes, window, NOW)
    assert svg.count('class="bucket"') == 10 * BUCKETS
    assert len(svg) < 1_500_000  # however many runs: 10 lanes x 240 buckets x 4 outcomes


def test_the_session_cookie_holds_no_token_and_resists_tampering():
    clock = [1_000_000.0]
    guard = Guard(TOKEN, "actions", clock=lambda: clock[0])
    cookie = guard.new_cookie()
    assert TOKEN not in cookie and "HttpOnly" in cookie and "SameSite=Strict" in cookie
    value = cookie.split(";")[0]
    session = guard.session({"cookie": value})
    assert session is not None
    form = {"csrf": guard.csrf(session)}
    same = {"cookie": value, "origin": "http://h:1", "host": "h:1", "sec-fetch-site": "same-origin"}
    assert guard.refuse_post(same, form) is None
    assert guard.refuse_post(same, {"csrf": "0" * 64})
    assert guard.refuse_post({**same, "origin": "http://evil.example"}, form)
    assert guard.refuse_post({**same, "sec-fetch-site": "cross-site"}, form)
    assert guard.session({"cookie": value[:-1] + ("0" if value[-1] != "0" else "1")}) is None
    assert guard.session({"authorization": f"Bearer {TOKEN}"}) is not None
    assert guard.session({"authorization": "Bearer nope"}) is None
    clock[0] += 13 * 3600  # past the session's 12 hours
    assert guard.session({"cookie": value}) is None
    assert Guard(None, "actions").refuse_post({"authorization": f"Bearer {TOKEN}"}, {})


def ask(page: Page, method: str, target: str, body: str = "", **headers: str):
    path, _, query = target.partition("?")
    route = find_route(page.routes(), method, path)
    assert route is not None, target
    return route(Request(method, path, query, headers, body.encode()))


def add_ticks(page: Page, rows: list[dict]) -> None:
    with page.backend.ledger_engine.begin() as conn:
        conn.execute(tables.ticks.insert(), rows)


def row(n: int, status: str = "succeeded", instance: str = "unit-1", error: str | None = None):
    at = NOW - timedelta(seconds=n + 1)
    return {
        "job_key": 2001,
        "job_name": "sync",
        "scheduled_at": at,
        "status": status,
        "instance": instance,
        "run_id": n + 1,
        "started_at": at,
        "finished_at": at + timedelta(milliseconds=5),
        "error": error,
        "duration_s": 0.005,
    }


def test_html_from_the_ledger_is_shown_as_text(project):
    page = project()
    add_ticks(page, [row(0, "failed", error=XSS)])
    for target in ("/", "/jobs/sync"):
        reply = ask(page, "GET", target)
        assert reply.status == 200
        html = reply.body.decode()
        assert "<script>alert" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
        assert any(name == "Content-Security-Policy" for name, _ in reply.headers)


def test_without_a_token_the_actions_are_off_and_refused(project):
    page = project()
    assert 'id="pause"' not in ask(page, "GET", "/jobs/sync").body.decode()
    reply = ask(page, "POST", "/jobs/sync/pause", "reason=x", authorization=f"Bearer {TOKEN}")
    assert reply.status == 403


def test_protect_all_makes_reading_need_the_token(project):
    page = project(SCHEDULER_HTTP_TOKEN=TOKEN, SCHEDULER_HTTP_PROTECT="all")
    assert ask(page, "GET", "/").status == 303
    assert ask(page, "GET", "/api/status").status == 401
    assert ask(page, "GET", "/login").status == 200
    reply = ask(page, "GET", "/api/status", authorization=f"Bearer {TOKEN}")
    assert reply.status == 200 and json.loads(reply.body)["backend"] == "embedded"


def test_a_bearer_pauses_and_resumes_through_the_ledger(project):
    page = project(SCHEDULER_HTTP_TOKEN=TOKEN)
    bearer = {"authorization": f"Bearer {TOKEN}"}
    reply = ask(page, "POST", "/jobs/sync/pause", "reason=db+upgrade&by=alice", **bearer)
    assert reply.status == 200 and reply.content_type == "application/json"
    outcome = json.loads(reply.body)
    assert outcome["done"] == "paused" and outcome["page"] == "/jobs/sync?done=paused"
    status = json.loads(ask(page, "GET", "/api/status").body)
    (sync,) = [j for j in status["jobs"] if j["name"] == "sync"]
    assert sync["paused"]["by"] == "alice (page on unit-1)"
    assert sync["paused"]["reason"] == "db upgrade"
    assert json.loads(ask(page, "POST", "/jobs/sync/resume", "", **bearer).body)["done"] == (
        "resumed"
    )
    assert ask(page, "POST", "/jobs/nope/pause", "", **bearer).status == 404
    # Run now needs a live replica that has the job: none here.
    reply = ask(page, "POST", "/jobs/sync/run", "", **bearer)
    assert reply.status == 400 and b"no live replica runs it" in reply.body


def test_protect_all_needs_a_token():
    from scheduler.config.settings import Settings

    with pytest.raises(ValueError, match="needs http_token"):
        Settings(http_protect="all")
    with pytest.raises(ValueError, match="at least 16"):
        Settings(http_token="short")


def test_a_dense_lane_is_read_in_buckets_and_a_sparse_one_run_by_run(project):
    page = project()
    rows = [row(i, instance="busy") for i in range(LANE_DETAIL + 50)]
    rows += [row(LANE_DETAIL + 100 + i, instance="quiet") for i in range(3)]
    rows.append({**row(LANE_DETAIL + 200, "missed"), "run_id": None, "started_at": None})
    add_ticks(page, rows)
    window = Window(NOW - timedelta(hours=1), NOW)
    with page.backend.ledger_engine.connect() as conn:
        lanes = {lane.label: lane for lane in read_lanes(conn, window, ["quiet", "idle"])}
    assert lanes["busy (gone)"].buckets is not None
    assert sum(sum(c.values()) for c in lanes["busy (gone)"].buckets.values()) == LANE_DETAIL + 50
    assert len(lanes["quiet"].ticks) == 3 and lanes["quiet"].buckets is None
    assert lanes["idle"].total == 0
    assert [t.status for t in lanes["not run (missed, paused)"].ticks] == ["missed"]
    assert list(lanes)[:2] == ["quiet", "idle"]  # the live replicas first


def test_posts_are_bounded_and_routes_answer_under_their_prefix():
    import socket

    server = HealthServer("127.0.0.1", 0, live=lambda: True, ready=lambda: True, metrics=bytes)
    server.routes[("POST", "/things/*")] = lambda r: Reply(200, r.path.encode() + b" " + r.body)
    server.start()

    def send(raw: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(raw)
            return b"".join(iter(lambda: sock.recv(65536), b""))

    try:
        ok = send(b"POST /things/a HTTP/1.0\r\nContent-Length: 3\r\n\r\nabc")
        assert ok.startswith(b"HTTP/1.0 200") and ok.endswith(b"/things/a abc")
        big = f"POST /things/a HTTP/1.0\r\nContent-Length: {MAX_BODY + 1}\r\n\r\n".encode()
        assert send(big).startswith(b"HTTP/1.0 413")
        assert send(b"GET /things/a HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.0 405")
        assert send(b"POST /healthz HTTP/1.0\r\nContent-Length: 0\r\n\r\n").startswith(
            b"HTTP/1.0 405"
        )
    finally:
        server.stop()


def test_lanes_drawn_run_by_run_stay_within_the_detail_budget():
    from scheduler.web.window import DETAIL_LIMIT, _sparse

    lanes = [Lane(f"r{i}", f"r{i}", "replica", total=LANE_DETAIL) for i in range(30)]
    chosen = _sparse(lanes)
    assert sum(lane.total for lane in chosen) <= DETAIL_LIMIT
    assert len(chosen) == DETAIL_LIMIT // LANE_DETAIL


def test_a_browser_logs_in_acts_with_the_forms_csrf_token_and_logs_out(project):
    page = project(SCHEDULER_HTTP_TOKEN=TOKEN)
    here = {"host": "h:8080", "origin": "http://h:8080", "sec-fetch-site": "same-origin"}
    assert ask(page, "POST", "/login", "token=wrong-wrong-wrong", **here).status == 403
    assert (
        ask(page, "POST", "/login", f"token={TOKEN}", **{**here, "origin": "http://x"}).status
        == 403
    )
    reply = ask(page, "POST", "/login", f"token={TOKEN}&next=/jobs/sync", **here)
    assert reply.status == 303 and ("Location", "/jobs/sync") in reply.headers
    cookie = dict(reply.headers)["Set-Cookie"].split(";")[0]
    html = ask(page, "GET", "/jobs/sync", cookie=cookie).body.decode()
    assert 'id="pause"' in html and TOKEN not in html
    csrf = html.split('name="csrf" value="')[1].split('"')[0]
    assert ask(page, "POST", "/jobs/sync/pause", "reason=x", cookie=cookie, **here).status == 403
    done = ask(page, "POST", "/jobs/sync/pause", f"csrf={csrf}", cookie=cookie, **here)
    assert done.status == 303
    out = ask(page, "POST", "/logout", f"csrf={csrf}", cookie=cookie, **here)
    assert "Max-Age=0" in dict(out.headers)["Set-Cookie"]
    login = ask(page, "POST", "/login", f"token={TOKEN}&next=//evil.example/x", **here)
    assert ("Location", "/") in login.headers  # never to another site


def test_protect_all_without_a_token_is_one_line_naming_both_settings(run, monkeypatch):
    monkeypatch.setenv("SCHEDULER_HTTP_PROTECT", "all")
    code, _, err = run("check")
    assert code == 2 and err.count("\n") == 1
    assert (
        "settings: http_protect: all needs http_token" in err and "scheduler.scheduler" not in err
    )


def test_a_dead_replicas_run_and_a_crashed_runs_known_duration_are_told_as_such(project):
    page = project()
    gone = {**row(0, "running", instance="gone-1"), "finished_at": None, "duration_s": None}
    crashed = {**row(90, "crashed", instance="gone-0"), "duration_s": 42.0}
    add_ticks(page, [gone, crashed])
    html = ask(page, "GET", "/jobs/sync").body.decode()
    assert "replica gone, not yet marked" in html
    assert "at least 42.00 s" in html
    assert "replica gone, not yet marked" in ask(page, "GET", "/").body.decode()
