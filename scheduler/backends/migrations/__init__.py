"""The ledger's schema as numbered SQL files, one folder per dialect, applied in order.

`NNNN_what.sql`: the number is the schema version it brings a ledger to (versions 1 to 7
were made by Python steps before; their files make the same tables). A file once
released is never edited: a ledger that applied it will not apply it again, so a change
is a new file. Both folders hold the same numbers (a version with nothing to do on one
dialect says so in a comment). `manifest.txt` records the hash of every file and of
postgres.sql; tests/integration/test_migrations.py fails when they disagree.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable

FILE_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
DIALECTS = ("postgresql", "sqlite")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str  # the file's name, e.g. 0003_notices_and_told.sql
    sql: str

    def statements(self) -> list[str]:
        """The file cut at each semicolon that ends a line (SQLite runs one at a time)."""
        cut = re.split(r";[ \t]*\n", self.sql + "\n")
        return [s.strip() for s in cut if _code(s)]


def _code(statement: str) -> bool:
    lines = (line.strip() for line in statement.splitlines())
    return any(line and not line.startswith("--") for line in lines)


def folder(dialect: str) -> Traversable:
    return resources.files(__name__).joinpath(dialect)


def migrations(dialect: str) -> list[Migration]:
    """The dialect's files in version order; a badly named file is an error, not skipped."""
    found = []
    for entry in folder(dialect).iterdir():
        if not entry.name.endswith(".sql"):
            continue
        named = FILE_NAME.match(entry.name)
        if not named:
            raise ValueError(f"migration file {dialect}/{entry.name}: expected NNNN_what.sql")
        found.append(Migration(int(named.group(1)), entry.name, entry.read_text()))
    found.sort(key=lambda m: m.version)
    numbers = [m.version for m in found]
    if numbers != list(range(1, len(found) + 1)):
        raise ValueError(f"migration files of {dialect} are not numbered 1..N: {numbers}")
    return found


def functions_sql() -> str:
    """The gate's PostgreSQL functions, installed whole after the migrations."""
    return resources.files("scheduler.backends").joinpath("postgres.sql").read_text()


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


LATEST = len(migrations("postgresql"))
