"""The deployment files: what can be checked on a machine without a Docker engine.

The image's install steps run here in a clean virtual environment, and its
HEALTHCHECK command runs against the replica installed there; the compose
file and the Kubernetes manifests are parsed and checked against the code
(their config.yaml validates against the jobs in the image).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import venv

import yaml

from tests.support import ROOT, free_port, wait_for

DOCKERFILE = (ROOT / "Dockerfile").read_text()


def instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_the_image_is_slim_non_root_and_checks_its_health():
    steps = instructions()
    assert steps[0][0] == "FROM" and re.fullmatch(r"python:3\.11-slim", steps[0][1])
    users = [rest for word, rest in steps if word == "USER"]
    assert users and users[-1] not in ("root", "0")
    health = next(rest for word, rest in steps if word == "HEALTHCHECK")
    assert "/healthz" in health
    assert json.loads(next(rest for word, rest in steps if word == "CMD")) == ["scheduler", "run"]
    copied = [rest.split()[-2] for word, rest in steps if word == "COPY"]
    assert "config.yaml" in copied and "jobs" in copied  # replaceable by mounts
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def test_the_images_install_steps_work_in_a_clean_environment(tmp_path):
    """Copy what the Dockerfile copies, install it as it does, run it, probe it as it does."""
    context = tmp_path / "app"
    context.mkdir()
    for word, rest in instructions():
        if word != "COPY":
            continue
        parts = [p for p in rest.split() if not p.startswith("--")]
        *sources, target = parts
        for source in sources:
            src = ROOT / source
            dest = context / source if target.endswith("/") else context / target
            if src.is_dir():
                shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(src, dest)
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    run_steps = [rest for word, rest in instructions() if word == "RUN"]
    assert any("pip install ." in step for step in run_steps)
    installed = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "."],
        cwd=context,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    scheduler = env_dir / "bin" / "scheduler"
    env = {
        "PATH": f"{env_dir / 'bin'}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "SCHEDULER_CONFIG": str(context / "config.yaml"),
    }
    check = subprocess.run(
        [str(scheduler), "check"], cwd=context, env=env, capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr

    port = free_port()
    replica = subprocess.Popen(
        [str(scheduler), "run"],
        cwd=context,
        env={**env, "SCHEDULER_HTTP_PORT": str(port), "SCHEDULER_LOG_FORMAT": "json"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        probe = json.loads(re.search(r"CMD (\[.*\])", _healthcheck()).group(1))
        probe = [p.replace("8080", str(port)) for p in probe]
        probe[0] = str(python)
        wait_for(
            lambda: subprocess.run(probe, capture_output=True).returncode == 0,
            30,
            "the HEALTHCHECK command to pass",
        )
        replica.send_signal(2)
        assert replica.wait(30) == 0
    finally:
        if replica.poll() is None:
            replica.kill()


def _healthcheck() -> str:
    return next(rest for word, rest in instructions() if word == "HEALTHCHECK")


def test_compose_runs_postgres_and_three_replicas():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert services["postgres"]["image"].startswith("postgres:")
    replicas = {name: s for name, s in services.items() if name.startswith("replica")}
    assert len(replicas) == 3
    names = set()
    for service in replicas.values():
        env = service["environment"]
        assert env["SCHEDULER_DATABASE_URL"].startswith("postgresql://")
        assert "@postgres:5432/" in env["SCHEDULER_DATABASE_URL"]
        names.add(env["SCHEDULER_INSTANCE_NAME"])
        assert service["build"] == "."
        assert service["depends_on"]["postgres"]["condition"] == "service_healthy"
        assert any(v.endswith(":/app/config.yaml:ro") for v in service["volumes"])
    assert len(names) == 3


def test_kubernetes_example(tmp_path):
    documents = list(yaml.safe_load_all((ROOT / "deploy" / "kubernetes.yaml").read_text()))
    deployment = next(d for d in documents if d["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] == 3
    pod = deployment["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > 30  # beyond shutdown_grace
    container = pod["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["SCHEDULER_DATABASE_URL"]["valueFrom"]["secretKeyRef"]["key"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    config_map = next(d for d in documents if d["kind"] == "ConfigMap")
    (tmp_path / "config.yaml").write_text(config_map["data"]["config.yaml"])
    check = subprocess.run(
        [
            sys.executable,
            "-m",
            "scheduler",
            "check",
            "--config",
            str(tmp_path / "config.yaml"),
            "--jobs",
            str(ROOT / "jobs"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("SCHEDULER_")},
    )
    assert check.returncode == 0, check.stdout + check.stderr
