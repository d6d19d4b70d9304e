"""The ledger's vocabulary: what happened to a tick, and what a run was told."""

from __future__ import annotations

from enum import StrEnum


class Status(StrEnum):
    """A tick's status in the ledger (`history` shows these)."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    INTERRUPTED = "interrupted"  # the job stopped early when told to (scheduler.Interrupted)
    SKIPPED = "skipped"  # the previous run still held the job's lock
    CRASHED = "crashed"  # its replica died or lost the lock before the run ended
    MISSED = "missed"  # no replica started it within its misfire grace
    PAUSED = "paused"  # the job was paused for the fleet


FINISHED = (Status.SUCCEEDED, Status.FAILED, Status.INTERRUPTED, Status.CRASHED)


class Told(StrEnum):
    """What a run was told while it ran (recorded with it, shown in `history`)."""

    STOPPING = "stopping"  # the daemon began to shut down
    LOCK_LOST = "lock_lost"  # its replica could no longer prove it held the lock


# Why a run was recorded `crashed`: one wording wherever it is decided.
CRASHED_LOST_LOCK = "its replica died or lost the job's lock before the run ended"
CRASHED_FOUND_BY_SWEEP = "its replica died before the run ended (no session holds the job's lock)"
NOT_STARTED_LOCK_LOST = "not started: its replica lost the job's lock before a worker was free"
NOT_STARTED_UNSURE = "not started: asking again before its start failed ({reason})"
CRASHED_AT_SHUTDOWN = "still running when shutdown_grace ({grace:g} s) ran out"
# Why a run was recorded `failed` although it may have returned: the job's `timeout`.
TIMED_OUT = "timed out after {timeout}"
