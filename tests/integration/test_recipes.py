"""The recipes of docs/in-your-application.md, served by real servers against PostgreSQL:
FastAPI under uvicorn with two workers, Flask under gunicorn with two workers (with and
without preload_app), Django under gunicorn with two workers. The code run is the page's
code blocks, as written there (and for Django, the smallest settings around them)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import psycopg
import pytest

from tests.support import ROOT, free_port, wait_for

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("flask")
pytest.importorskip("gunicorn")
pytest.importorskip("django")

PAGE = ROOT / "docs" / "in-your-application.md"
BLOCK = re.compile(r"```(?:python|yaml)\n# (\S+)\n(.*?)```", re.DOTALL)


def recipes(folder: Path) -> Path:
    """The page's files in `folder`, with a schedule of every second for the test."""
    for name, body in BLOCK.findall(PAGE.read_text()):
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
    (folder / "myapp" / "__init__.py").touch()
    (folder / "config.yaml").write_text("jobs:\n  send_digest:\n    interval: 1s\n")
    return folder


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except OSError:
        return 0, ""


def replicas_with_sessions(url: str) -> set[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT DISTINCT application_name FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchall()
    return {str(row[0]) for row in rows}


def succeeded(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        if conn.execute("SELECT to_regclass('scheduler_ticks')").fetchone() == (None,):
            return 0  # the active replica has not made the ledger yet
        row = conn.execute(
            "SELECT count(*) FROM scheduler_ticks"
            " WHERE job_name = 'send_digest' AND status = 'succeeded'"
        ).fetchone()
    assert row is not None
    return int(row[0])


def serve(command: list[str], folder: Path, database_url: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCHEDULER_")}
    env.update(
        SCHEDULER_DATABASE_URL=database_url,
        SCHEDULER_HOST_LOCK=str(folder / "host.lock"),
        PYTHONPATH=str(folder),
    )
    return subprocess.Popen(
        command, cwd=folder, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def check_the_recipe(server: subprocess.Popen[bytes], port: int, database_url: str) -> None:
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: get(f"{base}/scheduler/healthz")[0] == 200, 30, "the server")
        wait_for(lambda: succeeded(database_url) >= 2, 20, "ticks run by the active replica")
        # Two workers, one active replica: one replica's sessions, the standby has none.
        wait_for(lambda: len(replicas_with_sessions(database_url)) == 1, 10, "one session owner")
        assert get(f"{base}/")[0] == 200  # the application itself
        status, page = get(f"{base}/scheduler/")
        assert status == 200 and 'href="/scheduler/jobs/send_digest"' in page
        assert get(f"{base}/scheduler/api/status")[0] == 200
        assert get(f"{base}/scheduler/healthz")[1] in ("ok\n", "standby\n")
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(40)
    assert code == 0
    wait_for(lambda: not replicas_with_sessions(database_url), 10, "every session closed")


def test_fastapi_under_uvicorn_with_two_workers(tmp_path, database_url):
    folder, port = recipes(tmp_path), free_port()
    command = [sys.executable, "-m", "uvicorn", "myapp.main:app", "--workers", "2"]
    server = serve([*command, "--port", str(port)], folder, database_url)
    check_the_recipe(server, port, database_url)


@pytest.mark.parametrize("preload", [False, True], ids=["fork", "preload_app"])
def test_flask_under_gunicorn_with_two_workers(tmp_path, database_url, preload):
    folder, port = recipes(tmp_path), free_port()
    command = [sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", "-w", "2"]
    command += ["-b", f"127.0.0.1:{port}", *(["--preload"] if preload else [])]
    server = serve([*command, "myapp.web:create_app()"], folder, database_url)
    check_the_recipe(server, port, database_url)


DJANGO_SETTINGS = """
SECRET_KEY = "only-for-this-test"
DEBUG = False
ALLOWED_HOSTS = ["*"]
ROOT_URLCONF = "mysite.urls"
INSTALLED_APPS = ["myapp.apps.MyAppConfig"]
MIDDLEWARE = []
DATABASES = {}
"""

DJANGO_URLS = """
from django.http import HttpResponse
from django.urls import path

urlpatterns = [path("", lambda request: HttpResponse("hello"))]
"""


def test_django_under_gunicorn_with_two_workers(tmp_path, database_url):
    folder, port = recipes(tmp_path), free_port()
    (folder / "mysite" / "__init__.py").touch()
    (folder / "mysite" / "settings.py").write_text(DJANGO_SETTINGS)
    (folder / "mysite" / "urls.py").write_text(DJANGO_URLS)
    command = [sys.executable, "-m", "gunicorn", "-w", "2", "-b", f"127.0.0.1:{port}"]
    server = serve([*command, "mysite.wsgi"], folder, database_url)
    check_the_recipe(server, port, database_url)
