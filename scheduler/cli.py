"""The command line: `scheduler run | check | jobs | status | history | trigger | pause | resume`.

Configuration and usage errors exit 2 with one clear message and no
traceback; no command ever prints a password or a webhook secret.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from datetime import UTC, datetime, tzinfo
from typing import Any

from scheduler import __version__
from scheduler.backends import Backend
from scheduler.catalog import Catalog, CatalogJob, load_catalog
from scheduler.config import Config, load_config
from scheduler.errors import ConfigError, one_line, shorten
from scheduler.ledger import TickFilter
from scheduler.schedules import zone
from scheduler.statuses import Status
from scheduler.tables import instant, lasted, table
from scheduler.text import printable

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_HELD = 0, 1, 2, 3
MAX_PREVIEW = 1000  # ticks `jobs --next` lists per job, at most


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", help="path of config.yaml (default ./config.yaml)")
    common.add_argument("--jobs", help="folder of job modules (default: jobs/ beside the config)")
    parser = argparse.ArgumentParser(
        prog="scheduler",
        description="A fleet scheduler: every tick of every job runs on exactly one replica.",
    )
    parser.add_argument("--version", action="version", version=f"scheduler {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser("run", parents=[common], help="run the daemon")
    run.add_argument("--http-port", type=int, help="serve /healthz, /readyz, /metrics")
    commands.add_parser(
        "check", parents=[common], help="validate config, jobs and keys (and the database)"
    )
    jobs = commands.add_parser(
        "jobs", parents=[common], help="list every job and its next tick (or its next N ticks)"
    )
    jobs.add_argument("job", nargs="?", help="only this job")
    jobs.add_argument(
        "--next",
        metavar="N",
        help=f"list each job's next N ticks (1 to {MAX_PREVIEW}), in its time zone",
    )
    jobs.add_argument(
        "--after",
        metavar="ISO-8601",
        help="count ticks from this instant instead of now, e.g. 2026-10-25T01:30:00+01:00; "
        "without an offset it is read in the `timezone` setting",
    )
    jobs.add_argument("--json", action="store_true")
    status = commands.add_parser("status", parents=[common], help="the fleet now")
    status.add_argument(
        "--tz", metavar="ZONE", default="UTC", help="show times in this zone (default UTC)"
    )
    status.add_argument("--json", action="store_true")
    history = commands.add_parser("history", parents=[common], help="recent ticks")
    history.add_argument("job", nargs="?", help="only this job")
    history.add_argument(
        "--limit",
        type=_positive,
        help="how many ticks, newest first (default 50; with --since or --until, all)",
    )
    history.add_argument(
        "--since", metavar="AGE|ISO-8601", help="ticks scheduled since: 12h, 30m, 2d or an instant"
    )
    history.add_argument("--until", metavar="ISO-8601", help="ticks scheduled until an instant")
    history.add_argument(
        "--status", metavar="S[,S...]", help="only these statuses, e.g. failed,crashed"
    )
    history.add_argument("--instance", metavar="NAME", help="only ticks this replica recorded")
    history.add_argument(
        "--tz", metavar="ZONE", default="UTC", help="show times in this zone (default UTC)"
    )
    history.add_argument("--json", action="store_true")
    trigger = commands.add_parser(
        "trigger", parents=[common], help="run one tick of a job now, on a live replica"
    )
    trigger.add_argument("job")
    trigger.add_argument(
        "--here", action="store_true", help="run it in this process instead (through the gate)"
    )
    pause = commands.add_parser(
        "pause", parents=[common], help="pause a job for the whole fleet (persisted)"
    )
    pause.add_argument("job")
    pause.add_argument("--reason", help="why, kept with the pause and shown by `status`")
    pause.add_argument("--by", help="who pauses it (default: user@host)")
    resume = commands.add_parser("resume", parents=[common], help="resume a paused job")
    resume.add_argument("job")
    resume.add_argument("--by", help="who resumes it (default: user@host)")
    return parser


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text!r}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        code = _dispatch(args)
    except ConfigError as exc:
        print(f"scheduler: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    if args.command in ("run", "trigger"):
        # Job code ran in this process and may have left threads of its own (not daemon
        # threads), which the interpreter would wait for. Every lock is released by now.
        from scheduler.logs import stop_logging

        stop_logging()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _dispatch(args: argparse.Namespace) -> int:
    flags: dict[str, Any] = {"jobs_path": args.jobs}
    if args.command == "run":
        flags["http_port"] = args.http_port
    config = load_config(args.config, **flags)
    catalog = load_catalog(config)
    if args.command == "run":
        return _run(config, catalog)
    if args.command == "check":
        return _check(config, catalog)
    if args.command == "jobs":
        return _jobs(config, catalog, args.job, args.next, args.after, as_json=args.json)
    if args.command == "status":
        return _status(config, catalog, _zone_flag(args.tz), as_json=args.json)
    if args.command == "history":
        return _history(config, catalog, _history_filter(args, catalog), args.tz, args.json)
    if args.command == "trigger":
        if args.here:
            return _trigger(config, catalog, args.job)
        return _trigger_on_fleet(config, catalog, args.job)
    if args.command == "pause":
        return _pause(config, catalog, args.job, args.reason, args.by)
    if args.command == "resume":
        return _resume(config, catalog, args.job, args.by)
    raise ConfigError(f"unknown command {args.command!r}")  # pragma: no cover


def _run(config: Config, catalog: Catalog) -> int:
    from scheduler.daemon import Daemon
    from scheduler.logs import setup_logging

    settings = config.settings
    setup_logging(settings.log_format)
    if settings.database_url is None:
        from scheduler.backends import embedded_path

        logging.getLogger("scheduler").warning(
            "no database configured: embedded mode (SQLite ledger %s and file locks). "
            "It coordinates the processes of this host only; point the fleet at PostgreSQL "
            "with SCHEDULER_DATABASE_URL=postgresql://...",
            embedded_path(settings),
        )
    return Daemon(config, catalog).run()


def _check(config: Config, catalog: Catalog) -> int:
    settings = config.settings
    counts = f"{len(catalog)} job(s), {len(catalog.scheduled)} scheduled"
    print(f"{'config':<16} {'ok':<4} {config.path}: {counts}")
    for job in catalog:
        print(f"{'job':<16} {'ok':<4} {job.name} (key {job.key}): {job.describe()}")
    if settings.database_url is None:
        from scheduler.backends import embedded_path

        print(
            f"{'database':<16} {'--':<4} embedded mode: {embedded_path(settings)} (this host only)"
        )
        return EXIT_OK
    from scheduler.checks import database_checks

    fatal = False
    print(f"{'schema':<16} {'ok':<4} {settings.schema_name} (lock namespace {settings.namespace})")
    url = settings.database_url.get_secret_value()
    for check in database_checks(url, settings.instance_name, settings.schema_name):
        mark = "ok" if check.ok else ("FAIL" if check.fatal else "warn")
        print(f"{check.name:<16} {mark:<4} {check.detail}")
        fatal |= check.fatal and not check.ok
    if not fatal:
        _check_schedules(config, catalog)
    return EXIT_USAGE if fatal else EXIT_OK


def _check_schedules(config: Config, catalog: Catalog) -> None:
    """Whether the live replicas run what this config.yaml says (a warning, never a failure)."""
    from sqlalchemy import inspect

    from scheduler.backends import open_backend
    from scheduler.status import schedule_checks

    backend = open_backend(config.settings)
    try:
        with backend.ledger_engine.connect() as conn:
            if not inspect(conn).has_table("scheduler_registrations"):
                print(f"{'schedules':<16} {'--':<4} no ledger yet: no replica has started")
                return
        for agrees, detail in schedule_checks(backend, catalog):
            print(f"{'schedules':<16} {'ok' if agrees else 'warn':<4} {printable(detail)}")
    except Exception as exc:
        print(f"{'schedules':<16} {'warn':<4} cannot compare: {one_line(exc)}")
    finally:
        backend.ledger_engine.dispose()


def _jobs(
    config: Config,
    catalog: Catalog,
    name: str | None,
    count: str | None,
    after: str | None,
    *,
    as_json: bool,
) -> int:
    """Every job (or one) and its next tick; with `--next N`, its next N ticks."""
    n = _preview_count(count) if count is not None else None
    where = zone(config.settings.timezone)
    now = _instant("--after", after, where) if after is not None else datetime.now(UTC)
    jobs = list(catalog) if name is None else [_named(catalog, name)]
    if n is None:
        rows = [{**job.as_json(now), "source": job.spec.source} for job in jobs]
        if as_json:
            print(json.dumps(rows, indent=2))
        else:
            table(rows, ["name", "key", "schedule", "timezone", "next_tick", "source"])
        return EXIT_OK
    previews = [(job, job.next_ticks(now, n)) for job in jobs]
    if as_json:
        document = []
        for job, ticks in previews:
            local = [job.local(tick) for tick in ticks]
            row = {**job.as_json(now), "source": job.spec.source}
            document.append({**row, "next_tick": local[0] if local else None, "next_ticks": local})
        print(json.dumps(document, indent=2))
        return EXIT_OK
    for job, ticks in previews:
        print(f"{job.name} (key {job.key}): {job.describe()}, {job.timezone}")
        for tick in ticks:
            local = job.local(tick)
            print(f"  {local}" + ("" if local.endswith("+00:00") else f"  ({tick.isoformat()})"))
        if not ticks:
            print("  no ticks: " + ("runs only by hand" if job.schedule is None else "disabled"))
    return EXIT_OK


def _preview_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_PREVIEW:
        raise ConfigError(f"--next: expected a whole number from 1 to {MAX_PREVIEW}, got {text!r}")
    return value


ISO_EXAMPLE = "an ISO-8601 date and time such as 2026-10-25T01:30:00+01:00"


def _instant(flag: str, text: str, tz: tzinfo, expected: str = ISO_EXAMPLE) -> datetime:
    """ISO-8601; without an offset, a wall-clock time in `tz`. Else one line naming `flag`."""
    try:
        value = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ConfigError(f"{flag}: expected {expected}, got {shorten(text)!r}") from None
    if value.tzinfo is None:
        value = value.replace(tzinfo=tz)
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise ConfigError(f"{flag}: {shorten(text)!r} is out of range (years 1 to 9999)") from None


def _named(catalog: Catalog, name: str) -> CatalogJob:
    job = catalog.by_name(name)
    if job is None:
        raise ConfigError(f"no job named {shorten(name)!r} (see `scheduler jobs`)")
    return job


def _ledger_backend(config: Config) -> Backend:
    """The backend, for reading: the schema must exist (a replica creates it)."""
    from scheduler.backends import open_backend

    backend = open_backend(config.settings)
    try:
        backend.migrate()
    except Exception as exc:
        raise ConfigError(f"cannot reach the ledger: {one_line(exc)}") from None
    return backend


def _status(config: Config, catalog: Catalog, tz: tzinfo, *, as_json: bool) -> int:
    from scheduler.status import fleet_status, running_words

    document = fleet_status(_ledger_backend(config), catalog, datetime.now(UTC))
    if as_json:
        print(json.dumps(document, indent=2))
        return EXIT_OK
    instances = document["instances"]
    print(f"backend: {document['backend']}; {len(instances)} live instance(s)")
    for instance in instances:
        since = f" since {instant(instance['since'], tz)}" if instance["since"] else ""
        print(f"  {instance['name']}{since} ({instance['address'] or 'local'})")
    rows = []
    for job in document["jobs"]:
        run, last, paused = job["running"], job["last_run"], job["paused"]
        rows.append(
            {
                "job": job["name"],
                "key": job["key"],
                "schedule": job["schedule"],
                "running": running_words(run, lambda at: instant(at, tz)) if run else "",
                "last": f"{last['status']} {instant(last['finished_at'], tz)}".strip()
                if last
                else "",
                "skips": f"{job['consecutive_skips']}/{job['skip_alert_after']}",
                "failures": f"{job['consecutive_failures']}/{job['fail_alert_after']}",
                "alerting": "yes" if job["alerting"] else "",
                "paused": _paused_cell(paused, tz),
                "schedules": _schedules_cell(job["schedules"]),
                "next_tick": instant(job["next_tick"], tz) if not paused else "(paused)",
            }
        )
    print()
    columns = ["job", "key", "schedule", "running", "last", "skips", "failures", "alerting"]
    table(rows, [*columns, "paused", "schedules", "next_tick"])
    return EXIT_OK


def _paused_cell(paused: dict[str, Any] | None, tz: tzinfo) -> str:
    if paused is None:
        return ""
    why = f": {paused['reason']}" if paused["reason"] else ""
    return f"by {paused['by']} since {instant(paused['at'], tz)}{why}"


def _schedules_cell(found: list[dict[str, Any]]) -> str:
    """Empty when the live replicas agree; else each schedule and who runs it."""
    if len(found) <= 1:
        return ""
    return "DIFFER: " + "; ".join(f"{v['schedule']} on {', '.join(v['instances'])}" for v in found)


def _history_filter(args: argparse.Namespace, catalog: Catalog) -> TickFilter:
    """What `history` was asked for; a bad value is one clear line (exit 2)."""
    now = datetime.now(UTC)
    zone_shown = _zone_flag(args.tz)
    since = _since(args.since, now, zone_shown) if args.since else None
    until = _instant("--until", args.until, zone_shown) if args.until else None
    statuses: tuple[str, ...] = ()
    if args.status:
        statuses = tuple(s.strip().lower() for s in args.status.split(",") if s.strip())
        unknown = [s for s in statuses if s not in {str(v) for v in Status}]
        if unknown or not statuses:
            known = ", ".join(str(v) for v in Status)
            raise ConfigError(f"--status: {shorten(args.status)!r}: expected some of {known}")
    limit = args.limit
    if limit is None and since is None and until is None:
        limit = 50
    key = None if args.job is None else _named(catalog, args.job).key
    return TickFilter(key, since, until, statuses, args.instance, limit)


def _since(text: str, now: datetime, tz: tzinfo) -> datetime:
    """An age (12h, 30m, 2d, 90s) before now, or an instant."""
    from scheduler.schedules import parse_duration

    if text.strip()[:1].isdigit() and text.strip()[-1:].isalpha():
        try:
            return now - parse_duration(text.strip())
        except (ValueError, OverflowError):
            pass
    return _instant("--since", text, tz, "an age such as 12h or 30m, or " + ISO_EXAMPLE)


def _zone_flag(name: str) -> tzinfo:
    try:
        return zone(name)
    except ValueError as exc:
        raise ConfigError(f"--tz: {shorten(name)!r}: {exc}") from None


def _history(
    config: Config, catalog: Catalog, wanted: TickFilter, tz_name: str, as_json: bool
) -> int:
    from scheduler.status import history

    rows = history(_ledger_backend(config), wanted)
    if as_json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    tz = _zone_flag(tz_name)
    shown = []
    for row in rows:  # a retried tick, then its earlier attempts, newest first
        shown.append(_history_line(row, tz))
        for earlier in reversed(row["attempts"]):
            shown.append(_history_line({**row, **earlier, "retry_at": None}, tz))
    columns = ["scheduled_at", "job", "status", "attempt", "instance", "started_at", "duration"]
    table(shown, [*columns, "holder", "note", "run_id", "told", "error"])
    return EXIT_OK


def _history_line(row: dict[str, Any], tz: tzinfo) -> dict[str, Any]:
    notes = ["manual"] if row.get("manual") else []
    if row.get("caught_up"):
        notes.append("caught up")
    if row.get("retry_at"):
        notes.append(f"next attempt {instant(row['retry_at'], tz)}")
    return {
        **row,
        "scheduled_at": instant(row["scheduled_at"], tz),
        "started_at": instant(row["started_at"], tz),
        "duration": lasted(row["status"], row["duration_s"]),
        "attempt": row["attempt"] if row["attempt"] > 1 or row["attempts"] else "",
        "note": ", ".join(notes),
    }


def _trigger_on_fleet(config: Config, catalog: Catalog, name: str) -> int:
    """Hand the run to a live replica (scheduler.run_now) and wait for its outcome."""
    import time

    from scheduler import pauses, run_now

    job = _named(catalog, name)
    settings = config.settings
    backend = _ledger_backend(config)
    engine = backend.ledger_engine
    if not _live(backend):
        print(f"{name}: not run: no live replica (start one, or run it here with --here)")
        return EXIT_HELD
    with engine.begin() as conn:
        request = run_now.ask(
            conn, job.key, job.name, by=pauses.default_actor(), now=datetime.now(UTC),
            namespace=settings.namespace,
        )  # fmt: skip
    patience = run_now.patience(settings.holder_timeout)
    asked, looked, taker = time.monotonic(), time.monotonic(), None
    try:
        while True:
            with engine.connect() as conn:
                row = run_now.state(conn, request)
            if row is None or row["finished_at"] is not None:
                break
            taker = row["taken_by"]
            if taker is None and time.monotonic() - asked > patience:
                with engine.begin() as conn:
                    if run_now.withdraw(conn, request):
                        print(
                            f"{name}: not run: no live replica took it within {patience:g} s"
                            " (does their config.yaml have the job?)"
                        )
                        return EXIT_HELD
            if taker is not None and time.monotonic() - looked > 5:
                looked = time.monotonic()
                if taker not in _live(backend):
                    print(
                        f"{name}: {printable(taker)} took it and is gone; see `scheduler history`"
                    )
                    return EXIT_FAILED
            time.sleep(0.2)
    except KeyboardInterrupt:
        with engine.begin() as conn:
            if run_now.withdraw(conn, request):
                print(f"{name}: not run: the request was withdrawn")
            else:
                print(
                    f"{name}: goes on on {printable(taker or 'a replica')}; see `scheduler history`"
                )
        raise
    if row is None:
        print(f"{name}: not run: the request disappeared (pruned?)")
        return EXIT_FAILED
    where = printable(row["taken_by"])
    if row["outcome"] == "held":
        print(f"{name}: not run: its lock is held elsewhere ({printable(row['error'])})")
        return EXIT_HELD
    if row["outcome"] != "run":
        print(f"{name}: not run on {where}: {printable(row['error'] or row['outcome'])}")
        return EXIT_FAILED
    print(
        f"{name}: run {row['run_id']} {row['status']} on {where}"
        + (f": {printable(row['error'])}" if row["error"] else "")
    )
    return EXIT_OK if row["status"] == Status.SUCCEEDED else EXIT_FAILED


def _live(backend: Backend) -> set[str]:
    with backend.ledger_engine.connect() as conn:
        return {i["name"] for i in backend.live_instances(conn)}


def _trigger(config: Config, catalog: Catalog, name: str) -> int:
    from scheduler.backends.base import Outcome
    from scheduler.gate import Gate
    from scheduler.logs import setup_logging, stop_logging
    from scheduler.runlog import RunLog

    job = _named(catalog, name)
    settings = config.settings
    setup_logging(settings.log_format)
    backend = _ledger_backend(config)
    gate = Gate(
        backend,
        instance=settings.instance_name,
        max_workers=1,
        holder_timeout=settings.holder_timeout,
        listeners=[RunLog(structured=settings.log_format == "json")],
    )
    gate.start()
    try:
        result = gate.trigger(job)
    finally:
        if gate.stop(settings.shutdown_grace):  # given up: its lock goes with this process
            stop_logging()
            os._exit(EXIT_FAILED)
    if result.outcome is Outcome.HELD:
        print(
            f"{name}: not run: its lock is held by {printable(result.holder or 'another replica')}"
        )
        return EXIT_HELD
    if result.outcome is not Outcome.RUN:
        print(f"{name}: not run: {printable(result.error or result.outcome)}")
        return EXIT_FAILED
    print(
        f"{name}: run {result.run_id} {result.status}"
        + (f": {printable(result.error)}" if result.error else "")
    )
    return EXIT_OK if result.status == Status.SUCCEEDED else EXIT_FAILED


def _pause(config: Config, catalog: Catalog, name: str, reason: str | None, by: str | None) -> int:
    from scheduler import pauses

    job = _named(catalog, name)
    why = pauses.checked(reason, "--reason", pauses.MAX_REASON)
    actor = pauses.checked(by, "--by", pauses.MAX_ACTOR) or pauses.default_actor()
    backend = _ledger_backend(config)
    try:
        with backend.ledger_engine.begin() as conn:
            pause, made = pauses.pause(
                conn, job.key, job.name, by=actor, reason=why, now=datetime.now(UTC)
            )
    except Exception as exc:
        raise ConfigError(f"cannot pause {job.name}: {one_line(exc)}") from None
    if made:
        print(f"{job.name}: {pause.describe()}")
        print("  no replica starts it until `scheduler resume`; a run going now is not stopped")
    else:
        print(f"{job.name}: already {pause.describe()} (unchanged)")
    return EXIT_OK


def _resume(config: Config, catalog: Catalog, name: str, by: str | None) -> int:
    from scheduler import pauses

    job = _named(catalog, name)
    actor = pauses.checked(by, "--by", pauses.MAX_ACTOR) or pauses.default_actor()
    backend = _ledger_backend(config)
    try:
        with backend.ledger_engine.begin() as conn:
            ended = pauses.resume(conn, job.key, job.name, by=actor, now=datetime.now(UTC))
    except Exception as exc:
        raise ConfigError(f"cannot resume {job.name}: {one_line(exc)}") from None
    if ended is None:
        print(f"{job.name}: not paused (unchanged)")
    else:
        print(f"{job.name}: resumed by {printable(actor)}; it was {ended.describe()}")
    return EXIT_OK
