"""Shares of a burst seen from the replica (scheduler/backends/shares.py): which ticks a
claim leaves out, answering them `yielded` itself, and which it always sends."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from scheduler.backends.base import ClaimRequest, Intent
from scheduler.backends.shares import (
    FLEET_SHAPE_READS,
    SHAPE_EVERY,
    Shape,
    helping,
    leave_out,
    shape_due,
    share_of,
)

NOW = datetime(2026, 12, 5, 12, 0, 0, tzinfo=UTC)
SHARE_FROM, TAKEOVER = 32, 0.1


def burst(at: datetime, keys: range, intent: Intent = Intent.RUN) -> list[ClaimRequest]:
    return [
        ClaimRequest(
            key=k, name=f"job{k}", scheduled_at=at, intent=intent, grace_s=30, skip_threshold=3
        )
        for k in keys
    ]


def shape(live: int = 3, rank: int = 1, read_at: float = 100.0) -> Shape:
    return Shape(live=live, rank=rank, db_now=NOW, read_at=read_at)


def split(requests, found: Shape | None, monotonic_now: float = 100.0):
    send, others = leave_out(
        requests, found, monotonic_now, share_from=SHARE_FROM, takeover_s=TAKEOVER
    )
    return {r.key for r in send}, {r.key for r in others}


def test_a_young_burst_is_sent_as_this_replicas_own_share_only():
    requests = burst(NOW, range(1, 301))
    send, others = split(requests, shape())
    assert send == {k for k in range(1, 301) if share_of(k, 3) == 1}
    assert others == {k for k in range(1, 301) if share_of(k, 3) != 1}
    assert 70 < len(send) < 130  # about a third each (the hash spreads consecutive keys)


def test_everything_is_sent_when_the_server_would_share_nothing_out():
    requests = burst(NOW, range(1, 301))
    assert split(requests, None)[1] == set()  # no shape learned yet
    assert split(requests, shape(live=1, rank=0))[1] == set()  # a fleet of one
    assert split(burst(NOW, range(1, SHARE_FROM)), shape())[1] == set()  # a small batch


def test_only_young_run_ticks_are_left_out():
    young = burst(NOW, range(1, 101))
    old = burst(NOW - timedelta(seconds=TAKEOVER), range(101, 201))  # anyone's by now
    skips = burst(NOW, range(201, 301), Intent.SKIP)  # recorded skipped by the replica that runs it
    caught_up = burst(NOW, range(301, 401), Intent.CATCH_UP)
    send, others = split(young + old + skips + caught_up, shape())
    assert others == {k for k in range(1, 101) if share_of(k, 3) != 1}
    assert send >= set(range(101, 401))


def test_a_tick_left_out_once_is_sent_once_it_is_anyones():
    """Its age by the database's clock, estimated from the shape's reading and this
    replica's monotonic clock, only grows: it is left out for the takeover at most."""
    requests = burst(NOW, range(1, 301))
    assert split(requests, shape(), monotonic_now=100.05)[1]
    assert split(requests, shape(), monotonic_now=100.0 + TAKEOVER)[1] == set()
    # A monotonic reading before the shape's (another thread's clock) never makes ticks
    # younger than the server last said.
    assert shape().db_clock(99.0) == NOW


def test_nothing_is_left_out_when_nothing_of_this_replicas_own_would_go():
    theirs = [k for k in range(1, 2000) if share_of(k, 3) != 0][: SHARE_FROM + 5]
    requests = [r for k in theirs for r in burst(NOW, range(k, k + 1))]
    send, others = split(requests, shape(rank=0))
    assert others == set() and send == set(theirs)


def test_a_claim_helps_with_the_run_ticks_of_other_shares_only():
    old = NOW - timedelta(seconds=1)
    requests = burst(old, range(1, 101)) + burst(old, range(101, 201), Intent.SKIP)
    helped = {r.key for r in helping(requests, shape(rank=2))}
    assert helped == {k for k in range(1, 101) if share_of(k, 3) != 2}
    assert helping(requests, None) == [] and helping(requests, shape(live=1, rank=0)) == []


def test_the_fleet_reads_its_shape_a_bounded_number_of_times_a_second():
    """Every SHAPE_EVERY in a small fleet; in a large one each replica waits longer, so
    that the fleet's reads (each over pg_locks) stay about FLEET_SHAPE_READS a second."""
    assert shape_due(None, 0.0)
    small = shape(live=3, read_at=100.0)
    assert not shape_due(small, 100.0 + SHAPE_EVERY - 0.01)
    assert shape_due(small, 100.0 + SHAPE_EVERY)
    large = shape(live=100, read_at=100.0)
    every = 100 / FLEET_SHAPE_READS
    assert every > SHAPE_EVERY
    assert not shape_due(large, 100.0 + every - 0.01)
    assert shape_due(large, 100.0 + every)
