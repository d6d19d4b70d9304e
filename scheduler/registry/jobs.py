"""The job registry: the `@job` decorator and discovery of job modules.

A leaf module: it knows nothing of schedules or databases. Discovery imports
every ``*.py`` under the jobs folder (names starting with ``_`` are helpers,
not job modules) and collects every job the import registers: each `@job`
call made while a job module runs is recorded, whether or not its function
ends up bound to a module-level name (jobs made in a loop, by a factory).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import re
import reprlib
import sys
import traceback
from collections.abc import Callable, Iterable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from scheduler.errors import ConfigError, shorten

MAX_KEY = 2_147_483_647
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]+$")

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
    """Where a job is defined, as messages name it.

    Read off the function's code object: reading its source instead (inspect) took a
    quarter of the start of a replica with 1,000 jobs. The line is the same: the
    first line of the definition, decorators included.
    """
    try:
        code = getattr(inspect.unwrap(func), "__code__", None)
    except ValueError:  # a cycle of __wrapped__
        code = None
    if code is not None:
        return f"{_short(code.co_filename)}:{code.co_firstlineno}"
    try:
        file = inspect.getsourcefile(func) or "?"
        line = inspect.getsourcelines(func)[1]
    except (OSError, TypeError):
        return getattr(func, "__module__", "?")
    return f"{_short(file)}:{line}"


def _short(path: str) -> str:
    return _relative(path, str(Path.cwd()))


@functools.lru_cache(maxsize=256)
def _relative(path: str, cwd: str) -> str:
    """`path` from `cwd` if it is under it: once per file, not once per job."""
    try:
        return str(Path(path).resolve().relative_to(cwd))
    except ValueError:
        return path


def _shown(value: object) -> str:
    """A value as a message repeats it, however large."""
    if isinstance(value, int) and abs(value) >= 10**30:
        return "a number of more than 30 digits"
    return shorten(reprlib.repr(value))


def job(key: int, name: str | None = None) -> Callable[[F], F]:
    """Register a function as a fleet job with a stable numeric lock key.

    The key, not the name, identifies the job's lock in PostgreSQL, so it must
    never change once the job is deployed; the name is what ``config.yaml``
    refers to.
    """
    if callable(key) and name is None:
        raise ConfigError(
            f"{_where(key)}: job {_shown(getattr(key, '__name__', key))}: "
            "a bare @job registers nothing: use @job(key=...) with the job's number"
        )

    def mark(func: F) -> F:
        where = _where(func)
        label = f"{where}: job {_shown(getattr(func, '__name__', func))}"
        if isinstance(key, bool) or not isinstance(key, int):
            raise ConfigError(f"{label}: key must be a whole number, got {_shown(key)}")
        if not 1 <= key <= MAX_KEY:
            raise ConfigError(f"{label}: key must be between 1 and {MAX_KEY}, got {_shown(key)}")
        job_name = func.__name__ if name is None else name
        if not isinstance(job_name, str) or not NAME_PATTERN.fullmatch(job_name):
            raise ConfigError(
                f"{label}: name may only contain letters, digits, '_', '-' and '.', "
                f"got {_shown(job_name)}"
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
        collector = _collector.get()
        if collector is not None:
            collector.append(spec)
        _by_module.setdefault(getattr(func, "__module__", "") or "", []).append(spec)
        return func

    return mark


# The jobs registered while a job module is being imported (see `_import`).
_collector: ContextVar[list[JobSpec] | None] = ContextVar("scheduler_jobs", default=None)
# Every job registered, by its function's module: a module named in `modules` may have
# been imported by the application before the replica looks for its jobs.
_by_module: dict[str, list[JobSpec]] = {}


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
    """Job modules in a stable order; `_`-prefixed files and folders are helpers.

    A symbolic link to a file outside the jobs folder is refused: what runs in
    the fleet is what the jobs folder holds.
    """
    root = jobs_path.resolve()
    files = []
    for path in sorted(jobs_path.rglob("*.py")):
        parts = path.relative_to(jobs_path).parts
        if any(part.startswith(("_", ".")) for part in parts):
            continue
        target = path.resolve()
        if not target.is_relative_to(root):
            raise ConfigError(
                f"{path}: a symbolic link to {target}, outside the jobs folder {jobs_path}: "
                "job modules must be files in the jobs folder"
            )
        files.append(path)
    return files


class _HelperFinder(importlib.abc.MetaPathFinder):
    """Finds the jobs folder's `_`-prefixed top-level modules and packages by plain name.

    Only those: were the folder on ``sys.path``, a job module named like a
    library's optional module (``jobs/psycopg_c.py``) would be imported by
    that library. It is the last finder, so it never shadows an installed
    module either.
    """

    def __init__(self) -> None:
        self.folders: list[str] = []

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if path is not None or not fullname.startswith("_") or not self.folders:
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, self.folders)


_helpers = _HelperFinder()

# The jobs each imported job module registered, by module name: a module is
# imported once per process, and discovering it again gives the same jobs.
_registered: dict[str, tuple[JobSpec, ...]] = {}


def discover(jobs_path: Path) -> Registry:
    """Import every job module under `jobs_path` and collect the jobs it registers.

    Modules are loaded under a private package name so that a user's
    ``jobs/email.py`` can never shadow the standard library; `_`-prefixed
    modules of the folder are importable by plain name (``from _db import
    engine``), and nothing else of it.
    """
    if not jobs_path.is_dir():
        raise ConfigError(f"{jobs_path}: jobs folder not found")
    folder = str(jobs_path.resolve())
    if folder not in _helpers.folders:
        _helpers.folders.append(folder)
    if _helpers not in sys.meta_path:
        sys.meta_path.append(_helpers)
    specs: list[JobSpec] = []
    for path in job_files(jobs_path):
        specs.extend(_import(path, jobs_path))
    return build_registry(specs)


def _import(path: Path, root: Path) -> tuple[JobSpec, ...]:
    """Import one job module (once per process); the jobs it registered."""
    relative = path.relative_to(root).with_suffix("")
    folder = hashlib.sha1(str(root.resolve()).encode()).hexdigest()[:8]
    module_name = f"scheduler_jobs_{folder}." + ".".join(relative.parts)
    if module_name in sys.modules and module_name in _registered:
        return _registered[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{path}: cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    collected: list[JobSpec] = []
    token = _collector.set(collected)
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
    finally:
        _collector.reset(token)
    _registered[module_name] = tuple(collected)
    return _registered[module_name]


def _describe(exc: BaseException, path: Path) -> str:
    """The exception and the line of the job module where it arose."""
    if isinstance(exc, SyntaxError):
        return f"SyntaxError at line {exc.lineno}: {exc.msg}"
    line = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if Path(frame.filename).resolve() == path.resolve():
            line = frame.lineno
    where = f" (line {line})" if line else ""
    return f"{type(exc).__name__}: {shorten(str(exc))}{where}"


def import_modules(names: Sequence[str]) -> list[JobSpec]:
    """The jobs of the modules named in the `modules` setting, importing those not yet imported.

    An application may have imported its job module before the replica
    starts: its jobs were registered then, and are found by their functions'
    module (the module or a module under it).
    """
    specs: list[JobSpec] = []
    for name in names:
        specs.extend(_import_named(name))
    return specs


def _import_named(name: str) -> tuple[JobSpec, ...]:
    if name in _registered:
        return _registered[name]
    if name in sys.modules:
        return _registered.setdefault(name, _registered_under(name))
    collected: list[JobSpec] = []
    token = _collector.set(collected)
    try:
        importlib.import_module(name)
    except ConfigError as exc:
        raise ConfigError(str(exc)) from None
    except ModuleNotFoundError as exc:
        if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
            raise ConfigError(
                f"modules: {_shown(name)}: no such module (is it installed, or on sys.path?)"
            ) from None
        raise ConfigError(
            f"modules: {_shown(name)}: failed to import: {_named_error(exc)}"
        ) from None
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        raise ConfigError(
            f"modules: {_shown(name)}: failed to import: {_named_error(exc)}"
        ) from None
    finally:
        _collector.reset(token)
    return _registered.setdefault(name, tuple(collected) or _registered_under(name))


def _registered_under(name: str) -> tuple[JobSpec, ...]:
    return tuple(
        spec
        for module, specs in _by_module.items()
        if module == name or module.startswith(name + ".")
        for spec in specs
    )


def _named_error(exc: BaseException) -> str:
    if isinstance(exc, SyntaxError):
        return f"SyntaxError in {exc.filename} at line {exc.lineno}: {exc.msg}"
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({_short(frames[-1].filename)}, line {frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {shorten(str(exc))}{where}"
