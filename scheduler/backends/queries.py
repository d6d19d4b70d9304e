"""The PostgreSQL backend's statements, kept by name in queries.sql (`-- name: x` above each)."""

from __future__ import annotations

import re
from importlib import resources

from sqlalchemy import TextClause, text

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.M)


def load() -> dict[str, TextClause]:
    source = resources.files("scheduler.backends").joinpath("queries.sql").read_text()
    parts = _NAME.split(source)[1:]
    found = {}
    for name, body in zip(parts[0::2], parts[1::2], strict=True):
        lines = [line for line in body.splitlines() if not line.lstrip().startswith("--")]
        found[name] = text("\n".join(lines).strip())
    return found


QUERIES = load()
