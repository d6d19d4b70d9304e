"""What the page does with what it is sent (docs/operating.md: The page): a GET changes nothing,
malformed input is a 4xx with one line and never a 500, a login goes only to a path of
this site, and failed logins are logged and slowed down per client."""

from __future__ import annotations

import logging
import socket
from datetime import timedelta
from urllib.parse import quote

import pytest
from sqlalchemy import inspect, select

from scheduler.fleet import run_now
from scheduler.ledger import tables
from scheduler.web.routes import Page
from scheduler.web.server import HealthServer, Reply, Request, find_route
from tests.unit.conftest import PAGE_NOW as NOW
from tests.unit.test_page_views import TOKEN, ask

HERE = {"host": "h:8080", "origin": "http://h:8080", "sec-fetch-site": "same-origin"}


def dump(page: Page) -> dict[str, list[str]]:
    """Every row of every ledger table: what a GET must leave exactly as it was."""
    with page.backend.ledger_engine.connect() as conn:
        present = set(inspect(conn).get_table_names())  # each backend makes the tables it uses
        return {
            table.name: sorted(repr(tuple(r)) for r in conn.execute(select(table)))
            for table in tables.metadata.sorted_tables
            if table.name in present
        }


def old_request(page: Page, key: int, name: str) -> int:
    """A run-now request nobody took, asked an hour ago (long past any patience)."""
    with page.backend.ledger_engine.begin() as conn:
        return run_now.ask(
            conn, key, name, by="someone", now=NOW - timedelta(hours=1), namespace=None
        )


def sendable(reply: Reply) -> bool:
    """What the server can send: header values in latin-1, none that could split a header."""
    for name, value in reply.headers:
        try:
            value.encode("latin-1")
        except UnicodeEncodeError:
            return False
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            return False
    return True


def test_a_get_never_withdraws_a_run_now_request_of_its_job_or_another(project):
    page = project()
    theirs = old_request(page, 2002, "report")
    before = dump(page)
    other = ask(page, "GET", f"/jobs/sync?asked={theirs}")  # another job's request
    assert other.status == 200 and "not found for this job" in other.body.decode()
    own = ask(page, "GET", f"/jobs/report?asked={theirs}")
    assert own.status == 200
    assert "no live replica took it within" in own.body.decode()
    assert dump(page) == before  # both requests' rows are still there, untouched


def test_the_page_withdraws_its_own_untaken_request_after_the_patience_of_trigger(project):
    page = project(SCHEDULER_HTTP_TOKEN=TOKEN)
    later = []
    page.later = lambda delay, act: later.append((delay, act))
    mine = old_request(page, 2001, "sync")
    page._withdraw_later(mine)
    ((delay, act),) = later
    assert delay == run_now.patience(page.settings.holder_timeout)
    act()
    with page.backend.ledger_engine.connect() as conn:
        assert run_now.state(conn, mine) is None


BAD = [
    ("/?refresh=%C2%B2", "refresh"),
    ("/?refresh=" + "9" * 5000, "refresh"),
    ("/?refresh=-1", "refresh"),
    ("/?window=1y", "window"),
    ("/?sort=%00", "sort"),
    ("/jobs/sync?asked=%C2%B2", "asked"),
    ("/jobs/sync?asked=99999999999999999999999", "asked"),
    ("/jobs/sync?asked=0", "asked"),
    ("/jobs/sync?before=0001-01-01", "before"),
    ("/jobs/sync?before=9999-12-31T23:59:59-14:00", "before"),
    ("/jobs/sync?before=2026-13-01", "before"),
    ("/jobs/sync?before=%D9%A2%D9%A0%D9%A2%D9%A6-01-01", "before"),  # Arabic-Indic digits
    ("/jobs/sync?done=%00", "done"),
    ("/api/jobs/sync/history?before=0001-01-01", "before"),
    ("/api/jobs/sync/history?before=9999-12-31T23:59:59-14:00", "before"),
    ("/api/jobs/sync/history?limit=%C2%B2", "limit"),
    ("/api/jobs/sync/history?limit=1001", "limit"),
    ("/api/jobs/sync/history?limit=" + "1" * 5000, "limit"),
]


@pytest.mark.parametrize(("target", "field"), BAD)
def test_malformed_input_is_400_with_one_line_naming_the_field(project, target, field):
    reply = ask(project(), "GET", target)
    assert reply.status == 400, reply.body[:200]
    assert reply.body.count(b"\n") == 1 and reply.body.startswith(field.encode() + b": ")
    assert len(reply.body) < 300  # a hostile value is not echoed whole


@pytest.mark.parametrize(
    "target",
    [
        "/?refresh=0",
        "/?refresh=45&window=6h&sort=name&q=sy",
        "/jobs/sync?before=2026-11-30T11:00:00%2B00:00",
        "/jobs/sync?before=2026-11-30T11:00:00",
        "/jobs/sync?done=paused",
        "/api/jobs/sync/history?limit=1000&before=2026-11-30T11:00:00Z",
        "/?unknown=%C2%B2",  # a parameter the page does not read is not its business
    ],
)
def test_wellformed_input_is_answered(project, target):
    assert ask(project(), "GET", target).status == 200


def test_a_cookie_of_any_shape_is_no_session_and_never_a_500(project):
    page = project(SCHEDULER_HTTP_TOKEN=TOKEN)
    for value in ("9999999999.abc.\xe9\xe9", "\xb2\xb2.a.b", "1.a." + "f" * 64, "..", ".\xe9."):
        cookie = f"scheduler_session={value}"
        assert ask(page, "GET", "/", cookie=cookie).status == 200
        refused = ask(page, "POST", "/jobs/sync/pause", "csrf=\xe9", cookie=cookie, **HERE)
        assert refused.status == 403
    login = ask(page, "POST", "/login", f"token={TOKEN}", **HERE)
    cookie = dict(login.headers)["Set-Cookie"].split(";")[0]
    reply = ask(page, "POST", "/jobs/sync/pause", "csrf=%C3%A9", cookie=cookie, **HERE)
    assert reply.status == 403  # a CSRF token outside ASCII is a stale form, not a TypeError


@pytest.mark.parametrize(
    "target",
    [
        "//evil.example/x",
        "/\\evil.example",
        "https://evil.example/",
        "/\t/evil.example",
        "\x00/jobs",
        " //evil.example",
        "/jobs/sync\r\nSet-Cookie: x=1",
    ],
)
def test_a_login_goes_only_to_a_path_of_this_site(project, target):
    page = project(SCHEDULER_HTTP_TOKEN=TOKEN)
    reply = ask(page, "POST", "/login", f"token={TOKEN}&next={quote(target)}", **HERE)
    assert reply.status == 303 and sendable(reply)
    location = dict(reply.headers)["Location"]
    assert location.startswith("/") and not location.startswith("//") and "\\" not in location


def send(port: int, raw: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(raw)
        return b"".join(iter(lambda: sock.recv(65536), b""))


def test_a_login_to_a_path_outside_latin1_is_answered(project):
    page = project(SCHEDULER_HTTP_TOKEN=TOKEN)
    server = HealthServer("127.0.0.1", 0, live=lambda: True, ready=lambda: True, metrics=bytes)
    server.routes.update(page.routes())
    server.start()
    try:
        body = f"token={TOKEN}&next={quote('/jobs/€')}".encode()
        raw = (
            b"POST /login HTTP/1.0\r\nHost: h:8080\r\nOrigin: http://h:8080\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        answer = send(server.port, raw)
        assert answer.startswith(b"HTTP/1.0 303"), answer[:200]
        assert b"\r\nLocation: /jobs/%E2%82%AC\r\n" in answer
    finally:
        server.stop()


def guess(page: Page, client: str, token: str = "wrong-wrong-wrong-wrong") -> Reply:
    route = find_route(page.routes(), "POST", "/login")
    assert route is not None
    body = f"token={token}".encode()
    return route(Request("POST", "/login", "", HERE, body, client=client))


def test_failed_logins_are_logged_without_the_guess_and_slowed_down_per_client(project, caplog):
    page = project(SCHEDULER_HTTP_TOKEN=TOKEN)
    clock = [1000.0]
    page.throttle.clock = lambda: clock[0]
    with caplog.at_level(logging.INFO, logger="scheduler"):
        answers = [guess(page, "10.0.0.1").status for _ in range(11)]
    assert answers == [403] * 10 + [429]  # the 11th guess within a second is refused
    assert guess(page, "10.0.0.1", TOKEN).status == 429  # even the right token, for now
    assert guess(page, "10.0.0.2").status == 403  # another client has its own budget
    failed = [r.getMessage() for r in caplog.records if "login" in r.getMessage()]
    assert failed and all("10.0.0." in line for line in failed)
    assert not any("wrong-wrong" in line for line in failed)
    refused = guess(page, "10.0.0.1", TOKEN)
    assert refused.status == 429 and ("Retry-After", "6") in refused.headers
    clock[0] += 6.0  # one guess regained
    assert guess(page, "10.0.0.1", TOKEN).status == 303


def test_the_login_throttle_holds_a_bounded_table_whatever_the_clients(project):
    page = project(SCHEDULER_HTTP_TOKEN=TOKEN)
    throttle = page.throttle
    throttle.clock = lambda: 1000.0
    for i in range(50_000):
        throttle.failed(f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}")
        assert len(throttle) <= throttle.most
    # IPv6: a client has a /64 to itself, so its addresses share one budget.
    for i in range(20):
        throttle.failed(f"2001:db8::{i:x}")
    assert not throttle.allows("2001:db8::ffff")
