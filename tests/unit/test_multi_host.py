"""Multi-host URLs (docs/faults.md: Failover): each host apart for `check`, the primary by default,
no password in what is shown, and what the replication settings promise."""

from __future__ import annotations

from typing import Any

import pytest

from scheduler.backends.pg_nodes import node_conninfos, node_label, replication
from scheduler.backends.pg_session import connect_args, explain
from scheduler.config.urls import database_url_secrets, redact_database_url, scrub

MULTI = "postgresql://u:s3cr3tpw@a.example:5432,[::1]:5433,c/db?target_session_attrs=read-write"


def test_a_replica_asks_libpq_for_the_writable_node_unless_the_url_says_otherwise():
    assert connect_args("r1", 30, "postgresql://u@a,b/db")["target_session_attrs"] == "read-write"
    given = connect_args("r1", 30, "postgresql://u@a,b/db?target_session_attrs=primary")
    assert "target_session_attrs" not in given  # libpq reads the URL's own


@pytest.mark.parametrize(
    ("url", "hosts"),
    [
        ("postgresql://u@a/db", 1),
        ("postgresql://u@/db", 1),
        ("postgresql://u@a:1,b:2,c/db", 3),
        ("postgresql://u@/db?host=a,b&port=1,2", 2),
        ("postgresql://u@/db?hostaddr=10.0.0.1%2C10.0.0.2", 2),
    ],
)
def test_a_dead_host_among_several_costs_each_connection_attempt_little(url, hosts):
    timeout = connect_args("r1", 30, url)["connect_timeout"]
    assert timeout == (3 if hosts > 1 else 10)
    assert connect_args("r1", 6, url)["connect_timeout"] == 2  # libpq's shortest


def test_a_refusal_of_every_host_as_read_only_says_what_it_means():
    libpq = 'connection to server at "10.0.0.2", port 5432 failed: session is read-only'
    assert explain(libpq).endswith("(no host of the URL is a writable primary)")
    assert explain("Connection refused") == "Connection refused"


def test_each_host_of_a_multi_host_url_is_reached_on_its_own():
    nodes = node_conninfos(MULTI)
    assert [node_label(n) for n in nodes] == ["a.example:5432", "[::1]:5433", "c:5432"]
    assert all(n["target_session_attrs"] == "any" for n in nodes)
    assert all(n["password"] == "s3cr3tpw" and n["dbname"] == "db" for n in nodes)


def test_hosts_and_ports_given_as_options_are_split_the_same_way():
    nodes = node_conninfos("postgresql://u@/db?host=a,b&port=5432,6432")
    assert [node_label(n) for n in nodes] == ["a:5432", "b:6432"]
    one_port = node_conninfos("postgresql://u@/db?host=a,b&port=6432")
    assert [node_label(n) for n in one_port] == ["a:6432", "b:6432"]


@pytest.mark.parametrize(
    ("url", "hosts"),
    [
        (MULTI, "@a.example:5432,[::1]:5433,c/db?"),
        (
            "postgresql://u@a:1,b:2/db?password=s3cr3tpw&target_session_attrs=read-write",
            "@a:1,b:2/",
        ),
        ("postgresql://u@a:1,b:2/db?sslpassword=s3cr3tpw&password=s3cr3tpw", "@a:1,b:2/"),
    ],
)
def test_a_multi_host_url_is_shown_with_every_host_and_no_password(url, hosts):
    shown = redact_database_url(url)
    assert "s3cr3tpw" not in shown and "***" in shown and hosts in shown
    message = f"connection to {url} failed: password s3cr3tpw refused"
    assert "s3cr3tpw" not in scrub(message, database_url_secrets(url))


class _Answer:
    def __init__(self, row: tuple[Any, ...]) -> None:
        self.row = row

    def execute(self, _query: str) -> _Answer:
        return self

    def fetchone(self) -> tuple[Any, ...]:
        return self.row


@pytest.mark.parametrize(
    ("names", "commit", "synchronous", "said"),
    [
        ("", "on", False, "asynchronous (synchronous_standby_names = ''"),
        ("*", "local", False, "asynchronous for this role and database"),
        ("*", "off", False, "asynchronous for this role and database"),
        ("FIRST 1 (b)", "on", True, "synchronous (synchronous_standby_names = 'FIRST 1 (b)'"),
        ("ANY 1 (b, c)", "remote_apply", True, "synchronous_commit = remote_apply"),
    ],
)
def test_check_says_whether_a_failover_can_lose_claims(names, commit, synchronous, said):
    found = replication(_Answer((names, commit, 1, 1 if synchronous else 0)))  # type: ignore[arg-type]
    assert found.synchronous is synchronous
    assert said in found.detail
    assert ("run again" in found.detail) is not synchronous
