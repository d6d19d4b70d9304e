"""The totals of every seed played in this test run, for the one summary line."""

from __future__ import annotations

from collections import Counter
from typing import Any

from tests.simulation.play import Played
from tests.simulation.steps import FAULTS

TOTALS: dict[str, Any] = {"seeds": 0, "steps": 0, "kinds": [], "faults": {}, "checked": 0}
VIOLATIONS: list[int] = [0]
CUT = "sweep_cut_short"  # not a fault of the budget's: a sweep step's own (world._sweep)


def add(kind: str, played: Played, steps: int) -> None:
    merge(
        {
            "seeds": 1,
            "steps": steps,
            "kinds": [kind],
            "faults": dict(played.faults),
            "checked": played.checked,
            "violations": int(played.violation is not None),
        }
    )


def merge(part: dict[str, Any]) -> None:
    TOTALS["seeds"] += part["seeds"]
    TOTALS["steps"] = max(TOTALS["steps"], part["steps"])
    TOTALS["kinds"] = sorted(set(TOTALS["kinds"]) | set(part["kinds"]), reverse=True)
    TOTALS["faults"] = dict(Counter(TOTALS["faults"]) + Counter(part["faults"]))
    TOTALS["checked"] += part["checked"]
    VIOLATIONS[0] += part.get("violations", 0)


def snapshot() -> dict[str, Any]:
    return {**TOTALS, "violations": VIOLATIONS[0]}


def line() -> str | None:
    if not TOTALS["seeds"]:
        return None
    kinds = TOTALS["kinds"]
    seeds = TOTALS["seeds"] // max(1, len(kinds))
    faults = ", ".join(f"{kind} {TOTALS['faults'].get(kind, 0)}" for kind in FAULTS)
    return (
        f"simulation: {seeds} seeds x {TOTALS['steps']} steps ({', '.join(kinds)}); "
        f"faults injected: {faults}; sweeps cut short: {TOTALS['faults'].get(CUT, 0)}; "
        f"rules checked: {TOTALS['checked']}; "
        f"violations: {VIOLATIONS[0]}"
    )
