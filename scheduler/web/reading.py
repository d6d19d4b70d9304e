"""The page's GET routes, which see the ledger only through read-only transactions.

A GET changes nothing, ever (a link, an `<img>` on another site, a prefetch can
send one). That is not left to each route's care: `Reading` holds no writable
ledger at all, only `ReadingBackend`, whose engine shares the replica's pool but
has every transaction refused any write by the database itself (PostgreSQL:
`SET TRANSACTION READ ONLY`; SQLite: an authorizer that allows reads only).
A route that tried to write would fail, and its test with it.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timedelta
from importlib import resources
from typing import Any, cast
from urllib.parse import quote, unquote

from sqlalchemy import Connection, Engine, event
from sqlalchemy.pool import ConnectionPoolEntry

from scheduler.backends import Backend
from scheduler.config.settings import Settings
from scheduler.fleet import run_now
from scheduler.fleet.host_lock import host_standbys
from scheduler.fleet.status import HistoryAsked, fleet_status, history, history_filter
from scheduler.ledger.history import TickFilter
from scheduler.registry.catalog import Catalog, CatalogJob
from scheduler.web import query, views
from scheduler.web.render import Render, document, redirect, text
from scheduler.web.server import Reply, Request, Route

HISTORY_FILTERS = ("since", "until", "status", "instance", "limit")  # as HistoryAsked has them
STATIC = {"page.css": "text/css; charset=utf-8", "page.js": "text/javascript; charset=utf-8"}
# What SQLite may do inside a reading transaction: read, call functions, begin and end.
_READS = frozenset(
    {
        sqlite3.SQLITE_SELECT,
        sqlite3.SQLITE_READ,
        sqlite3.SQLITE_FUNCTION,
        sqlite3.SQLITE_RECURSIVE,
        sqlite3.SQLITE_TRANSACTION,
        sqlite3.SQLITE_SAVEPOINT,
    }
)


def read_only(engine: Engine) -> Engine:
    """The same engine and pool, with every transaction refused writes by the database."""
    guarded = engine.execution_options()  # its own listeners; the original's still apply
    event.listen(guarded, "begin", _refuse_writes)
    if engine.dialect.name == "sqlite":
        # The authorizer is the connection's: it is taken off when the connection goes back
        # to the pool, whatever ended the transaction (even a BEGIN that failed).
        event.listen(guarded, "checkin", _allow_writes)
    return guarded


_READING = "scheduler_reading"  # in a pooled connection's info: it has the authorizer on


def _refuse_writes(conn: Connection) -> None:
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql("SET TRANSACTION READ ONLY")
        return
    conn.connection.info[_READING] = True
    cast(sqlite3.Connection, conn.connection.driver_connection).set_authorizer(_reads_only)


def _allow_writes(driver: Any, record: ConnectionPoolEntry) -> None:
    if record.info.pop(_READING, False) and driver is not None:
        driver.set_authorizer(None)


def _reads_only(action: int, *_: object) -> int:
    return sqlite3.SQLITE_OK if action in _READS else sqlite3.SQLITE_DENY


class ReadingBackend:
    """What a GET may use of a backend: its name, who is live, and the ledger read-only."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self.name = backend.name
        self.live_instances = backend.live_instances
        self.lock_holders = backend.lock_holders
        self._source: Engine | None = None
        self._engine: Engine | None = None

    @property
    def ledger_engine(self) -> Engine:
        source = self._backend.ledger_engine
        if self._engine is None or source is not self._source:
            self._source, self._engine = source, read_only(source)
        return self._engine


class Reading:
    def __init__(
        self,
        backend: Backend,
        catalog: Callable[[], Catalog],
        settings: Settings,
        render: Render,
        clock: Callable[[], datetime],
    ) -> None:
        # Only the reading parts of a backend, typed as one for the views it is handed to.
        self.backend = cast(Backend, ReadingBackend(backend))
        self.catalog = catalog  # the replica's catalog now (a reload replaces it)
        self.settings = settings
        self.render = render
        self.clock = clock
        folder = resources.files("scheduler.web") / "static"
        self.static = {name: (folder / name).read_bytes() for name in STATIC}

    def routes(self) -> dict[str, Route]:
        """Path -> route, all of them GET."""
        return {
            "/": self._guarded(self.index),
            "/jobs/*": self._guarded(self.job),
            "/api/status": self._guarded(self.api_status),
            "/api/history": self._guarded(self.api_fleet_history),
            "/api/jobs/*": self._guarded(self.api_history),
            "/login": self.login_form,
            "/static/*": self.asset,
        }

    def _guarded(self, route: Route) -> Route:
        """With `http_protect: all`, reading needs the token too."""

        def guarded(request: Request) -> Reply:
            if self.render.guard.may_read(request.headers):
                return route(request)
            if request.path.startswith("/api/"):
                challenge = (("WWW-Authenticate", 'Bearer realm="scheduler"'),)
                return text(401, "send Authorization: Bearer <http_token>", challenge)
            return redirect("/login?next=" + quote(request.path))

        return guarded

    def index(self, request: Request) -> Reply:
        wanted = query.parsed(request)
        chosen = views.Wanted(
            window=wanted.get("window", views.DEFAULT_WINDOW),
            query=wanted.get("q", ""),
            sort=wanted.get("sort", views.SORTS[0]),
        )
        standbys = host_standbys(self.settings)
        data = views.index(self.backend, self.catalog(), self.clock(), chosen, standbys)
        return self.render.html("index.html", request, data)

    def job(self, request: Request) -> Reply:
        wanted = query.parsed(request)
        found = self.named(request.path.removeprefix("/jobs/"))
        if found is None:
            return self.render.html("missing.html", request, {}, status=404)
        now = self.clock()
        data = views.job_page(self.backend, self.catalog(), found, now, _older(wanted))
        if "asked" in wanted:
            data["asked"] = self._request_state(found, wanted["asked"], now)
        data["done"] = views.DONE.get(wanted.get("done", ""))
        return self.render.html("job.html", request, data)

    def api_status(self, request: Request) -> Reply:
        standbys = host_standbys(self.settings)
        now = self.clock()
        return document(fleet_status(self.backend, self.catalog(), now, standbys, request.root))

    def api_fleet_history(self, request: Request) -> Reply:
        """`history --json` for the fleet, with its filters: `?since=12h&until=...&status=
        failed,crashed&instance=NAME&job=NAME&limit=N` (at most `API_LIMIT` ticks)."""
        wanted = query.parsed(request)
        given = query.fields(request.query)
        asked = HistoryAsked(*(given.get(name) for name in HISTORY_FILTERS))
        chosen = history_filter(asked, self.clock(), most=query.API_LIMIT, spanned=query.API_LIMIT)
        if "job" in wanted:
            found = self.catalog().by_name(wanted["job"])
            if found is None:
                return text(404, "no such job (see /api/status)")
            chosen = replace(chosen, key=found.key)
        return document(history(self.backend, chosen))

    def api_history(self, request: Request) -> Reply:
        wanted = query.parsed(request)
        name, _, rest = request.path.removeprefix("/api/jobs/").partition("/")
        found = self.named(name)
        if found is None or rest != "history":
            return text(404, "no such job (see /api/status)")
        chosen = TickFilter(key=found.key, until=_older(wanted), limit=wanted.get("limit", 50))
        return document(history(self.backend, chosen))

    def login_form(self, request: Request) -> Reply:
        data = {"next": query.parsed(request).get("next", "/"), "failed": False}
        return self.render.html("login.html", request, data)

    def asset(self, request: Request) -> Reply:
        name = request.path.removeprefix("/static/")
        if name not in self.static:
            return Reply(404, b"not found\n")
        cache = (("Cache-Control", "max-age=300"), ("X-Content-Type-Options", "nosniff"))
        return Reply(200, self.static[name], STATIC[name], cache)

    def _request_state(self, job: CatalogJob, request: int, now: datetime) -> dict[str, Any]:
        """A run-now request of this job as `scheduler trigger` would tell it (read only:
        settling it is for the command, the page's own withdrawal, and housekeeping); of
        another job, or gone (withdrawn, pruned), it is not found."""
        with self.backend.ledger_engine.connect() as conn:
            answer = run_now.look(
                conn, request, now=now, holder_timeout=self.settings.holder_timeout, record=False
            )
        shown = answer.as_page()
        if shown is None or answer.key != job.key:
            return {"id": request, "missing": True}
        return shown

    def named(self, quoted: str) -> CatalogJob | None:
        return self.catalog().by_name(unquote(quoted)) if "/" not in quoted else None


def _older(wanted: dict[str, Any]) -> datetime | None:
    """`?before=`: the page of ticks scheduled before it (`until` is inclusive)."""
    before: datetime | None = wanted.get("before")
    return None if before is None else before - timedelta(microseconds=1)
