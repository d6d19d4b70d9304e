"""Every route of the page, sent hostile values in every query parameter it reads, in
its path, its cookie, its token and its form: never a 5xx, never a header the server
cannot send, and no GET changes the ledger (docs/operating.md: The page)."""

from __future__ import annotations

from datetime import timedelta
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import insert, text
from sqlalchemy.exc import DBAPIError

from scheduler.ledger import tables
from scheduler.web.query import QUERY
from scheduler.web.reading import ReadingBackend
from scheduler.web.routes import Page
from scheduler.web.server import Request, find_route
from tests.unit.conftest import PAGE_NOW as NOW
from tests.unit.test_page_input import HERE, dump, old_request, sendable
from tests.unit.test_page_views import TOKEN, add_ticks, row

HOSTILE = [
    "",
    " ",
    "\u00b2",  # a superscript two: str.isdigit() says it is a digit
    "\u0663",  # an Arabic-Indic three: int() reads it
    "\uff11",  # a fullwidth one
    "9" * 5000,  # past int()'s 4300 digits
    "99999999999999999999999",
    "-1",
    "0",
    "1e400",
    "nan",
    "inf",
    "0001-01-01",
    "9999-12-31T23:59:59-14:00",
    "9999-12-31T23:59:59.999999+14:00",
    "1969-12-31T23:59:59Z",
    "2026-11-30T11:00:00+00:00",
    "\x00",
    "a\x00b",
    "%",
    "%00",
    "\r\nSet-Cookie: x=1",
    "/jobs/\u20ac",
    "//evil.example",
    "/\\evil.example",
    "<script>alert(1)</script>",
    "' OR 1=1 --",
    "\U0001f4a9" * 50,
    "x" * 10_000,
]
VALUES = st.one_of(st.sampled_from(HOSTILE), st.text(max_size=40), st.integers().map(str))
LATIN1 = st.text(alphabet=st.characters(max_codepoint=255), max_size=80)
NAMES = ["sync", "report", "nope", "sync/history", "report/history", "sync/pause", "page.css"]
PATH_PARTS = st.one_of(st.sampled_from(NAMES), st.text(max_size=20).map(quote), st.text(max_size=8))


def paths(pattern: str) -> st.SearchStrategy[str]:
    if not pattern.endswith("/*"):
        return st.just(pattern)
    return PATH_PARTS.map(lambda part: pattern[:-1] + part)


def queries() -> st.SearchStrategy[str]:
    """A query of the parameters the page reads (and others), or raw bytes of a query."""
    chosen = st.dictionaries(st.sampled_from([*QUERY, "unknown"]), VALUES, max_size=4)
    made = chosen.map(lambda d: "&".join(f"{quote(k)}={quote(v)}" for k, v in d.items()))
    return st.one_of(made, st.text(max_size=60))


def headers(session: str) -> st.SearchStrategy[dict[str, str]]:
    cookie = st.one_of(
        st.just(session), LATIN1.map(lambda v: f"scheduler_session={v}"), LATIN1, st.just("")
    )
    bearer = st.one_of(st.just(f"Bearer {TOKEN}"), LATIN1.map(lambda v: f"Bearer {v}"), LATIN1)
    return st.fixed_dictionaries(
        {},
        optional={
            "cookie": cookie,
            "authorization": bearer,
            "origin": st.one_of(st.just("http://h:8080"), LATIN1),
            "host": st.just("h:8080"),
            "sec-fetch-site": st.one_of(st.just("same-origin"), LATIN1),
        },
    )


def forms() -> st.SearchStrategy[bytes]:
    fields = st.dictionaries(
        st.sampled_from(["token", "next", "csrf", "reason", "by", "unknown"]), VALUES, max_size=4
    )
    made = fields.map(lambda d: "&".join(f"{quote(k)}={quote(v)}" for k, v in d.items()))
    return st.one_of(made, st.text(max_size=60)).map(lambda t: t.encode("utf-8", "replace"))


def requests(page: Page, method: str, session: str) -> st.SearchStrategy[Request]:
    patterns = sorted(p for m, p in page.routes() if m == method)
    body = forms() if method == "POST" else st.just(b"")
    return st.sampled_from(patterns).flatmap(
        lambda pattern: st.builds(
            Request,
            st.just(method),
            paths(pattern),
            queries(),
            headers(session),
            body,
            st.sampled_from(["10.0.0.1", "10.0.0.2", "2001:db8::1", ""]),
        )
    )


def answer(page: Page, request: Request):
    route = find_route(page.routes(), request.method, request.path)
    assert route is not None, request.path
    return route(request)


@pytest.fixture
def fuzzed(project):
    return filled(project(SCHEDULER_HTTP_TOKEN=TOKEN))


def filled(page: Page) -> tuple[Page, str]:
    """The page with a ledger with rows in it, a stale request, and a logged-in cookie."""
    page.later = lambda delay, act: None  # no timer threads: a request stays as it is
    add_ticks(page, [row(i, "failed" if i % 3 else "succeeded") for i in range(30)])
    old_request(page, 2002, "report")
    login = Request("POST", "/login", "", HERE, f"token={TOKEN}".encode(), "127.0.0.1")
    cookie = dict(answer(page, login).headers)["Set-Cookie"].split(";")[0]
    return page, cookie


FUZZ = settings(
    max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def fuzz(page: Page, method: str, cookie: str) -> None:
    """Hypothesis sends the page's routes of one method: no 5xx, no unsendable header."""

    @FUZZ
    @given(requests(page, method, cookie))
    def check(request: Request) -> None:
        reply = answer(page, request)
        assert reply.status < 500, (request, reply.body[:300])
        assert sendable(reply), reply.headers

    check()


def test_no_get_changes_the_ledger_and_none_answers_5xx(fuzzed):
    page, cookie = fuzzed
    before = dump(page)
    fuzz(page, "GET", cookie)
    assert dump(page) == before


def test_no_post_answers_5xx(fuzzed):
    page, cookie = fuzzed
    fuzz(page, "POST", cookie)


def walk_every_get(page: Page, cookie: str, everyone: bool = True) -> None:
    """Each GET route, each parameter, each hostile value: anonymous, by cookie and by
    token, or (not `everyone`) by cookie only, who reads every route."""
    patterns = sorted(p for m, p in page.routes() if m == "GET")
    gets = [p.replace("*", "sync/history" if "api" in p else "sync") for p in patterns]
    who: list[dict[str, str]] = [{"cookie": cookie}]
    if everyone:
        who += [{}, {"authorization": f"Bearer {TOKEN}"}]
    for path in gets:
        for name in QUERY:
            for value in HOSTILE:
                for headers in who:
                    request = Request("GET", path, f"{name}={quote(value)}", headers, b"", "::1")
                    reply = answer(page, request)
                    assert reply.status < 500 and sendable(reply), (path, name, value)


def test_every_get_route_and_parameter_with_every_hostile_value_changes_nothing(fuzzed):
    """The same walk without chance."""
    page, cookie = fuzzed
    before = dump(page)
    walk_every_get(page, cookie)
    assert dump(page) == before


def test_a_reading_connection_is_refused_writes_and_leaves_the_pool_writable(project):
    page = project()
    reader = ReadingBackend(page.backend)
    values = {"job_key": 2001, "job_name": "sync", "scheduled_at": NOW, "status": "missed"}
    for begin in (reader.ledger_engine.connect, reader.ledger_engine.begin):
        with pytest.raises(DBAPIError, match="not authorized"), begin() as conn:
            conn.execute(text("SELECT 1"))
            conn.execute(insert(tables.ticks).values(**values))
    with reader.ledger_engine.connect() as conn:  # reading works
        assert conn.execute(text("SELECT count(*) FROM scheduler_ticks")).scalar() == 0
    with page.backend.ledger_engine.begin() as conn:  # and the same pool still writes
        conn.execute(insert(tables.ticks).values(**values))
    later = {**values, "scheduled_at": NOW + timedelta(minutes=1)}
    add_ticks(page, [later])
    with reader.ledger_engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM scheduler_ticks")).scalar() == 2


def test_a_reading_connection_that_failed_to_begin_goes_back_to_writers_writable(project):
    from sqlalchemy import event

    page = project()
    engine = page.backend.ledger_engine
    reader = ReadingBackend(page.backend)

    def busy(conn):  # the writer's BEGIN IMMEDIATE gave up ("database is locked")
        raise RuntimeError("database is locked")

    event.listen(engine, "begin", busy)
    try:
        with pytest.raises(RuntimeError), reader.ledger_engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    finally:
        event.remove(engine, "begin", busy)
    values = {"job_key": 2001, "job_name": "sync", "scheduled_at": NOW, "status": "missed"}
    with engine.begin() as conn:  # the same pooled connection, a writer's again
        conn.execute(insert(tables.ticks).values(**values))
