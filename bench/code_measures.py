"""What it costs to read a scheduler tree: its largest parts, and how many homes each rule has.

Usage: python bench/code_measures.py [TREE]   (default: this checkout)
"""

from __future__ import annotations

import ast
import re
import statistics
import sys
from pathlib import Path

STATUSES = ("running", "succeeded", "failed", "skipped", "crashed", "missed", "interrupted")
BRANCHES = (ast.If, ast.For, ast.While, ast.Try, ast.With, ast.IfExp, ast.BoolOp, ast.Match)
RULES = {
    "crash messages": r"lost its lock before|died (?:while|before) the run|replica died or lost",
    "pg_locks filters": r"FROM pg_locks",
    "share hash constant": r"2654435761",
}


def lines(node: ast.AST) -> int:
    return (node.end_lineno or node.lineno) - node.lineno + 1  # type: ignore[attr-defined]


def main(root: Path) -> None:
    package = root / "scheduler"
    classes: list[tuple[int, str]] = []
    functions: list[tuple[int, int, str]] = []
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(root)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                classes.append((lines(node), f"{where}:{node.name}"))
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                branches = sum(isinstance(n, BRANCHES) for n in ast.walk(node))
                functions.append((lines(node), branches, f"{where}:{node.name}"))
    classes.sort(reverse=True)
    functions.sort(reverse=True)
    print("largest classes:", classes[:3])
    print("largest functions:", [(n, name) for n, _, name in functions[:3]])
    print("median function lines:", statistics.median(n for n, _, _ in functions))
    print("most branches in one function:", max(b for _, b, _ in functions))
    sql = []
    for path in package.rglob("*.sql"):
        pattern = r"CREATE (?:OR REPLACE )?FUNCTION (\w+)\(.*?\$\$;"
        for match in re.finditer(pattern, path.read_text(), re.S):
            sql.append((match.group(0).count("\n") + 1, match.group(1)))
    sql.sort(reverse=True)
    print("SQL functions:", len(sql), "longest:", sql[:3])
    texts = {p: p.read_text() for p in [*package.rglob("*.py"), *package.rglob("*.sql")]}
    for rule, pattern in RULES.items():
        print(f"{rule}:", sum(len(re.findall(pattern, t)) for t in texts.values()))
    literal = "[\"'](?:" + "|".join(STATUSES) + ")[\"']"
    raw = sum(
        len(re.findall(literal, text))
        for path, text in texts.items()
        if path.suffix == ".py" and path.name != "statuses.py"
    )
    print("raw status literals in Python (statuses.py aside):", raw)


if __name__ == "__main__":
    if any(arg in ("-h", "--help") for arg in sys.argv[1:]):
        print(__doc__)
        raise SystemExit(0)
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent)
