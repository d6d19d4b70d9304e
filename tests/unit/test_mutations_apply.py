"""Every mutation of tests/simulation/mutations/ still applies to the code.

A refactor that moves the lines a mutation patches would leave
`tests/simulation/mutations.py` failing on a patch, not on the simulation:
this names the patch in the normal suite, before anyone runs the script.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MUTATIONS = sorted((ROOT / "tests" / "simulation" / "mutations").glob("*.diff"))


def test_there_are_mutations():
    assert len(MUTATIONS) >= 6


@pytest.mark.parametrize("patch", MUTATIONS, ids=lambda p: p.stem)
def test_the_mutation_applies_to_the_code(patch):
    found = subprocess.run(
        ["git", "apply", "--check", str(patch)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert found.returncode == 0, f"{patch.name} no longer applies: {found.stderr}"
