"""Idle load side by side: one replica of each checkout, 100 jobs that never fall due.

    .venv/bin/python bench/idle.py [--base TREE] [--minutes 2]

Each replica in a database of its own, with the server's statement log on:
transactions per minute, and the statements behind them (per minute, the most
frequent first). `bench/run.py` measures this checkout's over its whole run.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edges import sides
from fleet import Fleet, Server
from run import IDLE_INTERVAL_S, SERVER


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, help="a checkout to measure side by side")
    parser.add_argument("--minutes", type=float, default=2.0)
    args = parser.parse_args()
    trees, found_in = sides(args.base)
    server = Server(SERVER)
    fleets = []
    for label, tree in trees.items():
        database = server.create(f"idle_{label}", log_statements=True)
        fleet = Fleet("ours", server, database, 100, interval_s=IDLE_INTERVAL_S, tree=tree)
        fleet.start(f"idle-{label}")
        fleets.append((label, fleet))
    try:
        time.sleep(10)  # past start-up
        began, offset = time.time(), server.log_offset()
        time.sleep(args.minutes * 60)
        minutes = (time.time() - began) / 60
        for label, fleet in fleets:
            count = server.logged_transactions(fleet.database, offset)
            print(f"{label} ({found_in[label]}): {count / minutes:.1f} transactions per minute")
            said = Counter(sql[:70] for _, sql in server.logged(fleet.database, offset))
            for sql, n in said.most_common(15):
                print(f"  {n / minutes:6.1f}/min  {sql}")
    finally:
        for _, fleet in fleets:
            fleet.stop()
            server.drop(fleet.database)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
