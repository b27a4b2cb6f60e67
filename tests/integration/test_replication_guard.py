"""The replication guard (photon/pg.py): a registry server that would acknowledge a commit no standby holds is
refused with one line before anything is written, as the least-privilege roles see it; a synchronous pair passes;
a standby named but not yet in sync (a failover's moment) is waited for, within the failover budget;
PHOTON_REGISTRY_REPLICATION=single accepts a lone server. (A Patroni cluster switched to asynchronous replication:
test_failover_load.py, on its three-node cluster.)"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg2.extensions
import pytest
from psycopg2 import sql

from photon.logs.ids import make_id
from photon.pg import UnsafeReplicationError, autocommit, connect, create_database
from photon.registry.admin import init_registry
from photon.registry.client import IdRegistry, RegistryOptions
from photon.registry.owners import create_owner
from photon.registry.sharding import ShardRef
from tests.integration.replication import Node, sync_pair

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Node, Node]]:
    with sync_pair(Path(tmp_path_factory.mktemp("sync-pair"))) as nodes:
        yield nodes


@pytest.fixture(scope="module")
def lone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """A server that names a synchronous standby no one ever started."""
    node = Node(Path(tmp_path_factory.mktemp("lone")) / "lone", "lone").init().start()
    try:
        yield node
    finally:
        node.stop("immediate")


def make_registry(node: Node) -> str:
    """A fresh registry database on ``node``, initialised by its superuser (the admin), under the 'single' default of
    the test suite."""
    dsn = create_database(node.dsn, f"photon_g_{uuid.uuid4().hex[:10]}")
    init_registry({"main": dsn}, num_shards=2)
    return dsn


def login_as(dsn: str, role: str) -> str:
    """A LOGIN role holding only ``role`` on this server (roles are per cluster: the standby gets it by WAL)."""
    name = f"photon_g_{uuid.uuid4().hex[:8]}_{role.removeprefix('photon_')}"
    with autocommit(dsn, guard=False) as conn, conn.cursor() as cur:
        cur.execute(sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(sql.Identifier(name), sql.Identifier(role)))
    return psycopg2.extensions.make_dsn(dsn, user=name)


def registered_rows(dsn: str) -> int:
    with autocommit(dsn, guard=False) as conn, conn.cursor() as cur:
        cur.execute("SELECT config_version, shard_no FROM photon.shard_map")
        refs = [ShardRef(int(v), int(s)) for v, s in cur.fetchall()]
        total = 0
        for ref in refs:
            cur.execute(sql.SQL("SELECT count(*) FROM photon.{}").format(sql.Identifier(ref.table)))
            total += int(cur.fetchone()[0])
    return total


def ids(n: int) -> list[str]:
    base = int(time.time() * 1e6)
    pid = uuid.uuid4().int % 60_000  # batches taken close together never share an id
    return [make_id("10.0.0.7", pid, base + i * 1000) for i in range(n)]


def test_synchronous_pair_passes_as_every_role(pair: tuple[Node, Node], monkeypatch: pytest.MonkeyPatch) -> None:
    primary, standby = pair
    dsn = make_registry(primary)
    monkeypatch.setenv("PHOTON_REGISTRY_REPLICATION", "required")
    joiner = login_as(dsn, "photon_joiner")
    # The view alone shows the roles nothing: the guard reads it through 0011's function.
    with autocommit(joiner, guard=False) as conn, conn.cursor() as cur:
        cur.execute("SELECT sync_state FROM pg_stat_replication")
        assert {r[0] for r in cur.fetchall()} == {None}
    for role in ("photon_gc", "photon_verifier", "photon_reshard"):
        connect(login_as(dsn, role)).close()
    owner = create_owner(joiner, "dc-a")
    batch = ids(300)
    with IdRegistry({"main": joiner}) as reg:
        res = reg.register(batch, owner.token(0))
    assert res.counts()["won"] == 300
    # Acknowledged, so held by the standby (it replays quickly; the guard's point is that it received it first).
    standby_dsn = psycopg2.extensions.make_dsn(dsn, port=standby.port)
    deadline = time.monotonic() + 10
    while registered_rows(standby_dsn) != 300:
        assert time.monotonic() < deadline, "the standby does not hold the acknowledged registrations"
        time.sleep(0.1)


def prepared(dsn: str) -> tuple[str, object]:
    """A joiner login and its owner row, made while the server still commits (a standby name no one answers to makes
    every commit wait, CREATE ROLE's too)."""
    joiner = login_as(dsn, "photon_joiner")
    return joiner, create_owner(joiner, f"dc-{uuid.uuid4().hex[:6]}")


def _refused(dsn: str, joiner: str, owner: object, monkeypatch: pytest.MonkeyPatch, *expected: str) -> None:
    """A joiner registering on ``dsn`` is refused with one line naming ``expected``, and no row is written. (Standbys
    named but none in sync is retried for the failover budget first: a short one here.)"""
    monkeypatch.setenv("PHOTON_REGISTRY_REPLICATION", "required")
    before = registered_rows(dsn)
    options = RegistryOptions(failover_s=1.0)
    with IdRegistry({"main": joiner}, options) as reg, pytest.raises(UnsafeReplicationError) as info:
        reg.register(ids(50), owner.token(0))  # type: ignore[attr-defined]
    line = str(info.value)
    assert "\n" not in line
    for text in (*expected, "PHOTON_REGISTRY_REPLICATION=single"):
        assert text in line, line
    assert registered_rows(dsn) == before


def test_refuses_no_standby_names_and_single_accepts(pair: tuple[Node, Node], monkeypatch: pytest.MonkeyPatch) -> None:
    primary, _ = pair
    dsn = make_registry(primary)
    joiner, owner = prepared(dsn)
    primary.set("synchronous_standby_names", "")
    try:
        _refused(dsn, joiner, owner, monkeypatch, "synchronous_standby_names is empty")
        # The deployment says it accepts one server: the same registration goes through.
        monkeypatch.setenv("PHOTON_REGISTRY_REPLICATION", "single")
        with IdRegistry({"main": joiner}) as reg:
            assert reg.register(ids(50), owner.token(0)).counts()["won"] == 50  # type: ignore[attr-defined]
    finally:
        primary.set("synchronous_standby_names", "ANY 1 (s1)")


def test_refuses_a_standby_connected_but_async(pair: tuple[Node, Node], monkeypatch: pytest.MonkeyPatch) -> None:
    primary, _ = pair
    dsn = make_registry(primary)
    joiner, owner = prepared(dsn)
    primary.set("synchronous_standby_names", "ANY 1 (s9)")  # s1 streams, but not as the synchronous one
    try:
        _refused(dsn, joiner, owner, monkeypatch, "synchronous_standby_names = 'ANY 1 (s9)'", "s1 streaming/async")
    finally:
        primary.set("synchronous_standby_names", "ANY 1 (s1)")
        primary.wait_sync_state("s1", ("quorum", "sync"))


def test_waits_for_a_named_standby_reconnecting(pair: tuple[Node, Node], monkeypatch: pytest.MonkeyPatch) -> None:
    """Right after a failover the new primary names its standbys before one has reconnected to it (Patroni in quorum
    mode: 'ANY 1 (node1,node3)', none streaming, for a moment): its commits would wait, never be acknowledged alone.
    A batch then waits, as for a server away (the failover budget), and goes through once the standby streams."""
    primary, standby = pair
    dsn = make_registry(primary)
    joiner, owner = prepared(dsn)
    monkeypatch.setenv("PHOTON_REGISTRY_REPLICATION", "required")
    standby.stop("fast")
    back = threading.Timer(2.0, standby.start)
    back.start()
    try:
        started = time.monotonic()
        with IdRegistry({"main": joiner}, RegistryOptions(failover_s=30)) as reg:
            assert reg.register(ids(50), owner.token(0)).counts()["won"] == 50  # type: ignore[attr-defined]
        assert time.monotonic() - started >= 1.5  # it waited for the standby, not committed without it
    finally:
        back.join()
        primary.wait_sync_state("s1", ("quorum", "sync"))
    deadline = time.monotonic() + 10
    while registered_rows(psycopg2.extensions.make_dsn(dsn, port=standby.port)) < 50:
        assert time.monotonic() < deadline, "the standby does not hold the acknowledged registrations"
        time.sleep(0.1)


def test_refuses_a_named_standby_not_connected(lone: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    dsn = make_registry(lone)
    joiner, owner = prepared(dsn)
    lone.set("synchronous_standby_names", "ANY 1 (s1)")
    try:
        _refused(dsn, joiner, owner, monkeypatch, "synchronous_standby_names = 'ANY 1 (s1)'", "none connected")
    finally:
        lone.set("synchronous_standby_names", "")


def test_refuses_synchronous_commit_local(pair: tuple[Node, Node], monkeypatch: pytest.MonkeyPatch) -> None:
    primary, _ = pair
    dsn = make_registry(primary)
    role_dsn = login_as(dsn, "photon_joiner")
    role = psycopg2.extensions.parse_dsn(role_dsn)["user"]
    with autocommit(dsn, guard=False) as conn, conn.cursor() as cur:  # a role setting, the kind easily missed
        cur.execute(sql.SQL("ALTER ROLE {} SET synchronous_commit = 'local'").format(sql.Identifier(role)))
    monkeypatch.setenv("PHOTON_REGISTRY_REPLICATION", "required")
    with pytest.raises(UnsafeReplicationError, match="synchronous_commit = 'local'"):
        connect(role_dsn)


def test_kept_connection_is_checked_again(pair: tuple[Node, Node], monkeypatch: pytest.MonkeyPatch) -> None:
    """A client's kept connection passed when it opened; the standby names cleared later (Patroni outside strict
    mode does that when its standby goes) refuse the next batch, with nothing written."""
    import photon.pg

    primary, _ = pair
    dsn = make_registry(primary)
    monkeypatch.setenv("PHOTON_REGISTRY_REPLICATION", "required")
    monkeypatch.setattr(photon.pg, "GUARD_RECHECK_S", 0.0)
    joiner = login_as(dsn, "photon_joiner")
    owner = create_owner(joiner, "dc-a")
    with IdRegistry({"main": joiner}) as reg:
        assert reg.register(ids(20), owner.token(0)).counts()["won"] == 20
        primary.set("synchronous_standby_names", "")
        try:
            before = registered_rows(dsn)
            with pytest.raises(UnsafeReplicationError, match="synchronous_standby_names is empty"):
                reg.register(ids(20), owner.token(1))
            assert registered_rows(dsn) == before
        finally:
            primary.set("synchronous_standby_names", "ANY 1 (s1)")
            primary.wait_sync_state("s1", ("quorum", "sync"))
