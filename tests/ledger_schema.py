"""What a ledger's schema is, read back from the database, for comparing two ledgers.

Column order is left out: a column added by a migration comes last, one created with
its table comes where the table put it, and no statement of ours depends on the order.
"""

from __future__ import annotations

import re
import sqlite3
from typing import Any

import psycopg

PG_TABLES = """
SELECT c.table_name, c.column_name, c.data_type, c.character_maximum_length,
       c.is_nullable, c.column_default
  FROM information_schema.columns c
 WHERE c.table_schema = %(schema)s AND c.table_name LIKE 'scheduler%%'
 ORDER BY 1, 2
"""
PG_CONSTRAINTS = """
SELECT r.relname, k.conname, k.contype, pg_get_constraintdef(k.oid), k.convalidated
  FROM pg_constraint k JOIN pg_class r ON r.oid = k.conrelid
 WHERE r.relnamespace = %(schema)s::regnamespace
 ORDER BY 1, 2
"""
PG_INDEXES = """
SELECT tablename, indexname, indexdef FROM pg_indexes
 WHERE schemaname = %(schema)s ORDER BY 1, 2
"""
PG_SEQUENCES = """
SELECT sequence_name, data_type, start_value, increment FROM information_schema.sequences
 WHERE sequence_schema = %(schema)s ORDER BY 1
"""
PG_FUNCTIONS = """
SELECT p.proname, pg_get_function_identity_arguments(p.oid),
       pg_get_function_result(p.oid), md5(p.prosrc)
  FROM pg_proc p WHERE p.pronamespace = %(schema)s::regnamespace ORDER BY 1, 2
"""
PG_TYPES = """
SELECT t.typname, a.attname, format_type(a.atttypid, a.atttypmod)
  FROM pg_type t JOIN pg_attribute a ON a.attrelid = t.typrelid
 WHERE t.typnamespace = %(schema)s::regnamespace AND t.typtype = 'c'
   AND NOT EXISTS (SELECT 1 FROM pg_class r WHERE r.oid = t.typrelid AND r.relkind <> 'c')
 ORDER BY 1, 2
"""


def postgres_schema(url: str, schema: str = "public") -> dict[str, Any]:
    """Tables, columns, constraints, indexes, sequences, functions and types of a ledger."""
    found: dict[str, Any] = {}
    with psycopg.connect(url) as conn:
        for name, query in (
            ("columns", PG_TABLES),
            ("constraints", PG_CONSTRAINTS),
            ("indexes", PG_INDEXES),
            ("sequences", PG_SEQUENCES),
            ("functions", PG_FUNCTIONS),
            ("types", PG_TYPES),
        ):
            found[name] = conn.execute(query, {"schema": schema}).fetchall()
    return found


def sqlite_schema(path: str) -> dict[str, Any]:
    """Columns, keys, CHECK constraints and indexes of an embedded ledger file."""
    conn = sqlite3.connect(path)
    try:
        found: dict[str, Any] = {"columns": [], "checks": [], "indexes": [], "tables": []}
        tables = conn.execute(
            "SELECT name, sql FROM sqlite_master WHERE type = 'table'"
            " AND name LIKE 'scheduler%' ORDER BY name"
        ).fetchall()
        for name, made in tables:
            columns = conn.execute(f"PRAGMA table_xinfo({name})").fetchall()
            found["columns"] += sorted((name, *column[1:]) for column in columns)
            checks = re.findall(r"CONSTRAINT (\w+) CHECK \((.*)\)", made)
            found["checks"] += sorted((name, *check) for check in checks)
            found["tables"].append((name, "AUTOINCREMENT" in made.upper()))
        found["indexes"] = [
            (table, name, " ".join(made.split()))
            for table, name, made in conn.execute(
                "SELECT tbl_name, name, sql FROM sqlite_master WHERE type = 'index'"
                " AND sql IS NOT NULL ORDER BY tbl_name, name"
            )
        ]
        return found
    finally:
        conn.close()


def differences(expected: dict[str, Any], found: dict[str, Any]) -> list[str]:
    """Each row one ledger has and the other has not, said plainly."""
    said = []
    for part in sorted(set(expected) | set(found)):
        want, have = set(expected.get(part, ())), set(found.get(part, ()))
        said += [f"{part}: missing {row}" for row in sorted(want - have, key=repr)]
        said += [f"{part}: unexpected {row}" for row in sorted(have - want, key=repr)]
    return said
