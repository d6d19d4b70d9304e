"""The page's HTTP side: routes, query parsing, the login, and the three actions.

Reading: `/`, `/jobs/NAME`, `/api/status`, `/api/jobs/NAME/history` (open,
or behind the token with `http_protect: all`). Acting: POST
`/jobs/NAME/pause`, `/resume` and `/run`, through the same modules as
`scheduler pause`, `resume` and `trigger` (`scheduler.pauses`,
`scheduler.run_now`); a run-now request is handed to the fleet, and the job
page shows what became of it. Each answer is rendered by one replica from the
shared ledger, so every replica shows the same fleet.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from importlib import resources
from typing import Any
from urllib.parse import parse_qsl, quote, unquote

from jinja2 import Environment, PackageLoader, select_autoescape
from sqlalchemy import Connection

from scheduler import ledger, pauses, run_now
from scheduler.backends import Backend
from scheduler.catalog import Catalog, CatalogJob
from scheduler.config import Settings
from scheduler.errors import ConfigError, one_line
from scheduler.http_server import Reply, Request, Route
from scheduler.ledger import TickFilter
from scheduler.status import fleet_status, history
from scheduler.web import views
from scheduler.web.auth import Guard, Session, cross_site

log = logging.getLogger("scheduler.http")

HTML = "text/html; charset=utf-8"
JSON = "application/json"
STATIC = {"page.css": "text/css; charset=utf-8", "page.js": "text/javascript; charset=utf-8"}
# Nothing is fetched from elsewhere, no inline script runs, no other site may frame the page.
SECURITY = (
    (
        "Content-Security-Policy",
        "default-src 'none'; style-src 'self'; script-src 'self'; img-src 'self';"
        " connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    ),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "same-origin"),  # no-referrer would make browsers send Origin: null
    ("Cache-Control", "no-store"),
)
MAX_FIELDS = 20
MIN_REFRESH = 2  # seconds between two refreshes of a page, at least
API_LIMIT = 1000  # rows of /api/jobs/NAME/history at most
DONE = {  # what the job page says after an action (a fixed vocabulary, never echoed input)
    "paused": "Paused for the fleet.",
    "already": "It was paused already; the first pause stays.",
    "resumed": "Resumed: its next tick runs.",
    "not-paused": "It was not paused.",
    "run": "Run-now request sent to the fleet.",
}


class Page:
    def __init__(
        self,
        backend: Backend,
        catalog: Callable[[], Catalog],
        settings: Settings,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.backend = backend
        self.catalog = catalog  # the replica's catalog now (a reload replaces it)
        self.settings = settings
        self.clock = clock
        token = settings.http_token.get_secret_value() if settings.http_token else None
        self.guard = Guard(token, settings.http_protect)
        self.templates = Environment(
            loader=PackageLoader("scheduler.web", "templates"),
            autoescape=select_autoescape(default=True, default_for_string=True),
            trim_blocks=True,
            lstrip_blocks=True,
        )
        self.templates.filters["when"] = when
        folder = resources.files("scheduler.web") / "static"
        self.static = {name: (folder / name).read_bytes() for name in STATIC}

    def routes(self) -> dict[tuple[str, str], Route]:
        return {
            ("GET", "/"): self._reading(self.index),
            ("GET", "/jobs/*"): self._reading(self.job),
            ("POST", "/jobs/*"): self.act,
            ("GET", "/api/status"): self._reading(self.api_status),
            ("GET", "/api/jobs/*"): self._reading(self.api_history),
            ("GET", "/login"): self.login_form,
            ("POST", "/login"): self.login,
            ("POST", "/logout"): self.logout,
            ("GET", "/static/*"): self.asset,
        }

    # reading

    def _reading(self, route: Route) -> Route:
        def guarded(request: Request) -> Reply:
            if self.guard.may_read(request.headers):
                return route(request)
            if request.path.startswith("/api/"):
                challenge = (("WWW-Authenticate", 'Bearer realm="scheduler"'),)
                return Reply(401, b"send Authorization: Bearer <http_token>\n", headers=challenge)
            return _redirect("/login?next=" + quote(request.path))

        return guarded

    def index(self, request: Request) -> Reply:
        query = _query(request)
        window, sort = query.get("window", ""), query.get("sort", "")
        wanted = views.Wanted(
            window=window if window in views.WINDOWS else views.DEFAULT_WINDOW,
            query=query.get("q", "")[:100],
            sort=sort if sort in views.SORTS else views.SORTS[0],
        )
        data = views.index(self.backend, self.catalog(), self.clock(), wanted)
        return self._html("index.html", request, data)

    def job(self, request: Request) -> Reply:
        found = self._job(request.path.removeprefix("/jobs/"))
        if found is None:
            return self._html("missing.html", request, {}, status=404)
        query = _query(request)
        before = query.get("before")
        data = views.job_page(self.backend, self.catalog(), found, self.clock(), before)
        asked = query.get("asked", "")
        data["asked"] = self._request_state(int(asked)) if asked.isdigit() else None
        data["done"] = DONE.get(query.get("done", ""))
        return self._html("job.html", request, data)

    def api_status(self, request: Request) -> Reply:
        document = fleet_status(self.backend, self.catalog(), self.clock())
        return Reply(200, json.dumps(document, indent=2).encode(), JSON, SECURITY)

    def api_history(self, request: Request) -> Reply:
        name, _, rest = request.path.removeprefix("/api/jobs/").partition("/")
        found = self._job(name)
        if found is None or rest != "history":
            return Reply(404, b"no such job (see /api/status)\n", headers=SECURITY)
        query = _query(request)
        limit = query.get("limit", "50")
        if not limit.isdigit() or not 1 <= int(limit) <= API_LIMIT:
            return Reply(400, f"limit: a whole number from 1 to {API_LIMIT}\n".encode())
        wanted = TickFilter(key=found.key, until=views.until(query.get("before")), limit=int(limit))
        rows = history(self.backend, wanted)
        return Reply(200, json.dumps(rows, indent=2).encode(), JSON, SECURITY)

    def asset(self, request: Request) -> Reply:
        name = request.path.removeprefix("/static/")
        if name not in self.static:
            return Reply(404, b"not found\n")
        cache = (("Cache-Control", "max-age=300"), ("X-Content-Type-Options", "nosniff"))
        return Reply(200, self.static[name], STATIC[name], cache)

    # acting

    def act(self, request: Request) -> Reply:
        name, _, action = request.path.removeprefix("/jobs/").partition("/")
        found = self._job(name)
        if found is None or action not in ("pause", "resume", "run"):
            return Reply(404, b"not found\n", headers=SECURITY)
        form = _form(request)
        refused = self.guard.refuse_post(request.headers, form)
        if refused:
            return self._html("refused.html", request, {"why": refused, "job": name}, status=403)
        try:
            target = self._do(action, found, form)
        except ConfigError as exc:
            return self._html("refused.html", request, {"why": str(exc), "job": name}, status=400)
        return _redirect(target)

    def _do(self, action: str, job: CatalogJob, form: dict[str, str]) -> str:
        who = pauses.checked(form.get("by"), "by", pauses.MAX_ACTOR)
        # Whoever holds the token may type any name: the record says it came by the page.
        via = f"page on {self.settings.instance_name}"
        actor = f"{who} ({via})" if who else via
        now = self.clock()
        base = "/jobs/" + quote(job.name)
        try:
            with self.backend.ledger_engine.begin() as conn:
                if action == "pause":
                    reason = pauses.checked(form.get("reason"), "reason", pauses.MAX_REASON)
                    _, made = pauses.pause(
                        conn, job.key, job.name, by=actor, reason=reason, now=now
                    )
                    return f"{base}?done={'paused' if made else 'already'}"
                if action == "resume":
                    ended = pauses.resume(conn, job.key, job.name, by=actor, now=now)
                    return f"{base}?done={'resumed' if ended else 'not-paused'}"
                if not self._taker_for(conn, job):
                    raise ConfigError(
                        f"{job.name}: not run: no live replica runs it"
                        " (does their config.yaml have the job?)"
                    )
                namespace = self.settings.namespace
                asked_at = self.backend.now_expression()  # the clock run_now.look reads
                request = run_now.ask(
                    conn, job.key, job.name, by=actor, now=asked_at, namespace=namespace
                )
                return f"{base}?done=run&asked={request}"
        except ConfigError:
            raise
        except Exception as exc:
            log.warning("page: %s %s failed: %s", action, job.name, one_line(exc))
            raise ConfigError(f"cannot {action} {job.name}: the ledger did not answer") from None

    def _taker_for(self, conn: Connection, job: CatalogJob) -> bool:
        """Whether a live replica has the job, and so may take a run-now request for it."""
        live = {i["name"] for i in self.backend.live_instances(conn)}
        found = ledger.registrations_of(conn, [job.key])
        return any(r.instance in live and r.until is None for r in found)

    def _request_state(self, request: int) -> dict[str, Any] | None:
        """A run-now request as the job page tells it: what `scheduler trigger` would say
        (scheduler.run_now.look), which settles or withdraws it as that command would."""
        with self.backend.ledger_engine.begin() as conn:
            now = self.backend.now(conn)
            answer = run_now.look(
                conn, request, now=now, holder_timeout=self.settings.holder_timeout
            )
        return answer.as_page()

    # the login

    def login_form(self, request: Request) -> Reply:
        data = {"next": _local(_query(request).get("next")), "failed": False}
        return self._html("login.html", request, data)

    def login(self, request: Request) -> Reply:
        form = _form(request)
        target = _local(form.get("next"))
        refused = cross_site(request.headers)
        if refused or not self.guard.actions_on:
            why = refused or "no http_token is configured on this replica"
            return self._html("refused.html", request, {"why": why, "job": None}, status=403)
        if not self.guard.token_matches(form.get("token", "")):
            data = {"next": target, "failed": True}
            return self._html("login.html", request, data, status=403)
        return _redirect(target, (("Set-Cookie", self.guard.new_cookie()),))

    def logout(self, request: Request) -> Reply:
        refused = self.guard.refuse_post(request.headers, _form(request))
        if refused:
            return self._html("refused.html", request, {"why": refused, "job": None}, status=403)
        return _redirect("/", (("Set-Cookie", self.guard.cleared_cookie()),))

    # helpers

    def _job(self, quoted: str) -> CatalogJob | None:
        return self.catalog().by_name(unquote(quoted)) if "/" not in quoted else None

    def _html(
        self, template: str, request: Request, data: dict[str, Any], status: int = 200
    ) -> Reply:
        session: Session | None = self.guard.session(request.headers)
        page = self.templates.get_template(template).render(
            **data,
            refresh=_refresh(_query(request).get("refresh", "")),
            path=request.path,
            instance=self.settings.instance_name,
            actions_on=self.guard.actions_on,
            session=session,
            csrf=self.guard.csrf(session),
            now=self.clock(),
        )
        return Reply(status, page.encode(), HTML, SECURITY)


def when(value: str | datetime | None) -> str:
    """An instant as people read it on the page: 2026-11-30 22:10:03 UTC."""
    if value is None:
        return ""
    instant = datetime.fromisoformat(value) if isinstance(value, str) else value
    return instant.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _refresh(asked: str) -> int | None:
    """`?refresh=N`: the script refreshes every N seconds (0: never; at least 2)."""
    if not asked.isdigit():
        return None
    seconds = int(asked)
    return 0 if seconds == 0 else min(max(seconds, MIN_REFRESH), 3600)


def _query(request: Request) -> dict[str, str]:
    return _fields(request.query)


def _form(request: Request) -> dict[str, str]:
    return _fields(request.body.decode("utf-8", "replace"))


def _fields(text: str) -> dict[str, str]:
    try:
        return dict(parse_qsl(text, max_num_fields=MAX_FIELDS))
    except ValueError:  # too many fields: none is taken
        return {}


def _local(target: str | None) -> str:
    """Only a path of this site: never another site (`//evil`, `http://...`)."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    if not target.isprintable() or len(target) > 500:  # nothing that could split a header
        return "/"
    return target


def _redirect(target: str, headers: tuple[tuple[str, str], ...] = ()) -> Reply:
    return Reply(303, b"", headers=(("Location", target), *headers, *SECURITY))
