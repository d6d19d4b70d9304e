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
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import UTC, datetime, tzinfo
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scheduler import __version__, waits
from scheduler.backends import Backend
from scheduler.cli.tables import instant, lasted, table
from scheduler.config import parsing
from scheduler.config.schedules import zone
from scheduler.config.settings import Config, load_config
from scheduler.errors import ConfigError, LedgerError, SchedulerError, one_line, shorten
from scheduler.ledger.history import TickFilter
from scheduler.registry.catalog import Catalog, CatalogJob, load_catalog
from scheduler.statuses import Status
from scheduler.text import printable

if TYPE_CHECKING:
    from scheduler.fleet.host_lock import HostLock
    from scheduler.fleet.run_now import Answer

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_HELD, EXIT_UNKNOWN = 0, 1, 2, 3, 4
EXIT_PIPE = 128 + 13  # SIGPIPE
MAX_PREVIEW = 1000  # ticks `jobs --next` lists per job, at most
MAX_HISTORY = 1_000_000  # ticks `history --limit` lists, at most


# What each command does and how it exits: its --help says it, and so does the command
# line reference (docs/cli.md), which is generated from this parser.
COMMANDS: dict[str, tuple[str, str, str]] = {  # name: help, description, exit statuses
    "run": (
        "run the daemon",
        "The daemon: one replica of the fleet.",
        "0 after a clean SIGTERM/SIGINT",
    ),
    "check": (
        "validate config, jobs and keys (and the database)",
        "Validates config, jobs and keys; with a database, also the schema and lock namespace,"
        " connectivity, server version, primary, privileges, pooling mode and clock offset.",
        "0 valid, 2 invalid",
    ),
    "jobs": (
        "list every job and its next tick (or its next N ticks)",
        "Every job (or only JOB): name, key, schedule, time zone, next tick, source. With"
        " --next N: each job's next N ticks after --after (default now), in the job's time"
        ' zone with its offset; in JSON each job gains "next_ticks" ([] when unscheduled'
        " or disabled).",
        "0; 2 for an unknown JOB or a bad value",
    ),
    "status": (
        "the fleet now",
        "The fleet now: live instances, which instance runs which job and since when, each"
        " job's last result, consecutive skips and failures, alerting, whether it is paused"
        " (by whom, since when, why), whether the live replicas agree on its schedule, next"
        " tick. Text shows every time in one zone (UTC, or --tz).",
        "0",
    ),
    "history": (
        "recent ticks",
        "Ticks, newest first: the last 50 lines, or with --since/--until every tick"
        " scheduled in that range, only the given statuses, only those one replica recorded."
        " Text shows times to the millisecond in UTC (or --tz), rounded durations, and"
        " ATTEMPT, HOLDER and NOTE (manual, caught up, when the next attempt is due)"
        " columns; a retried tick's earlier attempts follow its row.",
        "0; 2 for an unknown JOB, status, zone or a bad time",
    ),
    "trigger": (
        "run one tick of a job now, on a live replica",
        "Runs one tick of JOB now, through the same gate (a job without a schedule, or"
        " disabled, too), on a live replica that runs the job, and prints its outcome and"
        " where it ran.",
        "0 ran and succeeded; 1 ran and failed (or was interrupted, or crashed); 3 not run:"
        " its lock is held (the job is already running), no live replica, or none took it;"
        " 4 outcome unknown: look at `scheduler history JOB` before asking again",
    ),
    "pause": (
        "pause a job for the whole fleet (persisted)",
        "Pauses JOB for the whole fleet until `resume`, persisted in the ledger: each of its"
        " ticks is recorded `paused`; a run already going is not interrupted.",
        "0 (also when it was paused already: the first pause stays); 2 for an unknown JOB or"
        " a reason over 500 characters",
    ),
    "resume": (
        "resume a paused job",
        "Ends the pause: the job's next tick runs.",
        "0 (also when it was not paused); 2 for an unknown JOB",
    ),
}
EXITS_ALWAYS = (
    "Every command exits 2 on a configuration or usage error (one line naming the file, job,"
    " field and value), 130 when interrupted (Ctrl-C), and 141 when the reader of its output"
    " went away (`scheduler check | head -1`), as any tool a closed pipe ends."
)


def _command(commands: Any, common: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    summary, description, exits = COMMANDS[name]
    command: argparse.ArgumentParser = commands.add_parser(
        name,
        parents=[common],
        help=summary,
        description=description,
        epilog=f"exit status: {exits}",
    )
    return command


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", help="path of config.yaml (default ./config.yaml)")
    common.add_argument(
        "--jobs",
        dest="jobs_path",
        metavar="JOBS",
        help="folder of job modules (default: jobs/ beside the config)",
    )
    parser = argparse.ArgumentParser(
        prog="scheduler",
        description="A fleet scheduler: every tick of every job runs on exactly one replica.",
        epilog=EXITS_ALWAYS,
    )
    parser.add_argument("--version", action="version", version=f"scheduler {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        ARGUMENTS.get(name, _none)(_command(commands, common, name))
    return parser


def _none(command: argparse.ArgumentParser) -> None:
    """`check` takes only the common flags."""


def _run_arguments(run: argparse.ArgumentParser) -> None:
    run.add_argument(
        "--http-port",
        type=int,
        help="serve the page, its API, /healthz, /readyz and /metrics on this port",
    )


def _jobs_arguments(jobs: argparse.ArgumentParser) -> None:
    jobs.add_argument("job", metavar="JOB", nargs="?", help="only this job")
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
    jobs.add_argument("--json", action="store_true", help="print JSON")


def _status_arguments(status: argparse.ArgumentParser) -> None:
    status.add_argument(
        "--tz", metavar="ZONE", default="UTC", help="show times in this zone (default UTC)"
    )
    status.add_argument("--json", action="store_true", help="print JSON")


def _history_arguments(history: argparse.ArgumentParser) -> None:
    history.add_argument("job", metavar="JOB", nargs="?", help="only this job")
    history.add_argument(
        "--limit",
        metavar="N",
        help="how many lines, newest first, a retried tick's earlier attempts counted"
        " (--json: how many ticks, each with its attempts); default 50, with --since or"
        " --until all",
    )
    history.add_argument(
        "--since",
        metavar="AGE|ISO-8601",
        help="ticks scheduled since: 12h, 30m, 2d or an instant (without an offset, read in --tz)",
    )
    history.add_argument("--until", metavar="ISO-8601", help="ticks scheduled until an instant")
    history.add_argument(
        "--status", metavar="S[,S...]", help="only these statuses, e.g. failed,crashed"
    )
    history.add_argument("--instance", metavar="NAME", help="only ticks this replica recorded")
    _status_arguments(history)


def _trigger_arguments(trigger: argparse.ArgumentParser) -> None:
    trigger.add_argument("job", metavar="JOB", help="the job")
    trigger.add_argument(
        "--here", action="store_true", help="run it in this process instead (through the gate)"
    )


def _pause_arguments(pause: argparse.ArgumentParser) -> None:
    pause.add_argument("job", metavar="JOB", help="the job")
    pause.add_argument("--reason", help="why, kept with the pause and shown by `status`")
    pause.add_argument("--by", help="who pauses it (default: user@host)")


def _resume_arguments(resume: argparse.ArgumentParser) -> None:
    resume.add_argument("job", metavar="JOB", help="the job")
    resume.add_argument("--by", help="who resumes it (default: user@host)")


# Each command's own arguments, beside the common --config and --jobs.
ARGUMENTS: dict[str, Callable[[argparse.ArgumentParser], None]] = {
    "run": _run_arguments,
    "jobs": _jobs_arguments,
    "status": _status_arguments,
    "history": _history_arguments,
    "trigger": _trigger_arguments,
    "pause": _pause_arguments,
    "resume": _resume_arguments,
}


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # the reader went away (`scheduler check | head -1`)
        return _reader_gone()


def _main(argv: Sequence[str] | None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit:  # --help, a usage error: printed; a closed pipe is seen here
        sys.stdout.flush()
        raise
    try:
        code = _dispatch(args)
        sys.stdout.flush()
    except SchedulerError as exc:  # ConfigError, LedgerError: 2, as SPEC says
        print(f"scheduler: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except PermissionError as exc:  # another user's files (the embedded ledger, its locks)
        where = f"{exc.filename}: " if exc.filename else ""
        print(
            f"scheduler: {where}permission denied: run this command as the user who runs "
            "the replicas",
            file=sys.stderr,
        )
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        code = _reader_gone()
    finally:
        _close_ledgers()
    if args.command in ("run", "trigger"):
        # Job code ran in this process and may have left threads of its own (not daemon
        # threads), which the interpreter would wait for. Every lock is released by now.
        from scheduler.logs import stop_logging

        stop_logging()
        sys.stderr.flush()
        os._exit(code)
    return code


def _reader_gone() -> int:
    """What was not read goes nowhere, quietly; the exit status of a tool that SIGPIPE ends,
    as a shell reports it (the daemon ignores SIGPIPE: its sockets must not end it)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_PIPE


def _dispatch(args: argparse.Namespace) -> int:
    flags: dict[str, Any] = {"jobs_path": args.jobs_path}
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
    lock_file = settings.host_lock_file(None)  # off for `scheduler run` unless set
    held = None if lock_file is None else _elected(lock_file, settings.instance_name)
    if lock_file is not None and held is None:
        return EXIT_OK
    return Daemon(config, catalog).run()  # the kernel drops the host lock with the process


def _elected(lock_file: Path, instance: str) -> HostLock | None:
    """Stand by until this process holds the host lock; None after SIGTERM or SIGINT.

    A standby holds no session and no lock: a signal only ends the wait.
    """
    import signal
    import threading

    from scheduler.fleet.host_lock import POLL, HostLock

    lock, stop = HostLock(lock_file), threading.Event()
    if lock.try_take():
        return lock
    logging.getLogger("scheduler").info(
        "standing by: another process holds the host lock %s", lock_file
    )
    lock.announce(instance)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda _signum, _frame: stop.set())
    while not stop.wait(POLL):
        lock.announce(instance)
        if lock.try_take():
            logging.getLogger("scheduler").info("now this host's active replica")
            return lock
    lock.withdraw()
    return None


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
    from scheduler.cli.checks import database_checks

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
    from scheduler.fleet.status import schedule_checks

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
    n = parsing.whole(count, "--next", 1, MAX_PREVIEW) if count is not None else None
    where = zone(config.settings.timezone)
    now = parsing.instant(after, "--after", where) if after is not None else datetime.now(UTC)
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
            shown = job.local(tick)
            print(f"  {shown}" + ("" if shown.endswith("+00:00") else f"  ({tick.isoformat()})"))
        if not ticks:
            print("  no ticks: " + ("runs only by hand" if job.schedule is None else "disabled"))
    return EXIT_OK


def _named(catalog: Catalog, name: str) -> CatalogJob:
    job = catalog.by_name(name)
    if job is None:
        raise ConfigError(f"no job named {shorten(name)!r} (see `scheduler jobs`)")
    return job


_OPENED: list[Backend] = []  # the ledgers a command opened, closed when it ends


def _close_ledgers() -> None:
    """Close the sessions a command opened: `main` may run in a process that goes on."""
    while _OPENED:
        backend = _OPENED.pop()
        backend.close()
        backend.ledger_engine.dispose()


def _ledger_backend(config: Config) -> Backend:
    """The backend, for reading: the schema must exist (a replica creates it)."""
    from scheduler.backends import open_backend

    backend = open_backend(config.settings)
    _OPENED.append(backend)
    try:
        backend.migrate()
    except Exception as exc:
        raise LedgerError(f"cannot reach the ledger: {one_line(exc)}") from None
    return backend


def _status(config: Config, catalog: Catalog, tz: tzinfo, *, as_json: bool) -> int:
    from scheduler.fleet.host_lock import host_standbys
    from scheduler.fleet.status import fleet_status, running_words

    backend = _ledger_backend(config)
    document = fleet_status(backend, catalog, datetime.now(UTC), host_standbys(config.settings))
    if as_json:
        print(json.dumps(document, indent=2))
        return EXIT_OK
    instances = document["instances"]
    print(f"backend: {document['backend']}; {len(instances)} live instance(s)")
    for instance in instances:
        since = f" since {instant(instance['since'], tz)}" if instance["since"] else ""
        note = f": {printable(instance['note'])}" if instance.get("note") else ""
        print(f"  {instance['name']}{since} ({instance['address'] or 'local'}){note}")
    if document["standbys"]:
        print(f"  on standby on this host: {printable(', '.join(document['standbys']))}")
    for note in document["notes"]:
        print(f"note: {printable(note)}")
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
    table(rows)
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
    from scheduler.fleet.status import HistoryAsked, history_filter

    asked = HistoryAsked(args.since, args.until, args.status, args.instance, args.limit)
    zone_shown = _zone_flag(args.tz)
    now = datetime.now(UTC)
    wanted = history_filter(asked, now, most=MAX_HISTORY, spanned=None, zone=zone_shown, flag="--")
    key = None if args.job is None else _named(catalog, args.job).key
    return replace(wanted, key=key)


def _zone_flag(name: str) -> tzinfo:
    return parsing.time_zone(name, "--tz")


def _history(
    config: Config, catalog: Catalog, wanted: TickFilter, tz_name: str, as_json: bool
) -> int:
    from scheduler.fleet.status import history

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
    if wanted.limit is not None:  # lines: what one reads (the JSON has ticks)
        shown = shown[: wanted.limit]
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
    """Hand the run to a live replica (scheduler.fleet.run_now) and wait for what became of it."""
    import time

    from scheduler.fleet import pauses, run_now

    job = _named(catalog, name)
    settings = config.settings
    backend = _ledger_backend(config)
    if not _live(backend):
        print(f"{name}: not run: no live replica (start one, or run it here with --here)")
        return EXIT_HELD
    with backend.ledger_engine.begin() as conn:
        request = run_now.ask(
            conn, job.key, job.name, by=pauses.default_actor(), now=backend.now_expression(),
            namespace=settings.namespace,
        )  # fmt: skip
    try:
        answer = run_now.wait(
            backend,
            request,
            job=job.name,
            holder_timeout=settings.holder_timeout,
            monotonic=time.monotonic,
            sleep=waits.sleep,
        )
    except KeyboardInterrupt:
        with backend.ledger_engine.begin() as conn:
            if run_now.withdraw(conn, request):
                print(f"{name}: not run: the request was withdrawn")
            else:
                print(f"{name}: goes on on a replica; see `scheduler history {name}`")
        raise
    print(answer.line())
    return _trigger_code(answer)


def _trigger_code(answer: Answer) -> int:
    """0 ran and succeeded, 1 ran and did not, 3 not run (held, nobody took it),
    4 unknown (taken, and the ledger does not say what became of it)."""
    from scheduler.fleet.run_now import Phase

    if answer.phase is Phase.WITHDRAWN or answer.outcome == "held":
        return EXIT_HELD
    if answer.phase is not Phase.SETTLED:
        return EXIT_UNKNOWN
    if answer.outcome == "run" and answer.status == Status.SUCCEEDED:
        return EXIT_OK
    return EXIT_FAILED


def _live(backend: Backend) -> set[str]:
    with backend.ledger_engine.connect() as conn:
        return {i["name"] for i in backend.live_instances(conn)}


def _trigger(config: Config, catalog: Catalog, name: str) -> int:
    from scheduler.backends.base import Outcome
    from scheduler.gate import Gate
    from scheduler.logs import setup_logging, stop_logging
    from scheduler.observers.runlog import RunLog

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
    from scheduler.fleet import pauses

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
        raise LedgerError(f"cannot pause {job.name}: {one_line(exc)}") from None
    if made:
        pauses.settle()
        print(f"{job.name}: {pause.describe()}")
        print("  no replica starts it until `scheduler resume`; a run going now is not stopped")
    else:
        print(f"{job.name}: already {pause.describe()} (unchanged)")
    return EXIT_OK


def _resume(config: Config, catalog: Catalog, name: str, by: str | None) -> int:
    from scheduler.fleet import pauses

    job = _named(catalog, name)
    actor = pauses.checked(by, "--by", pauses.MAX_ACTOR) or pauses.default_actor()
    backend = _ledger_backend(config)
    try:
        with backend.ledger_engine.begin() as conn:
            ended = pauses.resume(conn, job.key, job.name, by=actor, now=datetime.now(UTC))
    except Exception as exc:
        raise LedgerError(f"cannot resume {job.name}: {one_line(exc)}") from None
    if ended is None:
        print(f"{job.name}: not paused (unchanged)")
    else:
        print(f"{job.name}: resumed by {printable(actor)}; it was {ended.describe()}")
    return EXIT_OK
