"""The simulation's own test: each patch in mutations/ puts back one fault the scheduler
once had; the simulation must catch every one.

Run as `.venv/bin/python tests/simulation/mutations.py`: each patch is applied to a
copy of the tree, and the seeds of the default budget (or of SIM_SEEDS and SIM_STEPS)
are played there, both backends, and each seed's first steps compared on both (as the
test does), until a rule breaks or the ledgers differ. Prints the seed and the rule
that caught each, and `mutations killed: K/N`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATCHES = Path(__file__).resolve().parent / "mutations"
IGNORE = shutil.ignore_patterns(
    ".git", ".venv*", "__pycache__", "*.egg-info", "site", ".*_cache", ".hypothesis"
)
SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"


def play_here(seeds: int, steps: int) -> int:
    """In the mutated copy: play seeds until one breaks a rule; print it, exit 1."""
    from tests.simulation.play import budget, compare, play, twin_steps
    from tests.simulation.steps import draw

    first, _ = budget()
    server = os.environ.get("SCHEDULER_TEST_DATABASE_URL", SERVER)
    os.environ.setdefault("SIM_SHRINK_SECONDS", "0")  # the seed and the rule are enough here
    for seed in first[:seeds]:
        for kind in ("embedded", "postgresql"):
            played = play(kind, server, seed, draw(seed, steps))
            if played.violation is not None:
                print(f"killed by seed {seed} on {kind}: {played.violation}")
                return 1
        _, failure = compare(server, seed, twin_steps())
        if failure is not None:
            print(f"killed by seed {seed} compared: {failure.splitlines()[0][:200]}")
            return 1
    print(f"survived {seeds} seeds x {steps} steps")
    return 0


def try_patch(patch: Path, seeds: int, steps: int) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory(prefix="scheduler-mutant-") as folder:
        copy = Path(folder) / "tree"
        shutil.copytree(ROOT, copy, ignore=IGNORE, symlinks=True)  # a link is not followed
        subprocess.run(["patch", "-s", "-p1", "-i", str(patch)], cwd=copy, check=True)
        env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
        done = subprocess.run(
            [sys.executable, "-c", _RUN.format(seeds=seeds, steps=steps)],
            cwd=copy,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        said = (done.stdout.strip().splitlines() or [done.stderr.strip()[-300:]])[-1]
        return done.returncode == 1, said


_RUN = (
    "import scheduler, sys, pathlib;"
    "here = pathlib.Path(scheduler.__file__).is_relative_to(pathlib.Path.cwd());"
    "assert here, scheduler.__file__;"
    "from tests.simulation.mutations import play_here;"
    "sys.exit(play_here({seeds}, {steps}))"
)


def main() -> int:
    from tests.simulation.play import budget

    chosen, steps = budget()
    seeds = len(chosen)
    patches = sorted(PATCHES.glob("*.diff"))
    killed = 0
    for patch in patches:
        began = time.monotonic()
        caught, said = try_patch(patch, seeds, steps)
        killed += caught
        print(f"{patch.stem}: {said} ({time.monotonic() - began:.0f} s)", flush=True)
    print(f"mutations killed: {killed}/{len(patches)} ({len(chosen)} seeds x {steps} steps)")
    return 0 if killed == len(patches) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
