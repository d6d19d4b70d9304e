"""The page, /api, /metrics, /healthz and /readyz inside a host's app (`Replica.asgi()`,
`Replica.wsgi()`), answered by the same routes as the replica's own HTTP server.

The adapters (`scheduler.web.asgi`, `scheduler.web.wsgi`) turn a request into a
`Request` (its path below the mount prefix, the prefix as `root`) and the
`Reply` back; this module picks the routes for what the replica is now:

- active: the daemon's probes and metrics, and the page over its backend;
- standby: the probes say `standby`, and the page reads the ledger through
  sessions opened for the request and closed after it (a standby keeps none);
- not started or stopped: 503 everywhere.

The token rules are the page's own (`scheduler.web.routes`): the probes and
/metrics are open, reading the page needs the token only with `http_protect: all`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CONTENT_TYPE_LATEST

from scheduler.backends import open_backend
from scheduler.config.budgets import PROBES
from scheduler.web.server import (
    Reply,
    Request,
    Route,
    _answer,
    _not_routed,
    answered_as,
    find_route,
)

if TYPE_CHECKING:
    from scheduler.backends import Backend
    from scheduler.config.settings import Config, Settings
    from scheduler.registry.catalog import Catalog

Routes = Mapping[tuple[str, str], Route]


class Metrics(Protocol):
    def render(self) -> bytes: ...


class Active(Protocol):
    """What the app reads of the active replica's daemon (`scheduler.daemon.Daemon`)."""

    @property
    def backend(self) -> Backend: ...
    @property
    def settings(self) -> Settings: ...
    @property
    def catalog(self) -> Catalog: ...
    @property
    def metrics(self) -> Metrics | None: ...
    def live(self) -> bool: ...
    def ready(self) -> bool: ...


class HostedReplica(Protocol):
    """What the app reads of its replica (`scheduler.Replica`): the web layer sits below
    the replica and the daemon, and knows them only by this shape."""

    @property
    def daemon(self) -> Active | None: ...
    @property
    def standby(self) -> bool: ...
    @property
    def config(self) -> Config | None: ...
    @property
    def catalog(self) -> Catalog | None: ...
    def start(self) -> object: ...
    def stop(self) -> None: ...


STOPPED = Reply(503, b"stopped\n")
NOT_RUNNING = Reply(503, b"the scheduler is not running in this process\n")
STANDBY = Reply(200, b"standby\n")
ACTIVE_GAUGE = (
    "# HELP scheduler_replica_active 1 where this process is its host's active replica\n"
    "# TYPE scheduler_replica_active gauge\n"
    "scheduler_replica_active {}\n"
)


class Hosted:
    """Answers requests for one replica, whatever it is now (active, standby, stopped)."""

    def __init__(self, replica: HostedReplica) -> None:
        self.replica = replica
        self._guard = threading.Lock()
        self._page: tuple[object, Routes] | None = None  # the routes, and what they read

    def answer(self, request: Request) -> Reply:
        """The reply, never an exception (a route's fault is a 500 with one log line)."""
        routes = {**self._probes(), **self._page_routes()}
        route = find_route(routes, request.method, request.path)
        reply = _not_routed(routes, request) if route is None else _answer(route, request)
        return answered_as(request, reply)

    def is_probe(self, request: Request) -> bool:
        """A probe is answered at once, never queued behind the page."""
        return request.method == "GET" and request.path in PROBES

    def _probes(self) -> dict[tuple[str, str], Route]:
        return {
            ("GET", "/healthz"): lambda _: self._probe(lambda d: d.live()),
            ("GET", "/readyz"): lambda _: self._probe(lambda d: d.ready()),
            ("GET", "/metrics"): lambda _: self._metrics(),
        }

    def _probe(self, check: Callable[[Active], bool]) -> Reply:
        daemon = self.replica.daemon
        if daemon is not None:
            return Reply(200, b"ok\n") if check(daemon) else Reply(503, b"unavailable\n")
        return STANDBY if self.replica.standby else STOPPED

    def _metrics(self) -> Reply:
        daemon = self.replica.daemon
        body = b""
        if daemon is not None and daemon.metrics is not None:
            body = daemon.metrics.render()
        gauge = ACTIVE_GAUGE.format(1 if daemon is not None else 0).encode()
        return Reply(200, body + gauge, CONTENT_TYPE_LATEST)

    def _page_routes(self) -> Routes:
        """The page's routes for what the replica is now, made once for each daemon or
        start (its configuration)."""
        daemon = self.replica.daemon
        if daemon is not None:
            # The catalog as the daemon has it now (a reload replaces it).
            return self._made(
                daemon, lambda: _page(daemon.backend, lambda: daemon.catalog, daemon.settings)
            )
        config, catalog = self.replica.config, self.replica.catalog
        if not self.replica.standby or config is None or catalog is None:
            return {key: lambda _: NOT_RUNNING for key in _PAGE_KEYS}
        return self._made(config, lambda: _standby_page(config.settings, catalog))

    def _made(self, subject: object, make: Callable[[], Routes]) -> Routes:
        with self._guard:
            if self._page is None or self._page[0] is not subject:
                self._page = (subject, make())
            return self._page[1]


def _page(backend: Backend, catalog: Callable[[], Catalog], settings: Settings) -> Routes:
    from scheduler.web.routes import Page

    return Page(backend, catalog, settings).routes()


def _standby_page(settings: Settings, catalog: Catalog) -> Routes:
    """A standby keeps no session: each page request opens its own, closed after it."""
    backend = open_backend(settings)  # opens nothing until a page is read
    routes = _page(backend, lambda: catalog, settings)
    return {key: _closing(route, backend) for key, route in routes.items()}


def _closing(route: Route, backend: Backend) -> Route:
    """A standby's page route: the ledger sessions it opened are closed after it."""

    def answer(request: Request) -> Reply:
        try:
            return route(request)
        finally:
            backend.ledger_engine.dispose()

    return answer


# What a process without a running replica answers 503 to, rather than 404.
_PAGE_KEYS = (
    ("GET", "/"),
    ("GET", "/jobs/*"),
    ("GET", "/api/*"),
    ("GET", "/login"),
    ("GET", "/static/*"),
    ("POST", "/jobs/*"),
    ("POST", "/login"),
    ("POST", "/logout"),
)


def prefixed(reply: Reply, root: str) -> Reply:
    """A redirect to one of the page's paths goes under the mount prefix."""
    if not root:
        return reply
    headers = tuple(
        (name, root + value if name == "Location" and _local(value) else value)
        for name, value in reply.headers
    )
    return Reply(reply.status, reply.body, reply.content_type, headers)


def _local(target: str) -> bool:
    return target.startswith("/") and not target.startswith("//")
