"""The page: the fleet, every job, and a timeline of runs per replica, served at `/`.

Server-rendered HTML (Jinja2 templates, one stylesheet, a little plain
JavaScript, all inside the package; nothing fetched from elsewhere). It works
with JavaScript off; with it on, it refreshes itself. Like the rest of the
HTTP side it observes the fleet through the ledger, and its three actions go
through the modules the command line uses. Modules:

- `routes`: the HTTP side (every route answers; login, actions)
- `reading`: the GET routes, which see the ledger read-only
- `query`: every query parameter and its parser (`scheduler.config.parsing`)
- `render`: HTML, JSON and one-line answers, and their headers
- `auth`: the token, the session cookie, CSRF and origin checks
- `throttle`: how many wrong tokens a client may send
- `views`: what each page shows, from `scheduler.fleet.status`
- `window`: the timeline's bounded reads of the ledger
- `timeline`, `plot`: SVG drawn on the server (pure functions)
- `words`: a schedule in words and as written
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.backends import Backend
    from scheduler.config.settings import Settings
    from scheduler.registry.catalog import Catalog
    from scheduler.web.server import HealthServer


def mount(
    server: HealthServer, backend: Backend, catalog: Callable[[], Catalog], settings: Settings
) -> None:
    """Add the page's routes to a replica's HTTP server."""
    from scheduler.web.routes import Page

    server.routes.update(Page(backend, catalog, settings).routes())
