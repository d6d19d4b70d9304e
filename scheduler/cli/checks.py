"""Deployment checks against PostgreSQL: what `scheduler check` reports.

Each check returns a line for the report; `fatal` ones make `check` exit 2.
The pooler check matters most (see `session_is_kept`); `scheduler run`
insists on it too. Whatever the driver raises becomes one line, and no line
holds the password, wherever the URL carries it. The session is opened as a
replica opens its own (the primary among the URL's hosts); when none is
found, each host is named with what it is (a standby, unreachable).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import psycopg

from scheduler.backends.pg_nodes import describe_node, node_conninfos, replication
from scheduler.backends.pg_session import (
    POOLER_MESSAGE,
    NotPrimary,
    explain,
    node_of,
    refuse_standby,
    session_is_kept,
    short_connection,
)
from scheduler.config.urls import database_url_secrets, redact_database_url, scrub
from scheduler.errors import one_line

MIN_SERVER_VERSION = 140000  # idle_session_timeout arrived in PostgreSQL 14


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fatal: bool = True


def database_checks(url: str, instance: str, schema: str = "public") -> list[Check]:
    shown = redact_database_url(url)
    secrets = database_url_secrets(url)

    def failure(exc: BaseException) -> str:
        return scrub(explain(one_line(exc)), secrets)

    try:
        conn = short_connection(url, instance)
    except Exception as exc:
        # Which host is what, when there are several or the one there is refused writes.
        several, line = len(_nodes(url)) > 1, one_line(exc)
        nodes = _node_checks(url, instance) if several or explain(line) != line else []
        return [Check("connect", False, f"{shown}: {failure(exc)}"), *nodes]
    checks = [Check("connect", True, f"{shown} (on {node_of(conn)})")]
    if len(_nodes(url)) > 1:
        checks += _node_checks(url, instance)
    try:
        with conn:
            conn.execute("SELECT set_config('search_path', %s, false)", (f'"{schema}"',))
            checks += _server_checks(conn, schema)
    except Exception as exc:
        checks.append(Check("connection", False, f"failed during the checks: {failure(exc)}"))
        return checks
    try:
        kept = session_is_kept(url, instance)
    except Exception as exc:
        checks.append(Check("session pooling", False, failure(exc)))
    else:
        checks.append(
            Check(
                "session pooling",
                kept,
                "each connection keeps its own server session" if kept else POOLER_MESSAGE,
            )
        )
    return checks


def _server_checks(conn: psycopg.Connection, schema: str) -> list[Check]:
    checks: list[Check] = []
    version = conn.info.server_version
    checks.append(
        Check(
            "server version",
            version >= MIN_SERVER_VERSION,
            f"PostgreSQL {version // 10000}.{version % 10000}"
            + ("" if version >= MIN_SERVER_VERSION else " (14 or newer is required)"),
        )
    )
    try:
        refuse_standby(conn)
    except NotPrimary as exc:
        checks.append(Check("primary", False, str(exc)))
        return checks
    checks.append(Check("primary", True, f"{node_of(conn)} is the primary"))
    mode = replication(conn)
    checks.append(Check("replication", mode.synchronous, mode.detail, fatal=False))
    checks.append(_privileges(conn, schema))
    row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    offset = (datetime.now(UTC) - row[0]).total_seconds()
    checks.append(
        Check(
            "clock",
            abs(offset) < 1.0,
            f"this host's clock is {offset:+.3f} s from the database's"
            + ("" if abs(offset) < 1.0 else " (ticks are claimed by each replica's clock)"),
            fatal=False,
        )
    )
    return checks


def _nodes(url: str) -> list[dict[str, Any]]:
    """Each host's own libpq parameters; none if libpq cannot read the URL (connect says why)."""
    try:
        return node_conninfos(url)
    except psycopg.Error:
        return []


def _node_checks(url: str, instance: str) -> list[Check]:
    """One line per host of the URL, reached on its own: which is the primary, which not."""
    secrets = database_url_secrets(url)
    lines = []
    for params in _nodes(url):
        node = describe_node(params, instance)
        lines.append(Check("node", node.primary, scrub(node.detail, secrets), fatal=False))
    return lines


def _privileges(conn: psycopg.Connection, schema: str) -> Check:
    """The fleet's schema: its tables usable, or creatable (and the schema too, if missing)."""
    row = conn.execute(
        "SELECT to_regclass('scheduler_ticks') IS NOT NULL,"
        " EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = %s),"
        " has_database_privilege(current_database(), 'CREATE'), current_user",
        (schema,),
    ).fetchone()
    assert row is not None
    exists, schema_exists, can_create_schema, user = row
    if exists:
        row = conn.execute(
            "SELECT has_table_privilege('scheduler_ticks', 'SELECT, INSERT, UPDATE, DELETE')"
            " AND has_table_privilege('scheduler_jobs', 'SELECT, INSERT, UPDATE')"
        ).fetchone()
        ok = bool(row and row[0])
        detail = (
            f"{user} can use the ledger tables in schema {schema}"
            if ok
            else f"{user} lacks SELECT/INSERT/UPDATE/DELETE on the ledger tables in {schema}"
        )
        return Check("privileges", ok, detail)
    if not schema_exists:
        return Check(
            "privileges",
            bool(can_create_schema),
            f"{user} can create schema {schema} and the ledger tables in it"
            if can_create_schema
            else f"schema {schema} does not exist and {user} cannot create it"
            f" (CREATE SCHEMA {schema} AUTHORIZATION {user}, or GRANT CREATE ON DATABASE)",
        )
    row = conn.execute("SELECT has_schema_privilege(%s, 'CREATE')", (schema,)).fetchone()
    can_create = bool(row and row[0])
    return Check(
        "privileges",
        can_create,
        f"{user} can create the ledger tables in schema {schema}"
        if can_create
        else f"{user} cannot create tables in schema {schema} (GRANT CREATE ON SCHEMA {schema})",
    )
