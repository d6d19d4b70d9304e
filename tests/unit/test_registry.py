"""Discovery of job modules: every @job call counts, and the jobs folder exposes only helpers."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from scheduler.errors import ConfigError
from scheduler.registry.jobs import discover

LOOP_JOBS = """
from scheduler import job

REGIONS = ["eu", "us", "ap"]


def make_sync(region):
    def sync(ctx):
        return region

    return sync


for number, region in enumerate(REGIONS):
    job(key=100 + number, name=f"sync_{region}")(make_sync(region))

job(key=200, name="unbound")(lambda: None)
"""


def jobs_folder(tmp_path: Path, files: dict[str, str]) -> Path:
    folder = tmp_path / "jobs"
    for name, text in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return folder


def test_jobs_made_in_a_loop_are_all_registered(tmp_path):
    registry = discover(jobs_folder(tmp_path, {"regions.py": LOOP_JOBS}))
    assert sorted(registry.jobs) == ["sync_ap", "sync_eu", "sync_us", "unbound"]
    assert [registry.jobs[f"sync_{r}"].key for r in ("eu", "us", "ap")] == [100, 101, 102]
    assert registry.jobs["sync_us"].func(None) == "us"


def test_discovering_a_folder_again_registers_each_job_once(tmp_path):
    folder = jobs_folder(tmp_path, {"regions.py": LOOP_JOBS})
    first = discover(folder)
    second = discover(folder)
    assert second.jobs == first.jobs
    assert all(second.jobs[name] is first.jobs[name] for name in first.jobs)


def test_jobs_made_in_a_loop_still_collide_naming_both(tmp_path):
    text = LOOP_JOBS.replace("key=100 + number", "key=100")
    with pytest.raises(ConfigError) as raised:
        discover(jobs_folder(tmp_path, {"regions.py": text}))
    message = str(raised.value)
    assert "job key 100 is used twice" in message
    assert "'sync_eu'" in message and "'sync_us'" in message and "regions.py" in message


def test_helpers_import_by_plain_name_and_job_modules_do_not(tmp_path):
    tag = uuid.uuid4().hex[:8]
    helper, package, plain = f"_db_{tag}", f"_pkg_{tag}", f"plain_{tag}"
    folder = jobs_folder(
        tmp_path,
        {
            f"{helper}.py": "engine = 'the engine'\n",
            f"{package}/__init__.py": "",
            f"{package}/util.py": "def double(x):\n    return 2 * x\n",
            f"{plain}.py": f"""
                from scheduler import job
                from {helper} import engine
                from {package}.util import double

                @job(key=7)
                def uses_helpers():
                    return engine, double(21)
            """,
        },
    )
    try:
        registry = discover(folder)
        assert registry.jobs["uses_helpers"].func() == ("the engine", 42)
        assert importlib.util.find_spec(plain) is None, "a job module is importable by name"
        assert str(folder.resolve()) not in sys.path
    finally:
        for name in [helper, package, f"{package}.util"]:
            sys.modules.pop(name, None)


def test_a_library_never_imports_a_job_module_named_like_its_own(tmp_path):
    """psycopg tries `import psycopg_c`; a job file of that name must not answer."""
    marker = tmp_path / "imported-by-plain-name"
    jobs_folder(
        tmp_path,
        {
            "psycopg_c.py": f"""
                from scheduler import job

                if __name__ == "psycopg_c":
                    open({str(marker)!r}, "w").close()

                @job(key=9)
                def named_like_a_library():
                    pass
            """
        },
    )
    (tmp_path / "config.yaml").write_text("jobs: {}\n")
    result = subprocess.run(
        [sys.executable, "-m", "scheduler", "check", "--config", str(tmp_path / "config.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "SCHEDULER_DATABASE_URL": "postgresql://u@127.0.0.1:1/db"},
    )
    assert "named_like_a_library (key 9)" in result.stdout, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert not marker.exists(), "psycopg imported the job module psycopg_c.py"


WHERE_JOBS = """
import functools

from scheduler import job


def logged(func):
    @functools.wraps(func)
    def wrapper(ctx):
        return func(ctx)

    return wrapper


@job(key=300)
@logged
def wrapped(ctx):
    pass


job(key=301, name="partial")(functools.partial(print, "x"))
"""


def test_a_job_is_placed_at_its_definition_however_decorated(tmp_path, monkeypatch):
    """The source a message names is the line the definition starts on (its first
    decorator), read off the code object for a plain or wrapped function, and by
    inspect for a callable with none."""
    monkeypatch.chdir(tmp_path)
    specs = discover(jobs_folder(tmp_path, {"placed.py": WHERE_JOBS})).jobs
    lines = WHERE_JOBS.splitlines()
    assert specs["wrapped"].source == f"jobs/placed.py:{lines.index('@job(key=300)') + 1}"
    assert specs["partial"].source == "functools"
