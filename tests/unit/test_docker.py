"""docker/ is validated by parsing (no Docker engine runs here): the compose file wires the services the deployment
needs, each component reaches the registry as its own login (the owner's only in airflow-init), the registry is a
Patroni cluster with quorum commit (the local cluster's settings) reached on a multi-host DSN that finds the primary,
and the images install the repository's own pinned requirements and code."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psycopg2.extensions
import yaml

from photon.registry.cluster import LocalCluster

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
AIRFLOW = {"airflow-init", "airflow-apiserver", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer"}
SPARK = {"spark-master", "spark-worker"}
# Component -> the NOLOGIN role the migrations grant to (as in photon.airflow.hooks.COMPONENT_ROLES).
ROLES = {"joiner": "photon_joiner", "verifier": "photon_verifier", "gc": "photon_gc", "reshard": "photon_reshard"}
REGISTRY = ("registry-1", "registry-2", "registry-3")
REGISTRY_HOSTS = ",".join(REGISTRY)


def compose() -> dict[str, Any]:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())  # type: ignore[no-any-return]


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
    services = compose()["services"]
    assert set(services) == AIRFLOW | SPARK | {"airflow-db", "etcd", "seaweedfs", *REGISTRY}
    for name in AIRFLOW | SPARK | {"seaweedfs"}:
        svc = services[name]
        assert svc["image"] == "photon-airflow:latest"
        assert svc["build"] == {"context": "..", "dockerfile": "docker/Dockerfile"}
        assert (DOCKER / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file()
    for name in AIRFLOW:
        assert services[name]["volumes"] == ["data:/data"]
    for name in AIRFLOW:
        env = services[name]["environment"]
        spark = json.loads(env["AIRFLOW_CONN_SPARK_DEFAULT"])
        assert spark["host"] == "spark://spark-master" and spark["port"] == 7077
        assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith(
            "postgresql+psycopg2://airflow:airflow@airflow-db:"
        )
    commands = {name: services[name]["command"] for name in AIRFLOW | SPARK}
    assert commands["airflow-apiserver"] == ["airflow", "api-server"]
    assert commands["airflow-dag-processor"] == ["airflow", "dag-processor"]
    assert "photon registry init" in commands["airflow-init"][-1]
    assert "spark://spark-master:7077" in commands["spark-worker"]
    airflow_db = services["airflow-db"]  # Airflow's metadata only: the registry is the cluster's
    assert airflow_db["image"].startswith("postgres:") and "healthcheck" in airflow_db
    assert "docker-entrypoint-initdb.d" not in json.dumps(airflow_db)
    assert "CREATE DATABASE photon OWNER photon" in init_sql()


def test_every_component_connects_as_its_own_login_and_only_airflow_init_as_the_owner() -> None:
    services = compose()["services"]
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
            assert conn["conn_type"] == "postgres" and conn["host"] == REGISTRY_HOSTS and conn["schema"] == "photon"
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


def patroni_config() -> dict[str, Any]:
    return yaml.safe_load((DOCKER / "patroni" / "patroni.yml").read_text())  # type: ignore[no-any-return]


def local_cluster_config(tmp_path: Path) -> dict[str, Any]:
    """The Patroni configuration `photon registry cluster up` writes for its first node (nothing started)."""
    cluster = LocalCluster(tmp_path)
    cluster.state = {
        "etcd": {"client": 2379, "peer": 2380},
        "nodes": {"node1": {"pg": 5432, "api": 8008}},
        "superuser_password": "x",
        "replication_password": "y",
        "bin_dir": "/usr/lib/postgresql/16/bin",
    }
    cluster._write_patroni_config("node1")
    return yaml.safe_load((tmp_path / "node1" / "patroni.yml").read_text())  # type: ignore[no-any-return]


def healthy_before(services: dict[str, Any], name: str) -> set[str]:
    """The services found healthy (or finished) before ``name`` starts, through its depends_on chain."""
    deps = services[name].get("depends_on") or {}
    if isinstance(deps, list):  # the short form: started, not healthy
        deps = {dep: {"condition": "service_started"} for dep in deps}
    found: set[str] = set()
    for dep, how in deps.items():
        if how.get("condition") in ("service_healthy", "service_completed_successfully"):
            found.add(dep)
        found |= healthy_before(services, dep)
    return found


def test_the_registry_is_three_patroni_nodes_with_quorum_commit_on_one_etcd(tmp_path: Path) -> None:
    services = compose()["services"]
    etcd = services["etcd"]
    assert etcd["image"].startswith("gcr.io/etcd-development/etcd:v3.")  # the etcd project's own image
    flags = dict(a.removeprefix("--").split("=", 1) for a in etcd["command"][1:])
    assert flags["initial-cluster"] == "etcd=http://etcd:2380"  # one member: compose's containers share one host
    assert flags["advertise-client-urls"] == "http://etcd:2379"
    for name in REGISTRY:
        node = services[name]
        assert node["build"] == {"context": "..", "dockerfile": "docker/patroni/Dockerfile"}
        assert node["depends_on"] == {"etcd": {"condition": "service_healthy"}} and "healthcheck" in node
        env = node["environment"]
        assert env["PATRONI_NAME"] == name
        assert env["PATRONI_POSTGRESQL_CONNECT_ADDRESS"] == f"{name}:5432"
        assert env["PATRONI_RESTAPI_CONNECT_ADDRESS"] == f"{name}:8008"
        assert env["PATRONI_SUPERUSER_PASSWORD"] and env["PATRONI_REPLICATION_PASSWORD"]
        assert node["volumes"] == [f"{name}:/var/lib/postgresql/data"]  # a data directory each
    # Every component starts once the cluster holds the registry and a standby acknowledges the primary's commits
    # (directly or through what it waits for: airflow-init, the Spark master).
    for name in AIRFLOW | SPARK:
        assert healthy_before(services, name) >= set(REGISTRY), name
    check = " ".join(services["registry-1"]["healthcheck"]["test"])
    assert "-d photon" in check and "sync_state IN ('sync', 'quorum')" in check

    config = patroni_config()
    assert config["etcd3"]["hosts"] == ["etcd:2379"]
    dcs = config["bootstrap"]["dcs"]
    assert dcs["synchronous_mode"] == "quorum" and dcs["synchronous_mode_strict"] is True
    assert dcs["synchronous_node_count"] == 1
    assert dcs["postgresql"]["parameters"]["synchronous_commit"] == "on"
    # The same cluster as `photon registry cluster`: every setting Patroni keeps in etcd, and initdb's.
    local = local_cluster_config(tmp_path)
    assert dcs == local["bootstrap"]["dcs"]
    assert config["bootstrap"]["initdb"] == local["bootstrap"]["initdb"]
    assert config["scope"] == local["scope"] and config["tags"] == local["tags"]
    assert all(rule.split()[-1] in ("trust", "scram-sha-256") for rule in config["postgresql"]["pg_hba"])
    assert not any(rule.startswith("host") and rule.endswith("trust") for rule in config["postgresql"]["pg_hba"])
    # The registry's database and logins, once, on the first primary.
    script = (DOCKER / "patroni" / "post-bootstrap.sh").read_text()
    assert config["bootstrap"]["post_bootstrap"] == "/etc/patroni/post-bootstrap.sh"
    assert 'psql "$1"' in script and "/etc/patroni/10-photon.sql" in script and "ON_ERROR_STOP=1" in script
    assert "GRANT pg_monitor TO photon;" in init_sql()  # the guard's function sees which standbys are in sync

    ins = instructions(DOCKER / "patroni" / "Dockerfile")
    assert ins[0] == ("FROM", "postgres:16-bookworm")  # the official image
    pinned = re.search(r"^patroni==(\S+)$", (ROOT / "requirements.txt").read_text(), re.MULTILINE)
    assert pinned is not None
    runs = " ".join(a for i, a in ins if i == "RUN")
    assert f'"patroni[etcd3,psycopg2-binary]=={pinned.group(1)}"' in runs and "-c /opt/patroni/requirements.txt" in runs
    copied = {shlex.split(a)[-2]: shlex.split(a)[-1] for i, a in ins if i == "COPY"}
    assert copied["docker/patroni/patroni.yml"] == "/etc/patroni/patroni.yml"
    assert copied["docker/patroni/post-bootstrap.sh"] == config["bootstrap"]["post_bootstrap"]
    assert copied["docker/initdb/10-photon.sql"] == "/etc/patroni/10-photon.sql"
    assert all((ROOT / source).is_file() for source in copied)
    assert dict(ins)["CMD"] == '["/etc/patroni/patroni.yml"]'


def test_every_component_reaches_the_primary_on_a_multi_host_dsn_and_requires_replication() -> None:
    from photon.airflow.hooks import dsn_from_connection  # Airflow: imported by this test only

    services = compose()["services"]
    assert "single" not in (DOCKER / "compose.yaml").read_text()  # nothing accepts a lone server any more
    for name in AIRFLOW:
        env = services[name]["environment"]
        assert env["PHOTON_REGISTRY_REPLICATION"] == "required", name
        dsns = [env["PHOTON_REGISTRY_DSN"]] if "PHOTON_REGISTRY_DSN" in env else []
        for key, value in env.items():
            if key.startswith("AIRFLOW_CONN_PHOTON_REGISTRY"):
                conn = json.loads(value)
                conn["extra_dejson"] = conn.pop("extra", {})  # as Airflow hands it to the hook
                dsns.append(dsn_from_connection(SimpleNamespace(**conn)))
        assert len(dsns) == len(ROLES) + (name == "airflow-init"), name
        for dsn in dsns:
            params = psycopg2.extensions.parse_dsn(dsn)
            assert params["host"] == REGISTRY_HOSTS and params["port"] == "5432", (name, dsn)
            assert params["target_session_attrs"] == "read-write", (name, dsn)
            assert params["dbname"] == "photon", (name, dsn)


def test_logs_and_output_are_in_the_s3_service_and_spark_shares_no_volume() -> None:
    """The deployment on an object store: the `seaweedfs` service is `photon storage up` in the foreground (its
    options parsed by the real command), serving the one key that Airflow's photon_storage connection and the Spark
    workers' AWS variables hold; the Variables name s3:// URLs in its bucket; no Spark service mounts a volume, so no
    path of the driver's reaches an executor."""
    import typer

    from photon.cli import app

    services = compose()["services"]
    store = services["seaweedfs"]
    argv = store["command"]
    assert argv[:3] == ["python", "-m", "photon"]
    ctx = typer.main.get_command(app).make_context("photon", argv[3:], resilient_parsing=False)
    sub = ctx.command.get_command(ctx, argv[3])  # type: ignore[attr-defined]
    up = sub.get_command(ctx, argv[4]).make_context("up", argv[5:])
    assert up.params["foreground"] and up.params["bucket"] == ["photon"]
    assert (up.params["host"], up.params["bind"], up.params["s3_port"]) == ("seaweedfs", "0.0.0.0", 8333)
    assert store["volumes"] == [f"seaweed:{up.params['folder']}"]
    assert "127.0.0.1:8333:8333" in store["ports"]  # this host's loopback only
    key, secret = store["environment"]["PHOTON_STORAGE_ACCESS_KEY"], store["environment"]["PHOTON_STORAGE_SECRET_KEY"]
    assert "seaweedfs" in json.dumps(store["healthcheck"]) and "photon" in json.dumps(store["healthcheck"])
    endpoint = f"http://seaweedfs:{up.params['s3_port']}"
    for name in AIRFLOW:
        env = services[name]["environment"]
        assert env["AIRFLOW_VAR_PHOTON_LOGS"].startswith("s3://photon/")
        assert env["AIRFLOW_VAR_PHOTON_OUT"].startswith("s3://photon/")
        conn = json.loads(env["AIRFLOW_CONN_PHOTON_STORAGE"])
        assert conn["conn_type"] == "aws" and (conn["login"], conn["password"]) == (key, secret)
        assert conn["extra"]["endpoint_url"] == endpoint
    for name in ("airflow-init", "spark-master"):  # the other services start after these
        assert services[name]["depends_on"]["seaweedfs"] == {"condition": "service_healthy"}, name
    for name in SPARK:
        svc = services[name]
        assert "volumes" not in svc, name
        env = svc["environment"]
        assert (env["AWS_ENDPOINT_URL"], env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]) == (
            endpoint,
            key,
            secret,
        )
        assert env["AWS_ALLOW_HTTP"] == "true" and env["AWS_REGION"]
    runs = " ".join(a for i, a in instructions(DOCKER / "Dockerfile") if i == "RUN")
    assert f"chown -R airflow:0 /opt/airflow /opt/photon /data {up.params['folder']}" in runs  # the volume is writable
