"""What each replica runs (its registrations: jobs and schedules, over time), and when each
replica was last seen alive."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, bindparam, delete, func, or_, select, text, update

from scheduler.ledger.tables import registrations, seen, upsert


@dataclass(frozen=True)
class Registration:
    instance: str
    key: int
    name: str
    schedule: str | None
    since: datetime
    until: datetime | None


def take_turns(conn: Connection) -> None:
    """Writers of registrations take turns, each until its transaction ends.

    Each writer reads the rows, then writes from what it read. Two replicas that start
    together each took over the other's row (its replica looked gone) and kept its own
    as found, and both rows went: the fleet lost the schedule both ran, and the ticks of
    its downtime were then never due (no catch-up, no missed row). A table lock that only
    writers take (plain reads go on) makes the second read what the first wrote. SQLite
    has one writer at a time already (BEGIN IMMEDIATE).
    """
    if conn.dialect.name == "postgresql":
        conn.execute(text(f"LOCK TABLE {registrations.name} IN SHARE ROW EXCLUSIVE MODE"))


def registrations_of(conn: Connection, keys: list[int] | None = None) -> list[Registration]:
    return _rows(conn, *([] if keys is None else [registrations.c.job_key.in_(keys)]))


def _rows(conn: Connection, *where: Any) -> list[Registration]:
    """The rows `where` selects, by job, replica and start."""
    c = registrations.c
    query = select(registrations).where(*where).order_by(c.job_key, c.instance, c.since)
    return [
        Registration(r.instance, r.job_key, r.job_name, r.schedule, r.since, r.until)
        for r in conn.execute(query)
    ]


def _inheritance(
    found: list[Registration], instance: str, live: set[str]
) -> dict[tuple[int, str | None], datetime]:
    """(job, schedule) of replicas now gone -> since when the fleet has run it so."""
    heirs: dict[tuple[int, str | None], datetime] = {}
    for r in found:
        if r.instance != instance and r.instance not in live and r.until is None:
            pair = (r.key, r.schedule)
            heirs[pair] = min(r.since, heirs.get(pair, r.since))
    return heirs


def _take_over(
    conn: Connection,
    heirs: dict[tuple[int, str | None], datetime],
    wanted: set[tuple[int, str | None]],
    keep: list[str],
) -> None:
    """The gone replicas' open rows of what this one runs too: they live on in its own."""
    inherited: dict[str | None, list[int]] = {}
    for key, schedule in heirs:
        if (key, schedule) in wanted:
            inherited.setdefault(schedule, []).append(key)
    for schedule, keys in inherited.items():
        conn.execute(
            delete(registrations).where(
                registrations.c.job_key.in_(sorted(keys)),
                registrations.c.schedule.is_not_distinct_from(schedule),
                registrations.c.until.is_(None),
                registrations.c.instance.not_in(keep),
            )
        )


def _open_rows(conn: Connection, where: Any) -> list[Registration]:
    """Schedules in force (open rows) that `where` selects: a fleet of 100 replicas with
    1,000 jobs each has 100,000 rows, and each replica that starts reads only its own and
    those of replicas gone, under the writers' table lock."""
    return _rows(conn, registrations.c.until.is_(None), where)


def names_in_force(conn: Connection, instances: set[str]) -> list[tuple[int, str, str]]:
    """(job key, job name, a replica that runs it so) for each name a job has among these
    replicas' schedules in force: one row per job and name, however many replicas."""
    r = registrations.c
    query = (
        select(r.job_key, r.job_name, func.min(r.instance))
        .where(r.until.is_(None), r.instance.in_(sorted(instances)))
        .group_by(r.job_key, r.job_name)
    )
    return [(key, name, instance) for key, name, instance in conn.execute(query)]


def by_job(registered: list[Registration]) -> dict[int, list[Registration]]:
    """Registrations grouped by job key, each job's in their order."""
    grouped: dict[int, list[Registration]] = {}
    for r in registered:
        grouped.setdefault(r.key, []).append(r)
    return grouped


def registered_instances(conn: Connection) -> set[str]:
    """The replicas that have some schedule in force (an open registration)."""
    query = select(registrations.c.instance).where(registrations.c.until.is_(None)).distinct()
    return set(conn.execute(query).scalars())


def register(
    conn: Connection,
    instance: str,
    entries: list[tuple[int, str, str | None]],
    live: set[str],
    now: datetime,
) -> None:
    """This replica's jobs and schedules, in force from now.

    A schedule it already runs keeps its `since`; one that a replica now gone
    began is taken over from then (the gone replica's row goes: the table stays
    about one open row per live replica and job). A schedule this replica ran and
    runs no more (a reload, a restart with another config.yaml) ends now, and its
    row stays: the ticks from before the change are judged by it (scheduler.fleet.due).
    """
    take_turns(conn)
    c = registrations.c
    found = _open_rows(conn, or_(c.instance == instance, c.instance.not_in(sorted(live))))
    heirs = _inheritance(found, instance, live)
    _take_over(conn, heirs, {(key, schedule) for key, _, schedule in entries}, [*live, instance])
    mine = {r.key: r for r in found if r.instance == instance and r.until is None}
    rows, renamed = [], []
    for key, name, schedule in sorted(entries):
        known = mine.pop(key, None)
        if known is not None and known.schedule == schedule:
            if known.name != name:
                renamed.append((key, name))
            continue
        since = heirs.get((key, schedule), now)
        if known is not None:
            _end(conn, known, now if since != known.since else None)
        row = {"instance": instance, "job_key": key, "job_name": name, "schedule": schedule}
        rows.append({**row, "since": since, "until": None})
    for known in mine.values():  # jobs this replica no longer has
        _end(conn, known, now)
    for key, name in renamed:
        conn.execute(
            update(registrations)
            .where(
                registrations.c.instance == instance,
                registrations.c.job_key == key,
                registrations.c.until.is_(None),
            )
            .values(job_name=name)
        )
    if rows:
        conn.execute(registrations.insert(), rows)


def _key_of(row: Registration) -> tuple[Any, ...]:
    return (
        registrations.c.instance == row.instance,
        registrations.c.job_key == row.key,
        registrations.c.since == row.since,
    )


def _end(conn: Connection, row: Registration, at: datetime | None) -> None:
    """A schedule is no longer in force from `at` (None: it never was: its row goes)."""
    where = _key_of(row)
    if at is None:
        conn.execute(delete(registrations).where(*where))
    else:
        conn.execute(update(registrations).where(*where).values(until=at))


def supersede(conn: Connection, live: set[str], now: datetime) -> int:
    """Schedules of replicas that are gone end where a live replica runs another schedule."""
    take_turns(conn)
    c = registrations.c
    gone = _open_rows(conn, c.instance.not_in(sorted(live)))
    if not gone:
        return 0
    query = (
        select(c.job_key, c.schedule)
        .where(
            c.until.is_(None),
            c.instance.in_(sorted(live)),
            c.job_key.in_(sorted({r.key for r in gone})),
        )
        .distinct()
    )
    running = {(key, schedule) for key, schedule in conn.execute(query)}
    live_keys = {key for key, _ in running}
    ended = 0
    for r in gone:
        if r.key in live_keys and (r.key, r.schedule) not in running:
            _end(conn, r, now)
            ended += 1
    return ended


def reassert(
    conn: Connection, instance: str, entries: list[tuple[int, str, str | None]], now: Any
) -> int:
    """A live replica's schedules are in force, whatever another replica concluded while
    this one was starting (registered, not yet live) or reconnecting: see `supersede`,
    and `register`, which takes over the rows of a replica that looks gone. Returns how
    many rows it put back.

    Its newest row of each of its jobs (`entries`) is reopened if it is this schedule's,
    and one from now is added if it is gone or another; the rows its own changes ended
    stay ended. Every replica does this every pass: one that finds all of its schedules
    in force, as it nearly always does, reads that without the writers' table lock (a
    writer's change it cannot see yet is put back at the next pass, as one made just
    after it would be), and one that puts rows back writes them in two statements.
    """
    if _all_in_force(conn, instance, {key for key, _, _ in entries}):
        return 0
    take_turns(conn)
    c = registrations.c
    query = select(registrations).where(c.instance == instance)
    newest = {r.job_key: r for r in conn.execute(query.order_by(c.since))}
    reopened, added = [], []
    for key, name, schedule in entries:
        row = newest.get(key)
        if row is not None and row.until is None:
            continue
        if row is not None and row.schedule == schedule:
            reopened.append({"b_key": key, "b_since": row.since})
        else:
            added.append({"job_key": key, "job_name": name, "schedule": schedule})
    if reopened:
        conn.execute(
            update(registrations)
            .where(
                c.instance == instance,
                c.job_key == bindparam("b_key"),
                c.since == bindparam("b_since"),
            )
            .values(until=None),
            reopened,
        )
    if added:
        conn.execute(registrations.insert().values(instance=instance, since=now), added)
    return len(reopened) + len(added)


def _all_in_force(conn: Connection, instance: str, keys: set[int]) -> bool:
    """Each of these jobs has a schedule of this replica's in force (an open row)."""
    c = registrations.c
    query = select(c.job_key).where(c.instance == instance, c.until.is_(None))
    return keys <= set(conn.execute(query).scalars())


def mark_seen(conn: Connection, instance: str, now: Any) -> None:
    """This replica is alive now (see `seen`)."""
    statement = upsert(conn, seen).values(instance=instance, seen_at=now)
    conn.execute(
        statement.on_conflict_do_update(
            index_elements=[seen.c.instance], set_={"seen_at": statement.excluded.seen_at}
        )
    )


def seen_at(conn: Connection, instances: list[str]) -> dict[str, datetime]:
    """When each of these replicas was last known to be alive (those it knows)."""
    if not instances:
        return {}
    query = select(seen.c.instance, seen.c.seen_at).where(seen.c.instance.in_(instances))
    return {row.instance: row.seen_at for row in conn.execute(query)}


def recently_seen(conn: Connection, since: datetime) -> set[str]:
    """The replicas known to be alive at some time since then (see `mark_seen`)."""
    return set(conn.execute(select(seen.c.instance).where(seen.c.seen_at >= since)).scalars())
