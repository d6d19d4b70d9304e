"""Shares of a burst, seen from the replica: the other replicas' ticks left out of a claim.

A burst (every job of one grid due at the same instant) is shared out among the
live replicas by the server (postgres.sql, `scheduler_share`): a replica's claim
answers another's young ticks `yielded`, and it offers them again once they are
anyone's. Sending them costs both sides a tick each for nothing: at 1,000 jobs and
3 replicas, two thirds of the first claim of every second. So the lock session
learns the fleet's shape (live replicas, its rank, the database's clock) from a
claim now and then, and leaves out of the next claims the ticks that the server
would yield, answering them `yielded` itself.

Only a guess is made here, never a decision: the server still decides each tick it is
sent, so a shape gone stale (a replica came or went since) costs at most a tick's
`YIELDED_RETRY` before it is offered again. A tick is left out only while it is young
by the database's clock, as estimated from the shape's reading and the monotonic clock
since: its age grows with that clock (a new reading may set it back by a round trip), so
it is left out once, twice at the edge of the takeover, and then goes with the claims.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from scheduler.backends.base import ClaimRequest, Intent

HASH = 2654435761  # Knuth's multiplicative hash, as scheduler_share
SHARE_FROM = 32  # bursts of fewer ticks are not spread over the live replicas
SHAPE_EVERY = 1.0  # seconds: the fleet's shape is asked for again at most this often
# Reads of the shape a second, the whole fleet's, that a large fleet keeps to: each reads
# pg_locks, every session's locks, and 100 replicas reading it every second spent more of
# the server than their claims did.
FLEET_SHAPE_READS = 20.0


def share_of(key: int, live: int) -> int:
    """Which live replica's share job `key` falls in: `scheduler_share` in postgres.sql
    (job keys are positive; a test holds the two equal)."""
    return key * HASH % 4294967296 % max(live, 1)


@dataclass(frozen=True)
class Shape:
    """The fleet as the server saw it at one claim."""

    live: int
    rank: int
    db_now: datetime  # the database's clock at that claim
    read_at: float  # this replica's monotonic clock when that claim was sent
    share_from: int = SHARE_FROM  # the fewest ticks of a burst the server shares out

    def db_clock(self, monotonic_now: float) -> datetime:
        """The database's clock now, estimated: never behind what the server said."""
        return self.db_now + timedelta(seconds=max(0.0, monotonic_now - self.read_at))


def shape_due(shape: Shape | None, monotonic_now: float) -> bool:
    """Whether to read the fleet's shape beside the next claim or probe: every
    `SHAPE_EVERY`, and in a fleet of more than `FLEET_SHAPE_READS` replicas, less often,
    so that all of them together read it that many times a second.

    A staler shape costs no tick: a share whose owner is gone is helped with after
    `HELP_AFTER` (scheduler/gate/others.py), and the server decides every tick sent.
    """
    if shape is None:
        return True
    every = max(SHAPE_EVERY, shape.live / FLEET_SHAPE_READS)
    return monotonic_now - shape.read_at >= every


def leave_out(
    requests: Sequence[ClaimRequest],
    shape: Shape | None,
    monotonic_now: float,
    *,
    share_from: int,
    takeover_s: float,
) -> tuple[list[ClaimRequest], list[ClaimRequest]]:
    """(to send, to answer `yielded` here): the young `run` ticks of other replicas'
    shares, when the server would share this batch out (`share_from` ticks or more).
    Everything is sent when nothing of this replica's own would be."""
    if shape is None or shape.live <= 1 or len(requests) < share_from:
        return list(requests), []
    young_after = shape.db_clock(monotonic_now) - timedelta(seconds=takeover_s)
    send: list[ClaimRequest] = []
    others: list[ClaimRequest] = []
    for request in requests:
        theirs = (
            request.intent is Intent.RUN
            and request.scheduled_at > young_after
            and share_of(request.key, shape.live) != shape.rank
        )
        (others if theirs else send).append(request)
    if not send:
        return list(requests), []
    return send, others


def helping(requests: Sequence[ClaimRequest], shape: Shape | None) -> list[ClaimRequest]:
    """The `run` ticks of other replicas' shares among these: a claim that helps."""
    if shape is None or shape.live <= 1:
        return []
    return [
        r for r in requests if r.intent is Intent.RUN and share_of(r.key, shape.live) != shape.rank
    ]
