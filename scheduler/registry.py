"""The job registry: the `@job` decorator and discovery of job modules.

A leaf module: it knows nothing of schedules or databases. Discovery imports
every ``*.py`` under the jobs folder (names starting with ``_`` are helpers,
not job modules) and collects the decorated functions.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import re
import sys
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from scheduler.errors import ConfigError

MAX_KEY = 2_147_483_647
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]+$")
_MARK = "__scheduler_job__"

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class JobSpec:
    """One registered job: what the gate needs to know to run it."""

    key: int
    name: str
    func: Callable[..., Any] = field(compare=False, repr=False)
    takes_context: bool
    is_async: bool
    source: str  # "file:line" where the function is defined


def _where(func: Callable[..., Any]) -> str:
    try:
        file = inspect.getsourcefile(func) or "?"
        line = inspect.getsourcelines(func)[1]
    except (OSError, TypeError):
        return getattr(func, "__module__", "?")
    return f"{_short(file)}:{line}"


def _short(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return path


def job(key: int, name: str | None = None) -> Callable[[F], F]:
    """Register a function as a fleet job with a stable numeric lock key.

    The key, not the name, identifies the job's lock in PostgreSQL, so it must
    never change once the job is deployed; the name is what ``config.yaml``
    refers to.
    """

    def mark(func: F) -> F:
        where = _where(func)
        label = f"{where}: job {func.__name__!r}"
        if isinstance(key, bool) or not isinstance(key, int):
            raise ConfigError(f"{label}: key must be a whole number, got {key!r}")
        if not 1 <= key <= MAX_KEY:
            raise ConfigError(f"{label}: key must be between 1 and {MAX_KEY}, got {key}")
        job_name = func.__name__ if name is None else name
        if not isinstance(job_name, str) or not NAME_PATTERN.fullmatch(job_name):
            raise ConfigError(
                f"{label}: name may only contain letters, digits, '_', '-' and '.', "
                f"got {job_name!r}"
            )
        params = [
            p
            for p in inspect.signature(func).parameters.values()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.default is p.empty
        ]
        if len(params) > 1:
            raise ConfigError(
                f"{label}: a job takes no argument or one (the run context), "
                f"got {len(params)}: {', '.join(p.name for p in params)}"
            )
        accepts_any = any(
            p.kind is p.VAR_POSITIONAL for p in inspect.signature(func).parameters.values()
        )
        spec = JobSpec(
            key=key,
            name=job_name,
            func=func,
            takes_context=bool(params) or accepts_any,
            is_async=inspect.iscoroutinefunction(func),
            source=where,
        )
        setattr(func, _MARK, spec)
        return func

    return mark


@dataclass(frozen=True)
class Registry:
    """Every job found under the jobs path, by name."""

    jobs: dict[str, JobSpec]


def build_registry(specs: Iterable[JobSpec]) -> Registry:
    """Validate uniqueness of keys and names; a collision names both jobs."""
    by_name: dict[str, JobSpec] = {}
    by_key: dict[int, JobSpec] = {}
    for spec in specs:
        if spec.name in by_name and by_name[spec.name] is not spec:
            other = by_name[spec.name]
            raise ConfigError(
                f"job name {spec.name!r} is used twice: {other.func.__name__} ({other.source}) "
                f"and {spec.func.__name__} ({spec.source})"
            )
        if spec.key in by_key and by_key[spec.key] is not spec:
            other = by_key[spec.key]
            raise ConfigError(
                f"job key {spec.key} is used twice: {other.name!r} ({other.source}) "
                f"and {spec.name!r} ({spec.source})"
            )
        by_name[spec.name] = spec
        by_key[spec.key] = spec
    return Registry(jobs=by_name)


def job_files(jobs_path: Path) -> list[Path]:
    """Job modules in a stable order; `_`-prefixed files and folders are helpers."""
    files = []
    for path in sorted(jobs_path.rglob("*.py")):
        parts = path.relative_to(jobs_path).parts
        if any(part.startswith(("_", ".")) for part in parts):
            continue
        files.append(path)
    return files


def discover(jobs_path: Path) -> Registry:
    """Import every job module under `jobs_path` and collect its jobs.

    Modules are loaded under a private package name so that a user's
    ``jobs/email.py`` can never shadow the standard library; the folder is
    appended to ``sys.path`` so jobs can import their ``_helpers``.
    """
    if not jobs_path.is_dir():
        raise ConfigError(f"{jobs_path}: jobs folder not found")
    folder = str(jobs_path.resolve())
    if folder not in sys.path:
        sys.path.append(folder)
    specs: list[JobSpec] = []
    for path in job_files(jobs_path):
        module = _import(path, jobs_path)
        for value in vars(module).values():
            spec = getattr(value, _MARK, None)
            if isinstance(spec, JobSpec) and spec not in specs:
                specs.append(spec)
    return build_registry(specs)


def _import(path: Path, root: Path) -> Any:
    relative = path.relative_to(root).with_suffix("")
    folder = hashlib.sha1(str(root.resolve()).encode()).hexdigest()[:8]
    module_name = f"scheduler_jobs_{folder}." + ".".join(relative.parts)
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{path}: cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except ConfigError as exc:
        del sys.modules[module_name]
        raise ConfigError(str(exc)) from None
    except BaseException as exc:
        del sys.modules[module_name]
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        raise ConfigError(f"{path}: failed to import: {_describe(exc, path)}") from None
    return module


def _describe(exc: BaseException, path: Path) -> str:
    """The exception and the line of the job module where it arose."""
    if isinstance(exc, SyntaxError):
        return f"SyntaxError at line {exc.lineno}: {exc.msg}"
    line = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if Path(frame.filename).resolve() == path.resolve():
            line = frame.lineno
    where = f" (line {line})" if line else ""
    return f"{type(exc).__name__}: {exc}{where}"
