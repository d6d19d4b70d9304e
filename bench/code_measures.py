"""What it costs to read a scheduler tree: its largest parts, and how many homes each rule has.

Usage: python bench/code_measures.py [TREE]   (default: this checkout)
"""

from __future__ import annotations

import ast
import re
import statistics
import subprocess
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
    literals = [
        f"{path.relative_to(root)}:{line}"
        for path in sorted(package.rglob("*.py"))
        if path.name != "statuses.py"
        for line in status_literals(ast.parse(path.read_text()))
    ]
    print("raw status literals in Python (statuses.py aside):", len(literals), literals[:8])
    walk = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("tick_walk.py")), str(root)],
        capture_output=True,
        text=True,
    )
    print("walk of one tick (Gate.submit to its finish recorded, PostgreSQL):", end=" ")
    print(walk.stdout.strip() or f"not measured: {walk.stderr.strip().splitlines()[-1:]}")


def status_literals(tree: ast.AST) -> list[int]:
    """Lines where a status is spelled as a string, beside the places a string names one
    by design: a JSON or dict key (`row["running"]`, `{"crashed": n}`, `facts.get(...)`),
    an enum's value, a docstring."""
    exempt: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            exempt.update(id(k) for k in node.keys if k is not None)
        elif isinstance(node, ast.Subscript):
            exempt.add(id(node.slice))
        elif (  # a key read with a default: facts.get("crashed")
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and node.args
        ):
            exempt.add(id(node.args[0]))
        elif isinstance(node, ast.ClassDef) and any(
            isinstance(b, ast.Name) and b.id.endswith("Enum") for b in node.bases
        ):
            exempt.update(id(n) for n in ast.walk(node))
        elif isinstance(node, ast.Expr):
            exempt.add(id(node.value))
        elif isinstance(node, ast.keyword) and node.arg is not None:
            pass
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in STATUSES and id(node) not in exempt
    ]


if __name__ == "__main__":
    if any(arg in ("-h", "--help") for arg in sys.argv[1:]):
        print(__doc__)
        raise SystemExit(0)
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent)
