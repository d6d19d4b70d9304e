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
import shlex
import shutil
import subprocess
import sys
import venv
from pathlib import Path

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


def test_the_images_install_steps_work_in_a_clean_environment(tmp_path, database_url):
    """Copy what the Dockerfile copies, install it as it does, run it, probe it as it does;
    the replica's resident memory is what the Kubernetes example requests."""
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
    deployed = {"SCHEDULER_DATABASE_URL": database_url, "SCHEDULER_INSTANCE_NAME": "pod-1"}
    replica = subprocess.Popen(
        [str(scheduler), "run"],
        cwd=context,
        env={**env, **deployed, "SCHEDULER_HTTP_PORT": str(port), "SCHEDULER_LOG_FORMAT": "json"},
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
        wait_for(lambda: replica_ran(database_url) >= 2, 30, "the example jobs to run")
        resident = resident_bytes(replica.pid)
        replica.send_signal(2)
        assert replica.wait(30) == 0
    finally:
        if replica.poll() is None:
            replica.kill()
    # The request matches what a replica holds: neither below it nor far above.
    assert resident <= memory_request() <= 1.5 * resident, (resident, memory_request())


def replica_ran(database_url: str) -> int:
    import psycopg

    with psycopg.connect(database_url) as conn:
        query = "SELECT count(*) FROM scheduler_ticks WHERE status = 'succeeded'"
        try:
            return int(conn.execute(query).fetchone()[0])
        except psycopg.errors.UndefinedTable:  # not migrated yet
            return 0


def resident_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024


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
        # A replica that dies comes back (under the same name).
        assert service["restart"] in ("always", "unless-stopped", "on-failure")
    assert len(names) == 3


def test_the_compose_commands_the_docs_give_name_services_that_exist():
    services = set(yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"])
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    text = "\n".join(page.read_text() for page in pages)
    commands = re.findall(r"docker compose [^`\n#]+", text)
    assert len(commands) >= 3
    named = set()
    for command in commands:
        verb, *rest = shlex.split(command)[2:]
        words = [w for i, w in enumerate(rest) if not w.startswith("-") and rest[i - 1] != "-s"]
        if verb == "exec":
            words = words[:1]
        elif verb not in ("kill", "restart", "stop", "start", "logs"):
            continue
        assert words and set(words) <= services, command
        named.update(words)
    assert named  # the docs name some


def manifests() -> list[dict]:
    return list(yaml.safe_load_all((ROOT / "deploy" / "kubernetes.yaml").read_text()))


def test_kubernetes_reloads_its_config_map_and_runs_locked_down():
    documents = manifests()
    deployment = next(d for d in documents if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    # The ConfigMap is mounted as a folder (a subPath mount is never updated), and read
    # from there; the replicas watch it.
    (volume,) = [v for v in pod["volumes"] if "configMap" in v]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert "subPath" not in mount and mount.get("readOnly")
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["SCHEDULER_CONFIG"] == mount["mountPath"] + "/config.yaml"
    config_map = next(d for d in documents if d["kind"] == "ConfigMap")
    config = yaml.safe_load(config_map["data"]["config.yaml"])
    assert config["scheduler"]["reload"] == "watch"
    # One replica at a time may be evicted.
    budget = next(d for d in documents if d["kind"] == "PodDisruptionBudget")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert budget["spec"].get("maxUnavailable") == 1 or (
        0 < budget["spec"]["minAvailable"] < deployment["spec"]["replicas"]
    )
    # Locked down.
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    hardened = container["securityContext"]
    assert hardened["allowPrivilegeEscalation"] is False
    assert hardened["readOnlyRootFilesystem"] is True
    assert hardened["capabilities"]["drop"] == ["ALL"]
    writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
    assert "/tmp" in writable


def memory_request() -> int:
    """The Deployment's memory request, in bytes."""
    deployment = next(d for d in manifests() if d["kind"] == "Deployment")
    text = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]
    number, unit = re.fullmatch(r"(\d+)(Mi|M|Gi)", text["memory"]).groups()
    return int(number) * {"Mi": 2**20, "M": 10**6, "Gi": 2**30}[unit]


def test_kubernetes_example(tmp_path):
    documents = manifests()
    deployment = next(d for d in documents if d["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] == 3
    pod = deployment["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > 30  # beyond shutdown_grace
    container = pod["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["SCHEDULER_DATABASE_URL"]["valueFrom"]["secretKeyRef"]["key"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # The files where the pod has them (the image's /app, the ConfigMap's mount), found
    # through the manifest's own environment.
    config_map = next(d for d in documents if d["kind"] == "ConfigMap")
    app = tmp_path / "app"
    values = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    config = app / values["SCHEDULER_CONFIG"].removeprefix("/app/")
    config.parent.mkdir(parents=True)
    config.write_text(config_map["data"]["config.yaml"])
    shutil.copytree(ROOT / "jobs", app / values["SCHEDULER_JOBS_PATH"].removeprefix("/app/"))
    paths = {name: str(app / values[name].removeprefix("/app/")) for name in values}
    check = subprocess.run(
        [sys.executable, "-m", "scheduler", "check"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("SCHEDULER_")},
            "SCHEDULER_CONFIG": paths["SCHEDULER_CONFIG"],
            "SCHEDULER_JOBS_PATH": paths["SCHEDULER_JOBS_PATH"],
        },
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert "3 job(s), 3 scheduled" in check.stdout
