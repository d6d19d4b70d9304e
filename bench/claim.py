"""The claim and finish calls alone: client CPU and wall time per batch of N ticks.

    .venv/bin/python bench/claim.py [--ticks 500] [--rounds 10]

One replica's lock session against a fresh database on the local server. A
round wins a batch of N ticks and records them finished; then the same batches
are claimed again, all lost (what a replica's second look at the other
replicas' shares of a burst costs when they have taken them all).
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fleet import SERVER, Server

from scheduler.backends.base import ClaimRequest, FinishRequest, Intent
from scheduler.backends.postgres import PostgresBackend


def batch(ticks: int, at: datetime) -> list[ClaimRequest]:
    return [
        ClaimRequest(
            key=key,
            name=f"job_{key}",
            scheduled_at=at,
            intent=Intent.RUN,
            grace_s=60.0,
            skip_threshold=3,
        )
        for key in range(1, ticks + 1)
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ticks", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    server = Server(SERVER)
    database = server.create("claim")
    backend = PostgresBackend(
        server.database_url(database), instance="bench", namespace=7, holder_timeout=30
    )
    try:
        backend.migrate()
        backend.connect()
        start = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=args.rounds + 2)
        batches = [batch(args.ticks, start + timedelta(seconds=i)) for i in range(args.rounds)]
        cpu, wall = time.process_time(), time.perf_counter()
        for requests in batches:
            won = backend.claim(requests, "bench", capacity=args.ticks)
            backend.finish(
                [
                    FinishRequest(r.key, r.scheduled_at, r.run_id, "succeeded", None, True, 3)
                    for r in won.answered
                    if r.run_id is not None
                ]
            )
        won_cpu, won_wall = time.process_time() - cpu, time.perf_counter() - wall
        cpu, wall = time.process_time(), time.perf_counter()
        for requests in batches:
            backend.claim(requests, "bench", capacity=args.ticks)
        lost_cpu, lost_wall = time.process_time() - cpu, time.perf_counter() - wall
    finally:
        backend.close()
        server.drop(database)
    n = args.rounds
    print(f"{args.ticks} ticks per batch, {n} rounds; per batch:")
    for what, cpu_s, wall_s in (
        ("claim won + finish", won_cpu, won_wall),
        ("claim, all lost", lost_cpu, lost_wall),
    ):
        print(f"  {what:<20} client CPU {cpu_s / n * 1000:.1f} ms, wall {wall_s / n * 1000:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
