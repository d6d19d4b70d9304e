"""The nodes behind a database URL, and how they replicate: what `scheduler check` reports.

A multi-host URL names a primary and its standbys; a replica only ever uses
the primary (see `pg_session.connect_args`). When no primary answers, each
node is asked on its own what it is, so the report names the standby (or the
unreachable node) at fault. On the primary, the replication settings decide
what a failover can lose: with a synchronous standby, no claim a replica saw
committed; without, the claims of the last moments before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from scheduler.backends.pg_session import NotPrimary, refuse_standby
from scheduler.config.urls import libpq_url

_PER_HOST = ("host", "hostaddr", "port")  # libpq's comma-separated lists, one item a host
SYNCHRONOUS = ("on", "remote_apply", "remote_write")


@dataclass(frozen=True)
class Node:
    """One host of the URL as it answered on its own."""

    primary: bool
    detail: str


@dataclass(frozen=True)
class Replication:
    """What the primary says of its replication: `synchronous` is the promise a failover keeps."""

    synchronous: bool
    detail: str


def node_conninfos(url: str) -> list[dict[str, Any]]:
    """libpq parameters for each host of the URL alone, whatever its role."""
    params = conninfo_to_dict(libpq_url(url))
    lists = {key: str(params[key]).split(",") for key in _PER_HOST if key in params}
    count = max((len(items) for items in lists.values()), default=1)
    nodes = []
    for i in range(count):
        node = {**params, "target_session_attrs": "any"}
        for key, items in lists.items():
            value = items[i] if len(items) == count else items[0]
            if value:
                node[key] = value
            else:
                node.pop(key, None)
        nodes.append(node)
    return nodes


def node_label(params: dict[str, Any]) -> str:
    host = str(params.get("host") or params.get("hostaddr") or "localhost")
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{params.get('port') or 5432}"


def describe_node(params: dict[str, Any], instance: str) -> Node:
    """What one node is, reached on its own within 5 s, under the replica's name (both
    win over the URL's own connect_timeout and application_name)."""
    label = node_label(params)
    options = {**params, "connect_timeout": 5, "application_name": instance}
    try:
        with psycopg.connect(autocommit=True, **options) as conn:
            refuse_standby(conn)
    except NotPrimary as exc:
        return Node(False, str(exc))
    except psycopg.Error as exc:
        return Node(False, f"{label}: unreachable ({_last_line(exc)})")
    return Node(True, f"{label} is the primary")


def replication(conn: psycopg.Connection[Any]) -> Replication:
    """Whether a commit waits for a standby, as this role and database see it."""
    row = conn.execute(
        "SELECT current_setting('synchronous_standby_names'),"
        " current_setting('synchronous_commit'),"
        " (SELECT count(*) FROM pg_stat_replication),"
        " (SELECT count(*) FROM pg_stat_replication WHERE sync_state IN ('sync', 'quorum'))"
    ).fetchone()
    assert row is not None
    names, commit, standbys, synchronous = row
    settings = f"synchronous_standby_names = '{names}', synchronous_commit = {commit}"
    risk = (
        "after a failover the claims of its last moments (the standby's replication lag) "
        "can be lost, and their ticks run again"
    )
    if not names.strip():
        streaming = f"{standbys} standby(s) streaming" if standbys else "no standby streaming"
        return Replication(False, f"asynchronous ({settings}; {streaming}): {risk}")
    if commit not in SYNCHRONOUS:
        return Replication(False, f"asynchronous for this role and database ({settings}): {risk}")
    return Replication(
        True,
        f"synchronous ({settings}; {synchronous} synchronous standby(s) visible): "
        "a claim committed is on the standby too, so a failover runs no tick twice",
    )


def _last_line(exc: BaseException) -> str:
    """libpq's reason, without the repeated `connection to server at ...` preamble."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    return text.rpartition(" failed: ")[2] or text
