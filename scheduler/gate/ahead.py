"""Claiming ahead: a claim may win more runs than workers are free, while runs are short.

Each claim is a round trip and a transaction. Claiming no more runs than workers
are free, a replica with 20 workers and jobs of a millisecond made 17 claims a
second for its share of 1,000 ticks a second, and those claims, not the runs, held
the machine's CPU. So a backend whose claims are round trips (`claims_ahead`) may
win, on top of the free workers, as many runs as those workers are expected to
start within `HORIZON`, judged by how long this replica's runs have lasted
(`RunLengths`). The runs won ahead wait in the workers' queue, holding their
job's lock and their `running` row, as any run just claimed does.

Every run handed to the workers has a lease, won ahead or not: it may start only
within `LEASE` of its claim's sending (this replica's monotonic clock). A worker
that takes it later (behind busy workers; in a process stopped meanwhile) does not
start it but hands it back, and the dispatcher asks the backend again
(`LockStore.recheck`): a job paused meanwhile has a scheduled or caught-up tick
recorded `paused`, and a retry waiting again (a run a person asked for goes); a job
a reload took away gives its tick back (its row and lock go); otherwise its start
is stamped again and it goes with a new lease. Why the claim's sending: a claim
that did not see a pause began before the pause was committed, so its runs start
before `LEASE` has passed since that commit; `scheduler pause` returns only once it
has (`scheduler.fleet.pauses.SETTLE`). A run whose recheck failed is not started
(its lock may have been given back by the call): it is recorded crashed.
"""

from __future__ import annotations

import threading

# Seconds after its claim was sent within which a run won ahead may start without
# asking again; `scheduler pause` waits as long after its commit before it returns.
LEASE = 0.5
# Seconds of the free workers' time a claim may fill ahead: well inside the lease, so
# that a run won ahead seldom needs asking again.
HORIZON = 0.05
MAX_AHEAD = 500  # runs won ahead by one step's claims, at most
WEIGHT = 0.2  # of each run's length in the running mean (exponential)


class RunLengths:
    """How long this replica's runs last, as a running mean: none known, none ahead."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._mean: float | None = None

    def add(self, seconds: float) -> None:
        seconds = max(seconds, 0.0)
        with self._mutex:
            mean = self._mean
            self._mean = seconds if mean is None else mean + WEIGHT * (seconds - mean)

    def ahead(self, free: int) -> int:
        """Runs to claim beyond `free` workers: what they would start within HORIZON."""
        with self._mutex:
            mean = self._mean
        if free <= 0 or mean is None:
            return 0
        per_worker = HORIZON / max(mean, HORIZON / MAX_AHEAD)
        return min(MAX_AHEAD, int(free * per_worker))
