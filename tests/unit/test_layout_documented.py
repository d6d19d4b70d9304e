"""The architecture page's Layout (docs/architecture.md) names every module and package of
the code, where it lives."""

from __future__ import annotations

import re

from tests.support import ROOT


def layout() -> dict[str, set[str]]:
    """Folder (relative to scheduler/) -> the names Layout lists under it."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    listed: dict[str, set[str]] = {}
    stack: list[tuple[int, str]] = []
    for line in block.splitlines():
        match = re.match(r"( *)(\S+)", line)
        if not match or not line.strip():
            continue
        depth, first = len(match.group(1)), match.group(2)
        stack = [(d, name) for d, name in stack if d < depth]
        if stack and stack[0][1] == "scheduler/":
            folder = "/".join(name.rstrip("/") for _, name in stack[1:])
            names = re.findall(r"\b[\w.]+\.(?:py|sql)\b|\b\w+/", line)
            listed.setdefault(folder, set()).update(n.rstrip("/") for n in names)
        if first.endswith("/"):
            stack.append((depth, first))
    return listed


def test_layout_names_every_module_and_package():
    listed = layout()
    code = ROOT / "scheduler"
    missing = []
    for path in sorted(code.rglob("*")):
        relative = path.relative_to(code)
        if "__pycache__" in relative.parts or any(
            p in ("static", "templates") for p in relative.parts[:-1]
        ):
            continue
        if relative.parts[:2] == ("backends", "migrations") and len(relative.parts) == 4:
            continue  # the numbered migration files: their folder is listed
        if path.is_dir() or path.suffix in (".py", ".sql"):
            if path.name in ("__init__.py", "__main__.py"):
                continue
            folder = str(relative.parent) if str(relative.parent) != "." else ""
            if path.name not in listed.get(folder, set()):
                missing.append(str(relative))
    assert missing == []
