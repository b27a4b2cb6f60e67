"""docker/ is validated by parsing (no Docker engine runs here): the compose file wires the services the deployment
needs, and the image installs the repository's own pinned requirements and code."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
AIRFLOW = {"airflow-init", "airflow-apiserver", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer"}
SPARK = {"spark-master", "spark-worker"}


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
        env = svc["environment"]
        registry = json.loads(env["AIRFLOW_CONN_PHOTON_REGISTRY"])
        assert registry["conn_type"] == "postgres" and registry["host"] == "postgres"
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
    init_sql = (DOCKER / "initdb" / "10-photon.sql").read_text()
    assert "CREATE DATABASE photon" in init_sql and registry["schema"] == "photon"
