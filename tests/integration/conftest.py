"""Fixtures shared by the integration tests (a test module may define its own ``servers`` to reach the registry as
another role)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from photon.registry.admin import init_registry
from photon.registry.cluster import LocalCluster


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
