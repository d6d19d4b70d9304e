"""The totals of every seed played in this test run, for the one summary line."""

from __future__ import annotations

from collections import Counter
from typing import Any

from tests.simulation import twins
from tests.simulation.play import Played
from tests.simulation.steps import FAULTS

TOTALS: dict[str, Any] = {
    "seeds": 0, "steps": 0, "kinds": [], "faults": {}, "checked": 0,
    "twins": 0, "twin_steps": 0, "twin_rows": 0, "twin_differ": 0,
}  # fmt: skip
VIOLATIONS: list[int] = [0]
CUT = "sweep_cut_short"  # not a fault of the budget's: a sweep step's own (world._sweep)
# Runs won ahead, asked again past their lease (Gate._recheck): not faults, paths covered.
RECHECKS = ("run", "paused", "lost")


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


def add_twins(played: list[Played], steps: int) -> None:
    """A seed compared on both backends: its rows (of one ledger), and whether they differ."""
    rows = [twins.count(p.ledger) for p in played if p.ledger is not None]
    differ = len(rows) < 2 or twins.differences(played[0].ledger or {}, played[1].ledger or {})
    merge({"twins": 1, "twin_steps": steps, "twin_rows": rows[0] if rows else 0,
           "twin_differ": int(bool(differ)), "checked": sum(p.checked for p in played),
           "violations": sum(p.violation is not None for p in played)})  # fmt: skip


def merge(part: dict[str, Any]) -> None:
    for name in ("seeds", "checked", "twins", "twin_rows", "twin_differ"):
        TOTALS[name] += part.get(name, 0)
    for name in ("steps", "twin_steps"):
        TOTALS[name] = max(TOTALS[name], part.get(name, 0))
    TOTALS["kinds"] = sorted(set(TOTALS["kinds"]) | set(part.get("kinds", [])), reverse=True)
    TOTALS["faults"] = dict(Counter(TOTALS["faults"]) + Counter(part.get("faults", {})))
    VIOLATIONS[0] += part.get("violations", 0)


def snapshot() -> dict[str, Any]:
    return {**TOTALS, "violations": VIOLATIONS[0]}


def line() -> str | None:
    if not TOTALS["seeds"]:
        return None
    kinds = TOTALS["kinds"]
    seeds = TOTALS["seeds"] // max(1, len(kinds))
    counted = TOTALS["faults"]
    faults = ", ".join(f"{kind} {counted.get(kind, 0)}" for kind in FAULTS)
    rechecked = ", ".join(f"{said} {counted.get(f'recheck_{said}', 0)}" for said in RECHECKS)
    return (
        f"simulation: {seeds} seeds x {TOTALS['steps']} steps ({', '.join(kinds)}); "
        f"faults injected: {faults}; sweeps cut short: {counted.get(CUT, 0)}; "
        f"rechecks: {counted.get('recheck_sent', 0)} sent, "
        f"{counted.get('recheck_answered', 0)} answered (runs: {rechecked}); "
        f"probes of other replicas' ticks: {counted.get('probe_answered', 0)} answered, "
        f"{counted.get('probe_ticks', 0)} ticks, {counted.get('probe_untaken', 0)} untaken; "
        f"rules checked: {TOTALS['checked']}; "
        f"violations: {VIOLATIONS[0]}"
        + (
            f"; ledgers compared: {TOTALS['twins']} seeds x {TOTALS['twin_steps']} steps, "
            f"{TOTALS['twin_rows']} rows, differing: {TOTALS['twin_differ']}"
            if TOTALS["twins"]
            else ""
        )
    )
