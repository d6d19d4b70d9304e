"""The library API: a replica inside an application's own processes (web workers).

`Replica` reads its settings as `scheduler run` does (a keyword here stands
where a flag stands there: keyword > environment > `config.yaml` > default)
and runs the same daemon (`scheduler.daemon`), hosted: no signal handler,
only daemon threads, and a stop at interpreter exit. The application owns
the process; the replica never ends it.

With a host lock (on by default here), the processes of one host that share
its file elect one active replica (`scheduler.fleet.host_lock`); the others
stand by, with no database session, and one takes over within a second.

A replica started before a `fork` (gunicorn's `preload_app`, multiprocessing)
does not run as a copy in the child: the child's copy is stopped, without
touching what the parent still uses (its sessions, its lock), and `start()`
in the child starts it afresh as a replica of its own. A replica made (not
started) before the fork has imported what it runs: the children share it.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from scheduler.config.settings import Config, load_config
from scheduler.errors import SchedulerError
from scheduler.fleet.host_lock import POLL, HostLock, default_file
from scheduler.registry.catalog import Catalog, load_catalog

if TYPE_CHECKING:
    from scheduler.daemon import Daemon
    from scheduler.web.asgi import ASGIApp
    from scheduler.web.wsgi import WSGIApp

log = logging.getLogger("scheduler.replica")

START_TIMEOUT = 30.0  # seconds `start()` waits for the ledger before returning anyway
READY_POLL = 0.02  # seconds between looks at whether the lock session is up, in `start()`
JOIN_SLACK = 15.0  # seconds a stop waits beyond the grace for locks to be released


class Replica:
    """One replica of the fleet in this process: `start()`, `stop()`, `with`, `async with`.

    `config`: the path of config.yaml; `modules`: job modules to import by
    name; `loop`: the event loop coroutine jobs run on (by default the loop of
    `async with`, else one per run in its worker thread); any other keyword is
    a setting (`http_token=...`, `host_lock=...`).
    """

    def __init__(
        self,
        config: str | os.PathLike[str] | None = None,
        modules: Sequence[str] = (),
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        **settings: Any,
    ) -> None:
        self._config = None if config is None else os.fspath(config)
        self._loop = loop  # coroutine jobs run on it (else on the loop of `async with`)
        self._entered: asyncio.AbstractEventLoop | None = None
        self._keywords = {**settings, **({"modules": list(modules)} if modules else {})}
        self._guard = threading.Lock()
        self._run: _Run | None = None
        self._pid = os.getpid()
        _import_ahead(self._keywords)

    # -- the lifecycle ------------------------------------------------------------------

    def start(self, timeout: float = START_TIMEOUT) -> Replica:
        """Return once running: active, or on standby behind the host lock.

        Bad configuration raises ConfigError with the line `scheduler check`
        prints. An active replica whose database does not answer within
        `timeout` seconds returns anyway and keeps trying (`/readyz` says 503).
        Starting a running replica does nothing.
        """
        with self._guard:
            self._forget_if_forked()
            if self._run is not None and not self._run.ended.is_set():
                return self
            config = load_config(self._config, given_as="keyword", **self._keywords)
            catalog = load_catalog(config)
            loop = self._loop or self._entered
            if loop is not None:
                from scheduler.host_loop import on_loop

                catalog = on_loop(catalog, loop)
            run = _Run(config, catalog, self._host_lock(config))
            self._run = run
            _RUNNING.add(run)
            run.thread.start()
        run.wait_started(timeout)
        return self

    def stop(self, grace: float | None = None) -> None:
        """No new runs; wait up to `grace` s (default `shutdown_grace`) for running ones;
        release every lock and session. Stopping again, or a replica never started, does
        nothing."""
        with self._guard:
            self._forget_if_forked()
            run = self._run
        if run is not None:
            run.stop(grace)

    def __enter__(self) -> Replica:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self) -> Replica:
        """For an ASGI lifespan: the start waits in a thread, not on the event loop, and
        coroutine jobs will run on this loop."""
        self._entered = asyncio.get_running_loop()
        return await asyncio.to_thread(self.start)

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        await asyncio.to_thread(self.stop)
        self._entered = None

    # -- what it is now -----------------------------------------------------------------

    @property
    def active(self) -> bool:
        """True where this process is its host's active replica (and it is scheduling)."""
        daemon = self.daemon
        return daemon is not None and not daemon.stop_requested.is_set()

    @property
    def standby(self) -> bool:
        """Started, and waiting behind the host lock for the active replica to go."""
        run = self._current()
        return run is not None and run.daemon is None and not run.ended.is_set()

    @property
    def daemon(self) -> Daemon | None:
        """The daemon this process runs while it is the active replica (None otherwise)."""
        run = self._current()
        return None if run is None or run.ended.is_set() else run.daemon

    @property
    def config(self) -> Config | None:
        """The configuration the replica was last started with."""
        run = self._current()
        return None if run is None else run.config

    @property
    def catalog(self) -> Catalog | None:
        """The jobs the replica was last started with."""
        run = self._current()
        return None if run is None else run.catalog

    def asgi(self) -> ASGIApp:
        """The page, /api, /metrics, /healthz and /readyz as an ASGI app, under any prefix."""
        from scheduler.web.asgi import ASGIApp

        return ASGIApp(self)

    def wsgi(self) -> WSGIApp:
        """The same as a WSGI app (its prefix: SCRIPT_NAME)."""
        from scheduler.web.wsgi import WSGIApp

        return WSGIApp(self)

    # -- inside -------------------------------------------------------------------------

    def _current(self) -> _Run | None:
        return None if os.getpid() != self._pid else self._run

    def _forget_if_forked(self) -> None:
        """In a forked child the parent's replica is not ours: drop it, touching nothing."""
        if os.getpid() != self._pid:
            self._pid, self._run = os.getpid(), None

    def _host_lock(self, config: Config) -> HostLock | None:
        from scheduler.backends import embedded_path

        settings = config.settings
        path = settings.host_lock_file(default_file(settings, embedded_path(settings)))
        return None if path is None else HostLock(path)


class _Run:
    """One start of a replica: elect, run the daemon, shut it down, let go of the host lock."""

    def __init__(self, config: Config, catalog: Catalog, host_lock: HostLock | None) -> None:
        self.config = config
        self.catalog = catalog
        self.host_lock = host_lock
        self.stopping = threading.Event()
        self.started = threading.Event()  # standing by, or scheduling
        self.ended = threading.Event()
        self.grace: float | None = None
        self.error: SchedulerError | None = None
        self.daemon: Daemon | None = None
        name = config.settings.instance_name
        self.thread = threading.Thread(target=self._main, name=f"replica-{name}", daemon=True)

    def wait_started(self, timeout: float) -> None:
        """Until standing by, or scheduling with the lock session up (/readyz 200), or
        `timeout`: the dispatcher opens that session on its own thread, after the start."""
        deadline = time.monotonic() + timeout
        self.started.wait(timeout)
        if self.error is not None:
            raise self.error
        if not (self.started.is_set() and self._ready_by(deadline)):
            log.warning(
                "replica %s: the ledger is not ready after %g s; it keeps trying in the"
                " background (/readyz answers 503 until then)",
                self.config.settings.instance_name,
                timeout,
            )

    def _ready_by(self, deadline: float) -> bool:
        """Whether, by `deadline` (monotonic), this run stands by behind the host lock, has
        ended, or schedules with its lock session up."""
        while not (self.ended.is_set() or self.daemon is None or self.daemon.ready()):
            if time.monotonic() >= deadline:
                return False
            self.stopping.wait(READY_POLL)
        return True

    def stop(self, grace: float | None) -> None:
        if not self.stopping.is_set():
            self.grace = grace
            self.stopping.set()
        wait = self.config.settings.shutdown_grace if grace is None else grace
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(wait + JOIN_SLACK)

    def _main(self) -> None:
        try:
            _preload(self.config)
            if self._elect():
                self._serve()
        except SchedulerError as exc:
            self.error = exc
            log.error("replica %s: %s", self.config.settings.instance_name, exc)
        except Exception:
            log.exception("replica %s failed", self.config.settings.instance_name)
        finally:
            if self.host_lock is not None:
                self.host_lock.release()
            _RUNNING.discard(self)
            self.ended.set()
            self.started.set()

    def _elect(self) -> bool:
        """Hold the host lock (or have none); False if stopped while standing by."""
        if self.host_lock is None:
            return True
        said = False
        while not self.stopping.is_set():
            if self.host_lock.try_take():
                if said:
                    log.info("this process is now its host's active replica")
                return True
            self.host_lock.announce(self.config.settings.instance_name)
            if not said:
                log.info("standing by: another process of this host is the active replica")
                self.started.set()
                said = True
            self.stopping.wait(POLL)
        return False

    def _serve(self) -> None:
        from scheduler.daemon import Daemon

        daemon = Daemon(self.config, self.catalog, hosted=True)
        daemon.stop_requested = self.stopping  # one stop for both
        self.daemon = daemon
        try:
            if daemon.begin():
                self.started.set()
                daemon.keep_going()
                daemon.shutdown(self.grace)
            else:
                daemon._close()
        except BaseException:
            daemon._close()
            raise
        finally:
            daemon.backend.ledger_engine.dispose()  # the host goes on: no session is left open


def _import_ahead(keywords: dict[str, Any]) -> None:
    """Import what a replica runs when it is made, not when it starts: made in the code a
    forking server's master imports (gunicorn's preload_app), the workers it forks share
    these pages instead of importing them each (bench/RESULTS.md: In your application).
    The PostgreSQL backend too when the keywords or the environment name a database."""
    import scheduler.daemon
    import scheduler.observers.metrics

    if keywords.get("database_url") or os.environ.get("SCHEDULER_DATABASE_URL"):
        import scheduler.backends.postgres  # noqa: F401  (imported for its cost, now)


def _preload(config: Config) -> None:
    """Import what an active replica runs before standing by: a takeover then waits for
    the database only, not for a second of imports."""
    import scheduler.daemon
    import scheduler.observers.metrics

    if config.settings.embedded:
        import scheduler.backends.embedded
    else:
        import scheduler.backends.postgres  # noqa: F401  (imported for its cost, now)


# Every run started in this process and not yet ended, held here so that a replica the
# application let go of is still stopped at exit.
_RUNNING: set[_Run] = set()


def _stop_all() -> None:
    """At interpreter exit, as SIGTERM would: running jobs get their grace."""
    for run in list(_RUNNING):
        try:
            run.stop(None)
        except Exception:
            log.exception("stopping a replica at exit failed")


atexit.register(_stop_all)
os.register_at_fork(after_in_child=_RUNNING.clear)  # the parent's runs are not the child's
