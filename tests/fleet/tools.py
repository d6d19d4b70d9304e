"""System tools some fleet tests drive (promtool, pgbouncer); `.ci/run` installs them."""

from __future__ import annotations

import os
import shutil

import pytest


def require(tool: str, package: str) -> str:
    """The tool's path; a missing tool skips the test, except in CI, where it fails it."""
    path = shutil.which(tool)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{tool} is required in CI (apt-get install {package})")
        pytest.skip(f"{tool} not installed (apt-get install {package})")
    return path
