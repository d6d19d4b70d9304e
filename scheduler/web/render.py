"""How the page answers: HTML from its templates, JSON, one-line text, and the headers
every answer carries."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import Any

from jinja2 import Environment, PackageLoader, select_autoescape

from scheduler.web import query
from scheduler.web.auth import Guard, Session
from scheduler.web.server import JSON, Reply, Request
from scheduler.web.timeline import when

HTML = "text/html; charset=utf-8"
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


class Render:
    def __init__(self, guard: Guard, instance: str, clock: Callable[[], datetime]) -> None:
        self.guard = guard
        self.instance = instance
        self.clock = clock
        self.templates = Environment(
            loader=PackageLoader("scheduler.web", "templates"),
            autoescape=select_autoescape(default=True, default_for_string=True),
            trim_blocks=True,
            lstrip_blocks=True,
        )
        self.templates.filters["when"] = when

    def html(
        self, template: str, request: Request, data: dict[str, Any], status: int = 200
    ) -> Reply:
        session: Session | None = self.guard.session(request.headers)
        page = self.templates.get_template(template).render(
            **data,
            refresh=query.parsed(request).get("refresh"),
            path=request.path,
            root=request.root,
            instance=self.instance,
            actions_on=self.guard.actions_on,
            session=session,
            csrf=self.guard.csrf(session),
            now=self.clock(),
        )
        return Reply(status, page.encode(), HTML, SECURITY)


def document(value: object, status: int = 200) -> Reply:
    """A JSON answer (the API's)."""
    return Reply(status, json.dumps(value, indent=2).encode(), JSON, SECURITY)


def text(status: int, line: str, headers: tuple[tuple[str, str], ...] = ()) -> Reply:
    """A one-line answer (an error, a refusal)."""
    return Reply(status, f"{line}\n".encode(), headers=(*headers, *SECURITY))


def redirect(target: str, headers: tuple[tuple[str, str], ...] = ()) -> Reply:
    return Reply(303, b"", headers=(("Location", target), *headers, *SECURITY))
