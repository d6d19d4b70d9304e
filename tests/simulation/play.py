"""Play a list of steps in a fresh world; shrink a failing list to a short trace.

SIM_SEEDS and SIM_STEPS scale the budget (see docs/faults.md, Simulation, for the long run).
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from tests.simulation import jobs, twins
from tests.simulation.rules import Violation
from tests.simulation.sites import EmbeddedSite, PgSite
from tests.simulation.steps import Step, draw
from tests.simulation.world import REPLICAS, World

DEFAULT_SEEDS = 6
DEFAULT_STEPS = 500
DEFAULT_TWIN_STEPS = 150  # the first steps of each seed, played comparably on both backends
FIRST_SEED = 1


def budget() -> tuple[list[int], int]:
    """The seeds and the steps per seed: the default budget, or SIM_SEEDS and SIM_STEPS."""
    seeds = int(os.environ.get("SIM_SEEDS", DEFAULT_SEEDS))
    steps = int(os.environ.get("SIM_STEPS", DEFAULT_STEPS))
    first = int(os.environ.get("SIM_FIRST_SEED", FIRST_SEED))
    return list(range(first, first + seeds)), steps


def twin_steps() -> int:
    return int(os.environ.get("SIM_TWIN_STEPS", DEFAULT_TWIN_STEPS))


@dataclass
class Played:
    violation: Violation | None
    at: int  # the index of the step that broke the rule (or the number played)
    faults: Counter[str] = field(default_factory=Counter)
    checked: int = 0
    step_errors: int = 0
    log: list[str] = field(default_factory=list)
    ledger: twins.Rows | None = None  # a comparable play's settled ledger


def open_site(kind: str, server: str | None) -> PgSite | EmbeddedSite:
    if kind == "postgresql":
        assert server is not None
        return PgSite(server)
    return EmbeddedSite()


def play(
    kind: str, server: str | None, seed: int, steps: list[Step], comparable: bool = False
) -> Played:
    """A fresh ledger, three replicas; every step played, then the fleet settles.

    The embedded backend claims ahead too in half the seeds (not by the season's bit), so
    that its `recheck` is played as well as its own way (gate/ahead.py)."""
    site = open_site(kind, server)
    start = jobs.AUTUMN if seed % 2 else jobs.SPRING
    world = World(site, start, comparable=comparable, ahead_anyway=bool(seed >> 1 & 1))
    quiet = logging.getLogger("scheduler")
    # Faults make the gate say a lot. setLevel, not the attribute: it clears the loggers'
    # cached answers, which would otherwise keep "scheduler.gate" silent after the play
    # for every later test in this process (one asserts a claim's failure is logged).
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    index = 0
    try:
        for i in range(REPLICAS):
            world.replicas.append(world.add_replica(f"r{i}", variant=0))
        violation = None
        try:
            for step in steps:
                world.play(step)
                index += 1
            world.settle()
        except Violation as found:
            violation = found
        settled = twins.rows(site.engine) if comparable and violation is None else None
        return Played(
            violation, index, world.faults, world.checked, world.step_errors, world.log, settled
        )
    finally:
        quiet.setLevel(level)
        world.close()
        site.close()


def shrink(fails: Callable[[list[Step]], bool], steps: list[Step], deadline: float) -> list[Step]:
    """Greedy: drop chunks of steps, halving the chunk, while the list still fails."""
    chunk = max(1, len(steps) // 2)
    while chunk >= 1 and time.monotonic() < deadline:
        i, shrunk = 0, False
        while i < len(steps) and time.monotonic() < deadline:
            candidate = steps[:i] + steps[i + chunk :]
            if candidate and fails(candidate):
                steps, shrunk = candidate, True
            else:
                i += chunk
        if not shrunk:
            chunk //= 2
    return steps


def report(kind: str, server: str | None, seed: int, count: int) -> tuple[Played, str | None]:
    """Play a seed; a failure comes back with the seed and its shortest trace found."""
    steps = draw(seed, count)
    played = play(kind, server, seed, steps)
    if played.violation is None:
        return played, None
    rule = played.violation.rule
    failing = steps[: played.at + 1]

    def fails(candidate: list[Step]) -> bool:
        again = play(kind, server, seed, candidate)
        return again.violation is not None and again.violation.rule == rule

    limit = float(os.environ.get("SIM_SHRINK_SECONDS", 60))
    short = shrink(fails, failing, time.monotonic() + limit)
    trace = "\n  ".join(str(step) for step in short)
    return played, (
        f"seed {seed} on {kind} ({count} steps): {played.violation}\n"
        f"replay: SIM_FIRST_SEED={seed} SIM_SEEDS=1 SIM_STEPS={count}\n"
        f"shortest trace found ({len(short)} of {played.at + 1} steps):\n  {trace}"
    )


def compare(server: str, seed: int, count: int) -> tuple[list[Played], str | None]:
    """The seed's first steps played comparably on both backends (see twins.py): a rule
    broken on either, or ledgers that differ, come back with the shortest trace found."""
    steps = draw(seed, count)

    def both(candidate: list[Step]) -> tuple[list[Played], str | None]:
        played = [play(kind, server if kind == "postgresql" else None, seed, candidate, True)
                  for kind in ("postgresql", "embedded")]  # fmt: skip
        for kind, one in zip(("postgresql", "embedded"), played, strict=True):
            if one.violation is not None:
                return played, f"on {kind}: {one.violation}"
        assert played[0].ledger is not None and played[1].ledger is not None
        found = twins.differences(played[0].ledger, played[1].ledger)
        return played, "the ledgers differ:\n    " + "\n    ".join(found) if found else None

    played, failure = both(steps)
    if failure is None:
        return played, None
    limit = float(os.environ.get("SIM_SHRINK_SECONDS", 60))
    short = shrink(lambda c: both(c)[1] is not None, steps, time.monotonic() + limit)
    trace = "\n  ".join(str(step) for step in short)
    return played, (
        f"seed {seed}, its first {count} steps on both backends: {failure}\n"
        f"replay: SIM_FIRST_SEED={seed} SIM_SEEDS=1 SIM_TWIN_STEPS={count}\n"
        f"shortest trace found ({len(short)} of {count} steps, its own failure may differ):"
        f"\n  {both(short)[1]}\n  {trace}"
    )
