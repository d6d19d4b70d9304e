"""Array literals for the claim and finish calls, cast server-side.

A claim sends several arrays of hundreds of values each: formatting the
literal here costs a fraction of adapting every element of a Python list,
and one function per element type keeps it cheap.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime


def pg_numbers(values: Iterable[int | float | None]) -> str:
    return "{" + ",".join("NULL" if v is None else repr(v) for v in values) + "}"


def pg_texts(values: Iterable[str | None]) -> str:
    return "{" + ",".join(map(_text_element, values)) + "}"


def pg_times(values: Iterable[datetime | None]) -> str:
    """A burst's ticks are mostly one instant: each distinct one is formatted once."""
    formatted: dict[datetime | None, str] = {None: "NULL"}
    items = []
    for value in values:
        item = formatted.get(value)
        if item is None:
            assert value is not None
            item = formatted[value] = f'"{value.isoformat()}"'
        items.append(item)
    return "{" + ",".join(items) + "}"


def pg_bools(values: Iterable[bool]) -> str:
    return "{" + ",".join("t" if value else "f" for value in values) + "}"


def _text_element(value: str | None) -> str:
    if value is None:
        return "NULL"
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
