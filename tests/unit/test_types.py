"""The code type-checks: `mypy --strict` over scheduler/ (configured in pyproject.toml) is
clean, and every ignore that remains names its error code and says why."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.support import ROOT

IGNORE = re.compile(r"#\s*type:\s*ignore(?P<code>\[[\w,\s-]+\])?(?P<rest>.*)$")


def test_mypy_strict_is_clean() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary"],  # [tool.mypy]: strict, scheduler/
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, f"mypy found problems:\n{run.stdout}{run.stderr}"


def unexplained_ignores(lines: list[str]) -> list[int]:
    """Line numbers of ignores without a code, or without a reason (after it or just above)."""
    found = []
    for number, line in enumerate(lines, 1):
        match = IGNORE.search(line)
        if match is None:
            continue
        above = lines[number - 2].strip() if number > 1 else ""
        reason = match["rest"].strip().lstrip("#").strip() or above.startswith("#")
        if not match["code"] or not reason:
            found.append(number)
    return found


def test_every_ignore_names_its_code_and_reason() -> None:
    bad = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sorted((ROOT / "scheduler").rglob("*.py"))
        for number in unexplained_ignores(path.read_text().splitlines())
    ]
    assert not bad, "type: ignore without [code] and a reason: " + ", ".join(bad)


def test_an_unexplained_ignore_is_caught() -> None:
    lines = [
        "x = f()  # type: ignore",
        "y = g()  # type: ignore[attr-defined]",
        "z = h()  # type: ignore[attr-defined]  # the stubs lack it",
        "# the stubs lack it",
        "w = k()  # type: ignore[attr-defined]",
    ]
    assert unexplained_ignores(lines) == [1, 2]
