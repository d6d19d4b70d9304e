"""Every query parameter the page reads, and the parser of each (`scheduler.config.parsing`).

One table for all routes: a parameter present is parsed whatever the route, and a
malformed one refuses the request (`parsing.Refused`: 400 and one line); a
parameter the page does not read is ignored. Forms are read here too, bounded.
The filters of `/api/history` (since, until, status, instance) are read by the
function `scheduler history` reads its flags with (`scheduler.fleet.status`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl

from scheduler.config import parsing
from scheduler.web.server import Request
from scheduler.web.views import DONE, SORTS, WINDOWS

MAX_FIELDS = 20
MIN_REFRESH = 2  # seconds between two refreshes of a page, at least
MAX_REFRESH = 3600
API_LIMIT = 1000  # rows of /api/jobs/NAME/history at most
MAX_QUERY = 100  # characters of the jobs filter
MAX_JOB = 200  # characters of a job's name in /api/history?job=


def _refresh(text: str) -> int:
    """`?refresh=N`: the script refreshes every N seconds (0: never; at least 2)."""
    seconds = parsing.whole(text, "refresh", 0, MAX_REFRESH)
    return 0 if seconds == 0 else max(seconds, MIN_REFRESH)


QUERY: dict[str, Callable[[str], Any]] = {
    "refresh": _refresh,
    "window": lambda text: parsing.choice(text, "window", WINDOWS),
    "sort": lambda text: parsing.choice(text, "sort", SORTS),
    "q": lambda text: parsing.words(text, "q", MAX_QUERY),
    "done": lambda text: parsing.choice(text, "done", DONE),
    "asked": lambda text: parsing.ledger_id(text, "asked"),
    "before": lambda text: parsing.instant(text, "before"),
    "limit": lambda text: parsing.whole(text, "limit", 1, API_LIMIT),
    "job": lambda text: parsing.words(text, "job", MAX_JOB),
    "next": parsing.local_path,
}


def parsed(request: Request) -> dict[str, Any]:
    """The request's query parameters the page reads, parsed; raises parsing.Refused."""
    given = fields(request.query)
    return {name: parse(given[name]) for name, parse in QUERY.items() if name in given}


def form(request: Request) -> dict[str, str]:
    return fields(request.body.decode("utf-8", "replace"))


def fields(text: str) -> dict[str, str]:
    try:
        return dict(parse_qsl(text, max_num_fields=MAX_FIELDS))
    except ValueError:  # too many fields: none is taken
        return {}
