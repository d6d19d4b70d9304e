"""The daemon: APScheduler fires ticks, the gate decides where each one runs.

APScheduler 3 computes the ticks (its executor receives the scheduled run
times); our executor hands them to the gate instead of running them, so no
tick ever runs without passing the gate. Signals: the first SIGTERM/SIGINT
stops new runs, waits up to `shutdown_grace` and releases every lock; a
second one exits at once. SIGHUP reloads config.yaml (see `scheduler.fleet.reload`).

Hosted in an application's process (`scheduler.replica`), the daemon installs
no signal handler, freezes nothing of the host's for the collector, and never
ends the process: the host owns signals, memory and exit.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from types import FrameType
from typing import TYPE_CHECKING, Any

from apscheduler.executors.base import BaseExecutor
from apscheduler.schedulers.background import BackgroundScheduler
from sqlalchemy.exc import SQLAlchemyError

from scheduler.backends import Backend, open_backend
from scheduler.backends.base import Unavailable
from scheduler.config.settings import Config
from scheduler.errors import ConfigError, one_line
from scheduler.fleet import catch_up
from scheduler.fleet.catch_up import CatchUp
from scheduler.fleet.due import first_from
from scheduler.fleet.housekeeping import Housekeeping, NameInUse
from scheduler.fleet.reload import FileWatch, PendingReload, Unsettled, reread
from scheduler.fleet.run_now import Desk
from scheduler.gate import Backoff, Gate
from scheduler.logs import stop_logging
from scheduler.observers import events
from scheduler.observers.notices import Notices
from scheduler.observers.pings import Pings
from scheduler.observers.runlog import RunLog
from scheduler.registry.catalog import Catalog, CatalogJob

if TYPE_CHECKING:  # imported when used: a replica without an HTTP port never loads them
    from scheduler.observers.metrics import Metrics
    from scheduler.web.server import HealthServer

log = logging.getLogger("scheduler.daemon")


class GateExecutor(BaseExecutor):  # type: ignore[misc]  # APScheduler ships no types
    """Hands every fired tick to the gate; APScheduler's instance limits do not apply.

    Overlap is the gate's business (fleet-wide, through the lock), and every
    tick must reach it, or a skipped tick would go unrecorded. One APScheduler
    job stands for every job on the same schedule: its tick is each of theirs.
    """

    def __init__(self, gate: Gate, groups: dict[str, list[CatalogJob]]) -> None:
        super().__init__()
        self.gate = gate
        self.groups = groups

    def submit_job(self, job: Any, run_times: list[datetime]) -> None:
        group = self.groups[job.id]
        for run_time in run_times:
            self.gate.submit_all(group, run_time.astimezone(UTC))

    def _do_submit_job(self, job: Any, run_times: list[datetime]) -> None:  # pragma: no cover
        raise NotImplementedError


def _noop() -> None:
    """APScheduler needs a callable; the gate runs the real job."""


class GateScheduler(BackgroundScheduler):  # type: ignore[misc]  # APScheduler ships no types
    """Hands the gate each burst of due ticks whole, so one claim covers them all.

    Jobs on the same grid fall due together; without this the gate would claim
    the first tick of a burst alone while APScheduler is still submitting the
    rest, and every replica would pay a round trip per fragment. APScheduler has
    no public hook around one pass over due jobs: `_process_jobs` is private,
    hence the pinned version range (docs/architecture.md, "APScheduler").
    """

    def __init__(self, gate: Gate, groups: dict[str, list[CatalogJob]], **options: Any) -> None:
        super().__init__(**options)
        self._gate = gate
        self.executor = GateExecutor(gate, groups)
        self.add_executor(self.executor, "default")

    def _process_jobs(self) -> float | None:
        with self._gate.burst():
            wait: float | None = super()._process_jobs()
            return wait


def groups_of(catalog: Catalog) -> dict[str, list[CatalogJob]]:
    """Scheduled jobs by distinct schedule (see `catalog.schedule_key`), named by their first."""
    by_schedule: dict[tuple[object, ...], list[CatalogJob]] = {}
    for job in catalog.scheduled:
        assert job.schedule_key is not None  # scheduled jobs have a schedule
        by_schedule.setdefault(job.schedule_key, []).append(job)
    return {group[0].name: group for group in by_schedule.values()}


def build_scheduler(catalog: Catalog, gate: Gate) -> GateScheduler:
    """One APScheduler job per distinct schedule."""
    groups = groups_of(catalog)
    scheduler = GateScheduler(gate, groups, timezone=UTC)
    for name, group in groups.items():
        _add_group(scheduler, name, group)
    return scheduler


def _add_group(
    scheduler: BackgroundScheduler,
    name: str,
    group: list[CatalogJob],
    next_run_time: datetime | None = None,
) -> None:
    options: dict[str, Any] = {} if next_run_time is None else {"next_run_time": next_run_time}
    scheduler.add_job(
        _noop,
        trigger=group[0].trigger,
        id=name,
        name=name if len(group) == 1 else f"{name} and {len(group) - 1} more",
        coalesce=True,
        misfire_grace_time=None,  # the gate decides, by the database clock
        max_instances=1,
        **options,
    )


def reschedule(scheduler: GateScheduler, catalog: Catalog, since: datetime) -> None:
    """Replace the schedules between two ticks; a schedule that did not change keeps going.

    A changed one starts at its first tick from `since`, the instant it came in
    force (`Housekeeping.reregister`): the ticks before were the old schedule's,
    which fired them (`scheduler.fleet.due`); a tick both fired has one row in the
    ledger (its primary key), so it runs once. Ticks already handed to the gate
    run under the settings they were claimed with.
    """
    executor = scheduler.executor
    old, new = executor.groups, groups_of(catalog)
    kept = {
        name
        for name in old
        if name in new and old[name][0].schedule_key == new[name][0].schedule_key
    }
    scheduler.pause()
    try:
        for name in old:
            if name not in kept:
                scheduler.remove_job(name)
        executor.groups = new  # kept schedules too: their jobs' thresholds may have changed
        for name, group in new.items():
            if name not in kept:
                _add_group(scheduler, name, group, first_from(group[0], since))
    finally:
        scheduler.resume()


def _metrics(catalog: Catalog) -> Metrics:
    from scheduler.observers.metrics import Metrics

    return Metrics([job.name for job in catalog])


class Daemon:
    """One replica: backend, gate, scheduler, optional HTTP; signals end it (`run`), or
    its host does (`begin`, then `stop_requested` and `shutdown`, when `hosted`)."""

    def __init__(
        self,
        config: Config,
        catalog: Catalog,
        *,
        backend: Backend | None = None,
        listeners: Sequence[events.Listener] = (),
        monotonic: Callable[[], float] = time.monotonic,
        hosted: bool = False,
    ) -> None:
        self.config = config
        self.hosted = hosted
        self.monotonic = monotonic
        self.settings = config.settings
        self.catalog = catalog
        self.backend = backend or open_backend(self.settings)
        self.stop_requested = threading.Event()
        self.reload_requested = threading.Event()
        self.reloads = PendingReload(monotonic)
        self.signals = 0
        # Metrics exist to be scraped: without an HTTP port (or a host's app), none are kept.
        self.metrics = _metrics(catalog) if self.settings.http_port or hosted else None
        self.notices = self._notices()
        self.pings = Pings()
        observers = [
            RunLog(structured=self.settings.log_format == "json"),
            self.notices,
            self.pings,
            *([self.metrics] if self.metrics else []),
        ]
        self.listeners: list[events.Listener] = [*observers, *listeners]
        self.gate = Gate(
            self.backend,
            instance=self.settings.instance_name,
            max_workers=self.settings.max_workers,
            holder_timeout=self.settings.holder_timeout,
            listeners=self.listeners,
            desk=Desk(self.backend.ledger_engine, lambda: self.catalog, lambda: datetime.now(UTC)),
        )
        self.catching_up = CatchUp(
            self.gate, self.backend, lambda: self.catalog, instance=self.settings.instance_name
        )
        self.gate.listeners.append(self.catching_up)  # a pass each time the lock session is up
        self.housekeeping = Housekeeping(
            self.backend,
            catalog,
            self.settings,
            on_streaks=self.metrics.streaks if self.metrics else None,
            on_drift=self.metrics.drift if self.metrics else None,
            notices=self.notices,
            going_here=self.gate.run_ids,
        )
        self.scheduler = build_scheduler(catalog, self.gate)
        self.http = self._http(self.settings.http_port) if self.settings.http_port else None

    def _notices(self) -> Notices:
        webhook = self.settings.alert_webhook_url
        return Notices(
            self.backend.ledger_engine,
            self.settings.instance_name,
            webhook.get_secret_value() if webhook else None,
            on_alert=self.metrics.alert if self.metrics else None,
            on_delivery=self.metrics.delivery if self.metrics else None,
        )

    def _http(self, port: int) -> HealthServer:
        """The probes, /metrics and the page, on the replica's own port."""
        from scheduler.web import mount
        from scheduler.web.server import HealthServer

        assert self.metrics is not None  # kept whenever there is an HTTP port
        http = HealthServer(
            self.settings.http_host,
            port,
            live=self.live,
            ready=self.ready,
            metrics=self.metrics.render,
        )
        mount(http, self.backend, lambda: self.catalog, self.settings)
        return http

    def prepare(self) -> bool:
        """Create or migrate the schema; waits for the database rather than exiting.

        What no retry can mend (a wrong password, a database or privilege that
        does not exist, a pooler that does not keep sessions) ends the start-up
        with the one line `scheduler check` prints (ConfigError: exit 2); the
        rest is retried, at ERROR once it has lasted a minute.
        """
        backoff = Backoff(first=0.5, cap=5.0)
        since = self.monotonic()
        name_taken: float | None = None  # when this replica's name was first found in use
        while not self.stop_requested.is_set():
            try:
                self.backend.verify()
                found = self.backend.migrate()
                self.housekeeping.track_jobs()
            except NameInUse as exc:
                name_taken = self._name_in_use(exc, name_taken)
                self.stop_requested.wait(1.0)
                continue
            except Unavailable as exc:
                problem = str(exc)
            except SQLAlchemyError as exc:  # no passing database error ends the daemon
                if is_permanent(exc):
                    raise ConfigError(f"cannot prepare the ledger: {self._say(exc)}") from None
                problem = self._say(exc)
            else:
                if found == 0:
                    log.info("created the ledger schema")
                return True
            waited = self.monotonic() - since
            level = logging.ERROR if waited > 60 else logging.WARNING
            log.log(level, "database unreachable (%s); retrying", problem)
            self.stop_requested.wait(backoff.next_delay() + 0.5)
        return False

    def _name_in_use(self, exc: NameInUse, since: float | None) -> float:
        """Wait for a session holding this replica's name to end, then refuse.

        A replica restarted at once (SIGKILL, OOM, a host that came back) can find
        its earlier session still up: the server ends it within `holder_timeout`
        (idle_session_timeout) or sooner (a statement that was waiting times
        out). A second live replica of the same name keeps its session: after
        that wait, the start is refused (exit 2).
        """
        now = self.monotonic()
        patience = 2 * self.settings.holder_timeout + 5
        if since is None:
            log.warning(
                "%s; waiting up to %g s in case it is this replica's earlier session, "
                "still ending after a restart",
                exc,
                patience,
            )
            return now
        if now - since > patience:
            raise exc
        return since

    def _say(self, exc: BaseException) -> str:
        say = getattr(self.backend, "say", None)
        return say(exc) if callable(say) else one_line(exc)

    def run(self) -> int:
        self._install_signals()
        if not self.begin():
            return self._close()
        # What start-up built (modules, settings, the catalog) lives as long as the
        # daemon. Frozen, it is out of the collector's sight: a full collection no
        # longer walks it (it paused every thread for 50-90 ms at 500 runs a second).
        gc.collect()
        gc.freeze()
        self.keep_going()
        return self.shutdown()

    def keep_going(self) -> None:
        """Until a stop is asked: reloads when asked (SIGHUP) or when the file changes.

        A signal the kernel hands to another thread only trips a flag; Python runs
        the handler when the main thread next wakes, so it wakes every second.
        """
        watching = self.settings.reload == "watch"
        watch = FileWatch(self.config.path, self.monotonic) if watching else None
        while not self.stop_requested.wait(1.0):
            self._reload_if_asked(watch)

    def begin(self) -> bool:
        """Serve HTTP, prepare the ledger, start scheduling; False if stopped first."""
        log.info(
            "replica %s starting: %d job(s), %d scheduled, backend %s",
            self.settings.instance_name,
            len(self.catalog),
            len(self.catalog.scheduled),
            self.backend.name,
        )
        if self.http is not None:
            self.http.start()  # /healthz answers while we wait for the database
        if not self.prepare():
            return False
        self.gate.start()
        self.housekeeping.start()
        self.scheduler.start()
        engine = self.backend.ledger_engine
        catch_up.submit_latest(self.catalog, self.gate, engine, datetime.now(UTC))
        return True

    def _reload_if_asked(self, watch: FileWatch | None) -> None:
        """A reload asked for (SIGHUP, the watched file) or still pending is tried now."""
        changed = watch is not None and watch.changed()
        if self.reload_requested.is_set() or changed:
            self.reload_requested.clear()
            self.reloads.ask("SIGHUP" if not changed else "config.yaml changed")
        why = self.reloads.due()
        if why is not None:
            self.reload(why)

    def reload(self, why: str) -> bool:
        """Re-read config.yaml and apply it between ticks; an invalid file changes nothing."""
        try:
            reloaded = reread(self.config, self.catalog)
            since = self.housekeeping.reregister(reloaded.catalog)
        except ConfigError as exc:
            self.reloads.settled()
            log.error(
                "%s: config.yaml not reloaded: %s; the replica keeps its configuration", why, exc
            )
            return False
        except (SQLAlchemyError, Unsettled) as exc:
            said = f"the ledger: {self._say(exc)}" if isinstance(exc, SQLAlchemyError) else exc
            if self.reloads.failed(why, str(said)):
                log.error(
                    "%s: config.yaml not reloaded: %s; trying again until it applies", why, said
                )
            return False
        self.reloads.settled()
        changes = reloaded.changes(self.catalog)
        reschedule(self.scheduler, reloaded.catalog, since)
        self.config, self.catalog = reloaded.config, reloaded.catalog
        self.gate.reloaded(self.catalog.by_key)
        log.info(
            "%s: config.yaml reloaded: %s; job code is not reloaded (that needs a restart)",
            why,
            "; ".join(changes) if changes else "no job changed",
        )
        if reloaded.restart_needed:
            log.warning(
                "config.yaml: %s changed: applied at the next restart, not by a reload",
                ", ".join(reloaded.restart_needed),
            )
        return True

    def shutdown(self, grace: float | None = None) -> int:
        """No new runs; wait up to `grace` (default `shutdown_grace`); release every lock."""
        grace = self.settings.shutdown_grace if grace is None else grace
        log.info(
            "stopping: no new runs; waiting up to %g s for %s",
            grace,
            ", ".join(self.gate.running_jobs()) or "no running job",
        )
        if self.scheduler.running:
            self.scheduler.shutdown(wait=False)
        self.housekeeping.stop()
        self.catching_up.stop()
        abandoned = self.gate.stop(grace)
        if abandoned and self.hosted:
            self._close()
            self._release_when_done(abandoned)
            return 0
        if abandoned:
            # Their threads cannot be stopped. They were told (ctx.lock_lost) and recorded
            # crashed; their locks go with the session when the process ends, now, so no
            # other replica starts the job while they still run. Notices stay in the outbox.
            log.error(
                "gave up waiting for %s: told them their lock is lost, recorded them crashed; "
                "exiting now (their locks go with this process)",
                ", ".join(abandoned),
            )
            stop_logging()
            os._exit(0)
        self._close()
        log.info("stopped cleanly; every lock released")
        return 0

    def _release_when_done(self, abandoned: list[str]) -> None:
        """Hosted, the process goes on: the abandoned runs keep their locks until they end.

        They were told (ctx.lock_lost) and recorded crashed; no other replica may
        start their jobs while they still run here, so the lock session is closed
        only after them (on PostgreSQL the server ends it sooner, within
        `holder_timeout`, as it ends a frozen replica's).
        """
        log.error(
            "gave up waiting for %s: told them their lock is lost, recorded them crashed; "
            "their locks are released when they return",
            ", ".join(abandoned),
        )
        gate = self.gate

        def release() -> None:
            gate.table.workers.wait()
            gate.backend.close()

        threading.Thread(target=release, name="release-abandoned", daemon=True).start()

    def _close(self) -> int:
        self.notices.close()
        self.pings.close()
        if self.http is not None:
            self.http.stop()
        return 0

    def live(self) -> bool:
        """/healthz: the daemon's loop turns: still waiting for the database, or scheduling."""
        if self.stop_requested.is_set():
            return False
        return not self.scheduler.running or self.gate.alive()

    def ready(self) -> bool:
        """/readyz: jobs loaded, the ledger ready, and the lock session up."""
        return self.scheduler.running and self.gate.connected

    def _install_signals(self) -> None:
        handler: Callable[[int, FrameType | None], None] = self._on_signal
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGHUP, lambda _signum, _frame: self.reload_requested.set())

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.signals += 1
        if self.signals > 1:
            os.write(2, b"second signal: exiting at once\n")
            os._exit(128 + signum)
        self.stop_requested.set()


def is_permanent(exc: BaseException) -> bool:
    """A ledger error no retry mends (PostgreSQL only: the embedded file has none)."""
    from scheduler.backends.pg_session import is_permanent as refused

    return refused(exc)
