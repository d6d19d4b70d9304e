"""What every comparison replica shares with bench/fleet.py: its command line and evidence.

`Fleet.command` starts each alternative with the same arguments, and
`Fleet.runs` reads the same JSON line from each run. Standard library only:
the replicas run in different virtual environments.
"""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--jobs", type=int, required=True)
    parser.add_argument("--instance", required=True)
    parser.add_argument("--evidence", required=True)
    parser.add_argument("--job-ms", type=float, default=1.0)
    parser.add_argument("--key-base", type=int, default=10_000)
    parser.add_argument(
        "--interval-s", type=int, default=1, help="seconds between ticks (days: an idle fleet)"
    )
    return parser.parse_args()


def append_evidence(path: str, job: str, scheduled: datetime, instance: str, start: float) -> None:
    """One short line per open/write/close, so appends from several processes never interleave."""
    line = json.dumps(
        {
            "job": job,
            "tick": scheduled.astimezone(UTC).isoformat(),
            "instance": instance,
            "start": start,
            "scheduled": scheduled.timestamp(),
        }
    )
    with open(path, "a", encoding="utf-8") as evidence:
        evidence.write(line + "\n")
