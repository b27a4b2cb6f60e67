"""Fixtures shared by the integration tests (a test module may define its own ``servers`` to reach the registry as
another role)."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from photon.registry.admin import init_registry
from photon.registry.cluster import LocalCluster
from photon.tools import storage_server
from tests.integration.spark_server import free_port, spark_connect_server


@pytest.fixture
def servers(make_db: Callable[[], str], login_as: Callable[[str, str], str]) -> dict[str, str]:
    """A fresh registry, reached as the joiner runs in production: a login holding only photon_joiner."""
    dsn = make_db()
    init_registry({"main": dsn}, num_shards=4)
    return {"main": login_as(dsn, "photon_joiner")}


@pytest.fixture(scope="module")
def registry_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A local three-node cluster (etcd, three Patroni nodes, quorum commit), up and acknowledging commits on a
    standby; stopped at the end of the module."""
    cluster = LocalCluster(tmp_path_factory.mktemp("cluster"))
    try:
        cluster.up()
        yield cluster
    finally:
        if cluster.state:  # not when up() failed before writing any state (no binaries, say)
            cluster.down()


@pytest.fixture(scope="session")
def warm_spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The PHOTON_HOME of a warm `photon spark-connect` server, one per test process, for the tests that start many
    short `photon join --connect` processes (a lease after each SIGKILL, say), as Airflow's tasks run on the
    deployment's server: each process then pays a gRPC session and its Python workers' imports, not a JVM and a
    SparkContext of its own (four to five Spark starts made each such test take 4-5x its time alone under the suite's
    load). The kill is still a kill of the whole joiner process; tests of a process's own Spark keep `--master`."""
    where = tmp_path_factory.mktemp("spark-connect")
    with spark_connect_server(where / "home", where / "spark-connect.log", free_port()):
        yield where / "home"


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[storage_server.Server]:
    """A local S3 server (SeaweedFS, as `photon storage up` starts it) for the module's tests; stopped after, hard:
    its data goes with the test's folder, and weed took 2.3 s to stop on SIGTERM, now and then 12 s (CI: 10-12 s
    teardowns of five modules)."""
    folder = tmp_path_factory.mktemp("s3")
    s = storage_server.start(folder)
    try:
        yield s
    finally:
        storage_server.stop(folder, hard=True)


@pytest.fixture
def bucket(s3_server: storage_server.Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """A bucket of the test's own, the AWS variables pointing at the server."""
    name = f"t-{secrets.token_hex(6)}"
    storage_server.create_bucket(s3_server, name)
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    return name
