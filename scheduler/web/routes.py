"""The page's HTTP side: its routes, the login, and the three actions.

Reading: `/`, `/jobs/NAME`, `/api/status`, `/api/history`, `/api/jobs/NAME/history`
(open, or behind the token with `http_protect: all`), served by `scheduler.web.reading`,
which cannot write. Acting: POST `/jobs/NAME/pause`, `/resume` and `/run`,
through the same modules as `scheduler pause`, `resume` and `trigger`
(`scheduler.fleet.pauses`, `scheduler.fleet.run_now`); a run-now request is handed to the
fleet, and withdrawn after the patience of `trigger` if no replica took it. A browser
is sent back to the job's page; a script (a bearer token) is answered JSON.
Each answer is rendered by one replica from the shared ledger, so every
replica shows the same fleet.

Every route answers: a malformed value is 400 and one line (`scheduler.config.parsing`),
a ledger that does not answer 503, and anything unforeseen 500 with one log
line. A client that sends wrong tokens is slowed down (`scheduler.web.throttle`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from urllib.parse import quote

from sqlalchemy import Connection
from sqlalchemy.exc import SQLAlchemyError

from scheduler.backends import Backend
from scheduler.config.parsing import Refused, local_path
from scheduler.config.settings import Settings
from scheduler.errors import LedgerError, SchedulerError, one_line
from scheduler.fleet import pauses, run_now
from scheduler.ledger.registrations import registrations_of
from scheduler.registry.catalog import Catalog, CatalogJob
from scheduler.text import printable
from scheduler.web import query
from scheduler.web.auth import Guard, cross_site
from scheduler.web.reading import Reading
from scheduler.web.render import Render, document, redirect, text
from scheduler.web.server import Reply, Request, Route, speaks_json
from scheduler.web.throttle import Throttle
from scheduler.web.views import DONE

log = logging.getLogger("scheduler.http")


@dataclass(frozen=True)
class Done:
    """What an action did: a word of `views.DONE`, and a run-now request's id."""

    word: str
    request: int | None = None


ROUTES_WITH_A_TOKEN = (("POST", "/login"),)  # besides any request with Authorization


def _later(delay: float, act: Callable[[], None]) -> None:
    timer = threading.Timer(delay, act)
    timer.daemon = True
    timer.start()


class Page:
    def __init__(
        self,
        backend: Backend,
        catalog: Callable[[], Catalog],
        settings: Settings,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend = backend
        self.catalog = catalog  # the replica's catalog now (a reload replaces it)
        self.settings = settings
        self.clock = clock
        token = settings.http_token.get_secret_value() if settings.http_token else None
        self.guard = Guard(token, settings.http_protect)
        self.render = Render(self.guard, settings.instance_name, clock)
        self.reading = Reading(backend, catalog, settings, self.render, clock)
        self.throttle = Throttle(clock=monotonic)
        self.later: Callable[[float, Callable[[], None]], None] = _later

    def routes(self) -> dict[tuple[str, str], Route]:
        table: dict[tuple[str, str], Route] = {
            ("GET", path): route for path, route in self.reading.routes().items()
        }
        table[("POST", "/jobs/*")] = self.act
        table[("POST", "/login")] = self.login
        table[("POST", "/logout")] = self.logout
        return {key: self._answered(route) for key, route in table.items()}

    def _answered(self, route: Route) -> Route:
        """The route, behind the login throttle; whatever happens, an answer."""

        def answer(request: Request) -> Reply:
            try:
                return self._too_many_guesses(request) or route(request)
            except Refused as exc:
                return text(400, str(exc))
            except SQLAlchemyError as exc:
                log.warning(
                    "page: %s: the ledger did not answer: %s", _said(request), one_line(exc)
                )
                return text(503, "the ledger did not answer; try again", (("Retry-After", "5"),))
            except Exception as exc:  # a fault here, not the client's: one line, no traceback
                log.error("page: %s failed: %s", _said(request), one_line(exc))
                return text(500, "internal error")

        return answer

    # tokens and the login

    def _too_many_guesses(self, request: Request) -> Reply | None:
        """429 for a client out of guesses that sends a token; a wrong bearer counts."""
        presents = "authorization" in request.headers or (
            (request.method, request.path) in ROUTES_WITH_A_TOKEN
        )
        if not presents:
            return None
        if not self.throttle.allows(request.client):
            wait = str(self.throttle.retry_after(request.client))
            return text(
                429, f"too many wrong tokens: try again in {wait} s", (("Retry-After", wait),)
            )
        if self.guard.bearer_fails(request.headers):
            self._wrong_token(request)
        return None

    def _wrong_token(self, request: Request) -> None:
        left = self.throttle.failed(request.client)
        then = f"{left} more allowed now" if left else "it must now wait between tries"
        log.warning("page: a wrong token from %s (%s); %s", _client(request), _said(request), then)

    def login(self, request: Request) -> Reply:
        form = query.form(request)
        target = local_path(form.get("next"))
        refused = cross_site(request.headers)
        if refused or not self.guard.actions_on:
            why = refused or "no http_token is configured on this replica"
            data: dict[str, object] = {"why": why, "job": None}
            return self.render.html("refused.html", request, data, status=403)
        if not self.guard.token_matches(form.get("token", "")):
            self._wrong_token(request)
            data = {"next": target, "failed": True}
            return self.render.html("login.html", request, data, status=403)
        return redirect(target, (("Set-Cookie", self.guard.new_cookie()),))

    def logout(self, request: Request) -> Reply:
        refused = self.guard.refuse_post(request.headers, query.form(request))
        if refused:
            data = {"why": refused, "job": None}
            return self.render.html("refused.html", request, data, status=403)
        return redirect("/", (("Set-Cookie", self.guard.cleared_cookie()),))

    # acting

    def act(self, request: Request) -> Reply:
        """Pause, resume or run now. A browser is sent back to the job's page; a script
        (a bearer token) is answered the outcome as JSON, and its refusals as JSON too."""
        name, _, action = request.path.removeprefix("/jobs/").partition("/")
        found = self.reading.named(name)
        if found is None or action not in ("pause", "resume", "run"):
            return text(404, "not found")
        script = speaks_json(request)
        form = query.form(request)
        refused = self.guard.refuse_post(request.headers, form)
        if refused:
            return self._refused(request, 403, refused, name, script)
        try:
            done = self._do(action, found, form)
        except SchedulerError as exc:  # bad input, no taker, a ledger that failed
            return self._refused(request, 400, str(exc), name, script)
        if done.word == "paused":
            pauses.settle()  # once answered, no run of the job starts (but a run-now)
        target = f"/jobs/{quote(found.name)}?done={done.word}"
        if done.request is not None:
            target += f"&asked={done.request}"
        if not script:
            return redirect(target)
        outcome: dict[str, object] = {
            "job": found.name,
            "action": action,
            "done": done.word,
            "said": DONE[done.word],
            "page": request.root + target,  # where a person sees it (and the run's end)
        }
        if done.request is not None:
            outcome["request"] = done.request
        return document(outcome)

    def _refused(self, request: Request, status: int, why: str, job: str, script: bool) -> Reply:
        if script:
            return text(status, why)  # as JSON: scheduler.web.server.answered_as
        return self.render.html("refused.html", request, {"why": why, "job": job}, status=status)

    def _do(self, action: str, job: CatalogJob, form: dict[str, str]) -> Done:
        who = pauses.checked(form.get("by"), "by", pauses.MAX_ACTOR)
        # Whoever holds the token may type any name: the record says it came by the page.
        via = f"page on {self.settings.instance_name}"
        actor = f"{who} ({via})" if who else via
        now = self.clock()
        try:
            with self.backend.ledger_engine.begin() as conn:
                if action == "pause":
                    reason = pauses.checked(form.get("reason"), "reason", pauses.MAX_REASON)
                    _, made = pauses.pause(
                        conn, job.key, job.name, by=actor, reason=reason, now=now
                    )
                    return Done("paused" if made else "already")
                if action == "resume":
                    ended = pauses.resume(conn, job.key, job.name, by=actor, now=now)
                    return Done("resumed" if ended else "not-paused")
                if not self._taker_for(conn, job):
                    raise SchedulerError(
                        f"{job.name}: not run: no live replica runs it"
                        " (does their config.yaml have the job?)"
                    )
                namespace = self.settings.namespace
                asked_at = self.backend.now_expression()  # the clock run_now.look reads
                request = run_now.ask(
                    conn, job.key, job.name, by=actor, now=asked_at, namespace=namespace
                )
        except SchedulerError:
            raise
        except Exception as exc:
            log.warning("page: %s %s failed: %s", action, job.name, one_line(exc))
            raise LedgerError(f"cannot {action} {job.name}: the ledger did not answer") from None
        self._withdraw_later(request)
        return Done("run", request)

    def _taker_for(self, conn: Connection, job: CatalogJob) -> bool:
        """Whether a live replica has the job, and so may take a run-now request for it."""
        live = {i["name"] for i in self.backend.live_instances(conn)}
        found = registrations_of(conn, [job.key])
        return any(r.instance in live and r.until is None for r in found)

    def _withdraw_later(self, request: int) -> None:
        """A request nobody takes within the patience of `scheduler trigger` is withdrawn,
        as that command would: a replica that starts later must not run it."""
        self.later(run_now.patience(self.settings.holder_timeout), lambda: self._withdraw(request))

    def _withdraw(self, request: int) -> None:
        try:
            with self.backend.ledger_engine.begin() as conn:
                run_now.withdraw(conn, request)
        except Exception as exc:
            log.warning("page: cannot withdraw run-now request %d: %s", request, one_line(exc))


def _said(request: Request) -> str:
    return printable(f"{request.method} {request.path}"[:200])


def _client(request: Request) -> str:
    return printable(request.client or "an unknown address")
