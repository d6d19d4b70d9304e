"""The simulation's summary line, whether the seeds ran here or on xdist workers."""

from __future__ import annotations

import json

import pytest

from tests.simulation import summary


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: its totals go to the controller
        workeroutput["simulation"] = json.dumps(summary.snapshot())


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    found = getattr(node, "workeroutput", {}).get("simulation")
    if found:
        summary.merge(json.loads(found))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    said = summary.line()
    if said is not None:
        terminalreporter.write_line(said)
