"""docker/ is validated by parsing (no Docker engine runs here): the compose file wires the services the deployment
needs, each component reaches the registry as its own login (the owner's only in airflow-init), and the image
installs the repository's own pinned requirements and code."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import psycopg2.extensions
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
AIRFLOW = {"airflow-init", "airflow-apiserver", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer"}
SPARK = {"spark-master", "spark-worker"}
# Component -> the NOLOGIN role the migrations grant to (as in photon.airflow.hooks.COMPONENT_ROLES).
ROLES = {"joiner": "photon_joiner", "verifier": "photon_verifier", "gc": "photon_gc", "reshard": "photon_reshard"}


def init_sql() -> str:
    """docker/initdb/10-photon.sql without its comments."""
    return re.sub(r"--[^\n]*", "", (DOCKER / "initdb" / "10-photon.sql").read_text())


def logins() -> dict[str, tuple[str, str | None]]:
    """Role -> (password, the role it is IN) for every role the initdb script creates with LOGIN."""
    found = re.findall(r"CREATE ROLE (\w+) LOGIN PASSWORD '([^']*)'(?: IN ROLE (\w+))?;", init_sql())
    return {name: (password, member_of or None) for name, password, member_of in found}


def registry_credentials(env: dict[str, Any]) -> set[tuple[str, str]]:
    """(login, password) of every registry endpoint a service's environment holds: its photon_registry* connections
    and PHOTON_REGISTRY_DSN."""
    creds = set()
    for key, value in env.items():
        if key.startswith("AIRFLOW_CONN_PHOTON_REGISTRY"):
            conn = json.loads(value)
            creds.add((conn["login"], conn["password"]))
        elif key == "PHOTON_REGISTRY_DSN":
            dsn = psycopg2.extensions.parse_dsn(value)
            creds.add((dsn["user"], dsn["password"]))
    return creds


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "dangling line continuation"
    return out


def test_dockerfile_installs_the_pinned_lock_and_the_project() -> None:
    ins = instructions(DOCKER / "Dockerfile")
    known = {"FROM", "ENV", "RUN", "COPY", "USER", "WORKDIR", "ENTRYPOINT", "CMD", "ARG", "LABEL", "EXPOSE"}
    assert {i for i, _ in ins} <= known
    assert ins[0][0] == "FROM" and ins[0][1].startswith("python:3.11")
    copies = [shlex.split(a) for i, a in ins if i == "COPY"]
    sources = {c[-2] for c in copies}
    assert {"requirements.txt", "plugins", "dags", "spark", "sql"} <= sources
    assert all((ROOT / s).exists() for s in sources)
    runs = " ".join(a for i, a in ins if i == "RUN")
    assert "pip install --no-cache-dir -r /opt/photon/requirements.txt" in runs and "pip check" in runs
    assert "openjdk-17" in runs  # Spark needs Java
    for i, a in ins:
        if i in ("ENTRYPOINT", "CMD"):
            assert isinstance(json.loads(a), list)


def test_compose_wires_airflow_spark_and_postgres() -> None:
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == AIRFLOW | SPARK | {"postgres"}
    for name in AIRFLOW | SPARK:
        svc = services[name]
        assert svc["image"] == "photon-airflow:latest"
        assert svc["build"] == {"context": "..", "dockerfile": "docker/Dockerfile"}
        assert (DOCKER / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file()
        assert "data:/data" in svc["volumes"]
    for name in AIRFLOW:
        env = services[name]["environment"]
        spark = json.loads(env["AIRFLOW_CONN_SPARK_DEFAULT"])
        assert spark["host"] == "spark://spark-master" and spark["port"] == 7077
        assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("postgresql+psycopg2://airflow:airflow@postgres")
    commands = {name: services[name]["command"] for name in AIRFLOW | SPARK}
    assert commands["airflow-apiserver"] == ["airflow", "api-server"]
    assert commands["airflow-dag-processor"] == ["airflow", "dag-processor"]
    assert "photon registry init" in commands["airflow-init"][-1]
    assert "spark://spark-master:7077" in commands["spark-worker"]
    pg = services["postgres"]
    assert pg["image"].startswith("postgres:") and "healthcheck" in pg
    assert "CREATE DATABASE photon OWNER photon" in init_sql()


def test_every_component_connects_as_its_own_login_and_only_airflow_init_as_the_owner() -> None:
    services = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]
    sql = init_sql()
    created = logins()
    owner = ("photon", created["photon"][0])
    # The NOLOGIN roles exist before the migrations run: airflow-init runs them as the owner, who may not create roles.
    for role in ROLES.values():
        assert re.search(rf"CREATE ROLE {role} NOLOGIN;", sql), role
        assert sql.index(f"CREATE ROLE {role} NOLOGIN") < sql.index(f"IN ROLE {role};"), role
    for name in AIRFLOW:
        env = services[name]["environment"]
        assert "AIRFLOW_CONN_PHOTON_REGISTRY" not in env, name  # no fallback to a login with more rights
        for component, role in ROLES.items():
            conn = json.loads(env[f"AIRFLOW_CONN_PHOTON_REGISTRY_{component.upper()}"])
            assert conn["conn_type"] == "postgres" and conn["host"] == "postgres" and conn["schema"] == "photon"
            password, member_of = created[conn["login"]]
            assert member_of == role and conn["password"] == password, (name, component)
        creds = registry_credentials(env)
        assert (owner in creds) == (name == "airflow-init"), name
    init = services["airflow-init"]["environment"]
    assert registry_credentials({"PHOTON_REGISTRY_DSN": init["PHOTON_REGISTRY_DSN"]}) == {owner}
    for name in SPARK:  # executors get the DSNs from the driver; the workers hold no registry credentials
        assert not registry_credentials(services[name].get("environment") or {}), name
    # Each component login holds exactly one component role, and no two components share a login.
    component_logins = {login for login, (_, member_of) in created.items() if member_of in ROLES.values()}
    assert len(component_logins) == len(ROLES)
