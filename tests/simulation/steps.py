"""The steps of a simulated run, drawn from one seeded generator before it starts.

A step is plain data: which action, and a few numbers that the world reads
modulo what exists when it is played (a replica index, a run index). So a
step list replays exactly, and a shorter list made by removing steps still
means something: shrinking replays it.
"""

from __future__ import annotations

import random
from typing import NamedTuple

# Every fault the simulation injects, by the name the summary counts it under.
FAULTS = (
    "error_before",
    "reply_lost",
    "statement_timeout",
    "lock_timeout",
    "deadlock",
    "killed_session",
    "frozen_replica",
    "stalled_replica",  # as it hands runs over (world._handing): no step of its own
    "clock_jump",
    "clock_skew",
    "restart_other_schedule",
    "crash_restart",
    "reload",
    "pause_resume",
    "run_now",
    "retry_due",
    "catch_up",
    "database_restart",
)
CALL_FAULTS = (
    "error_before",
    "reply_lost",
    "statement_timeout",
    "lock_timeout",
    "deadlock",
    "killed_session",
)


class Step(NamedTuple):
    action: str
    a: int = 0
    b: int = 0
    c: int = 0

    def __str__(self) -> str:
        return f"{self.action}({self.a},{self.b},{self.c})"


# (action, weight): time and steps of the replicas make the calls that call faults meet;
# every other fault is drawn often enough to come about a hundred times in the default
# budget (the summary line counts them).
WEIGHTS = (
    ("tick", 16),
    ("step_all", 18),
    ("step", 8),
    ("finish", 16),
    ("fault_call", 46),
    ("freeze", 4),
    ("clock_jump", 3),
    ("clock_skew", 3),
    ("restart_other_schedule", 4),
    ("crash_restart", 3),
    ("reload", 3),
    ("pause_resume", 3),
    ("run_now", 4),
    ("retry_due", 3),
    ("catch_up", 3),
    ("database_restart", 3),
    ("sweep", 4),
)
# The call faults a fault step arms, the ones met inside a statement more often: they
# wait for a call that writes where they are set.
ARMED = (
    *("error_before",) * 3,
    *("reply_lost",) * 4,
    *("killed_session",) * 3,
    *("statement_timeout",) * 5,
    *("lock_timeout",) * 6,
    *("deadlock",) * 5,
)


def draw(seed: int, count: int) -> list[Step]:
    """`count` steps from `seed`: the same seed gives the same steps, on every backend."""
    rng = random.Random(seed)
    actions = [name for name, _ in WEIGHTS]
    weights = [weight for _, weight in WEIGHTS]
    return [
        Step(
            rng.choices(actions, weights)[0],
            rng.randrange(1 << 16),
            rng.randrange(1 << 16),
            rng.randrange(1 << 16),
        )
        for _ in range(count)
    ]
