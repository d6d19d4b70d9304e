"""The fleet tier drives real processes; what it leaves to the garbage collector is theirs.

These tests start replicas and commands with pipes and kill, freeze and cut them,
so a pipe of a process killed mid-read can be closed only by the collector: its
`ResourceWarning` says nothing about the scheduler. Every other warning stays an
error here, and the unit, integration and simulation tiers keep them all as errors.
"""

from __future__ import annotations

import pytest

LEFT_TO_THE_COLLECTOR = (
    "ignore::ResourceWarning",
    "ignore:Exception ignored in. <_io:pytest.PytestUnraisableExceptionWarning",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith("tests/fleet/"):
            for rule in LEFT_TO_THE_COLLECTOR:
                item.add_marker(pytest.mark.filterwarnings(rule))
