"""The record of every migration file and of postgres.sql, by hash (manifest.txt).

A migration file, once recorded, must not change (a ledger that applied it will not
apply it again), and postgres.sql must not change without a new migration (the number
is what keeps an older replica from installing its functions over newer ones). `check`
says what is wrong; `python -m scheduler.backends.migrations.manifest` records the
files after a new migration was added, and refuses what `check` would refuse.
"""

from __future__ import annotations

import sys
from pathlib import Path

from scheduler.backends.migrations import DIALECTS, folder, functions_sql, migrations, sha256

MANIFEST = Path(str(folder("postgresql"))).parent / "manifest.txt"
FUNCTIONS = "postgres.sql"
HEADER = (
    "# sha256 of each migration file, and of postgres.sql with the migration it came with.\n"
    "# Written by `python -m scheduler.backends.migrations.manifest`; never edit by hand.\n"
)


def current() -> dict[str, str]:
    """The hashes as the files are now; postgres.sql's entry names the latest migration."""
    found = {f"{d}/{m.name}": sha256(m.sql) for d in DIALECTS for m in migrations(d)}
    found[FUNCTIONS] = f"{sha256(functions_sql())} {len(migrations('postgresql')):04d}"
    return found


def recorded() -> dict[str, str]:
    lines = MANIFEST.read_text().splitlines() if MANIFEST.exists() else []
    pairs = (line.split(" ", 1) for line in lines if line and not line.startswith("#"))
    return {name: value for name, value in pairs}


def check() -> list[str]:
    """What disagrees with the manifest, each said with what to do about it."""
    now, then = current(), recorded()
    problems = [_changed(n) for n in sorted(then) if n != FUNCTIONS and now.get(n) != then[n]]
    numbers = {d: [m.version for m in migrations(d)] for d in DIALECTS}
    if len({tuple(found) for found in numbers.values()}) > 1:
        problems.append(f"the migration folders hold different numbers: {numbers}")
    functions_now, latest = now[FUNCTIONS].split(" ")
    functions_then, came_with = then.get(FUNCTIONS, "- 0").split(" ")
    unrecorded = [name for name in sorted(now) if name not in then]
    if functions_now != functions_then:
        if int(latest) == int(came_with):
            problems.append(_functions_changed(int(latest) + 1))
        else:
            unrecorded.append(FUNCTIONS)
    if unrecorded:
        problems.append(
            f"not recorded yet: {', '.join(unrecorded)}. Record them with"
            " `python -m scheduler.backends.migrations.manifest`."
        )
    return problems


def _changed(name: str) -> str:
    return (
        f"migration {name} differs from the one recorded (or is gone). A ledger that"
        " applied it will not apply it again: put it back as it was, and make the change"
        " in a new migration file."
    )


def _functions_changed(number: int) -> str:
    return (
        f"{FUNCTIONS} changed without a new migration. Add"
        f" scheduler/backends/migrations/postgresql/{number:04d}_<what>.sql and"
        f" scheduler/backends/migrations/sqlite/{number:04d}_<what>.sql (a comment saying"
        " what changed in the functions is enough when no table changes), then record"
        " them with `python -m scheduler.backends.migrations.manifest`."
    )


def record() -> list[str]:
    """Write the manifest, unless a recorded file changed or the functions need a number."""
    refused = [p for p in check() if not p.startswith("not recorded yet")]
    if not refused:
        body = "".join(f"{name} {value}\n" for name, value in sorted(current().items()))
        MANIFEST.write_text(HEADER + body)
    return refused


if __name__ == "__main__":
    said = record()
    print("\n".join(said) or f"recorded in {MANIFEST}")
    sys.exit(1 if said else 0)
