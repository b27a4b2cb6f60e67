"""The local three-node registry cluster (photon registry cluster): Patroni with quorum commit on three PostgreSQL
nodes. A writer on the multi-host DSN loses no acknowledged row when the primary is SIGKILLed, the old primary comes
back as a streaming standby, and `down` leaves nothing running."""

from __future__ import annotations

import contextlib
import threading
import time

import psutil
import psycopg2
import pytest

from photon.pg import create_database
from photon.registry.admin import init_registry, status
from photon.registry.cluster import _SYNC_NAMES, NODES, LocalCluster

pytestmark = pytest.mark.integration


def _query(dsn: str, query: str) -> list[tuple[object, ...]]:
    with contextlib.closing(psycopg2.connect(dsn)) as conn:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(query)
            return list(cur.fetchall()) if cur.description else []


def test_up_gives_a_writable_primary_with_a_quorum(registry_cluster: LocalCluster) -> None:
    dsn = registry_cluster.dsn()
    assert (registry_cluster.folder / "dsn").read_text().strip() == dsn
    # Trap (1): a bootstrap list such as `ANY None (*)` would leave the primary committing alone.
    (names,) = _query(dsn, "SHOW synchronous_standby_names")[0]
    assert _SYNC_NAMES.match(str(names)), names
    assert _query(dsn, "SHOW synchronous_commit") == [("on",)]
    states = sorted(str(s) for (s,) in _query(dsn, "SELECT sync_state FROM pg_stat_replication"))
    assert len(states) == 2 and set(states) <= {"quorum", "sync"}, states
    roles = sorted(n.role for n in registry_cluster.status())
    assert roles[0] == "leader" and len(roles) == 3, roles
    # The project's schema on the cluster: the real migrations, through the multi-host DSN.
    photon_dsn = create_database(dsn, "photon")
    # Quorum commit waits for one standby's flush, not its replay: a new database may not exist yet on a standby,
    # and libpq stops at a standby that refuses the database name before it finds the primary.
    deadline = time.monotonic() + 10
    while any(
        _query(registry_cluster.node_dsn(n), "SELECT 1 FROM pg_database WHERE datname = 'photon'") == [] for n in NODES
    ):
        assert time.monotonic() < deadline, "the new database did not reach every node"
        time.sleep(0.2)
    init_registry({"main": photon_dsn}, num_shards=2)
    assert status({"main": photon_dsn})["servers"]["main"]["reachable"]


class _Writer(threading.Thread):
    """Commits one row at a time on the multi-host DSN; after a failure reconnects (libpq finds the node that takes
    writes). Records each row whose COMMIT returned, with the times its INSERT started and its COMMIT returned."""

    def __init__(self, dsn: str):
        super().__init__(daemon=True)
        self.dsn = dsn
        self.acked: list[tuple[int, float, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        conn = None
        i = 0
        while not self.stop.is_set():
            try:
                if conn is None:
                    conn = psycopg2.connect(self.dsn)
                    conn.autocommit = True
                i += 1
                started = time.monotonic()
                with conn.cursor() as cur:
                    cur.execute("INSERT INTO acked (id) VALUES (%s)", (i,))
                self.acked.append((i, started, time.monotonic()))
            except psycopg2.Error:
                with contextlib.suppress(psycopg2.Error):
                    if conn is not None:
                        conn.close()
                conn = None
                time.sleep(0.2)


def test_failover_loses_no_acknowledged_row(registry_cluster: LocalCluster) -> None:
    dsn = registry_cluster.dsn()
    _query(dsn, "CREATE TABLE acked (id bigint PRIMARY KEY)")
    writer = _Writer(dsn)
    writer.start()
    try:
        time.sleep(2)
        assert writer.acked, "the writer committed nothing before the kill"
        old = registry_cluster.kill_primary()
        killed_at = time.monotonic()
        deadline = killed_at + 60
        # A row counts as after the kill only if its INSERT started after it: one acknowledged just before the kill
        # may be recorded a moment later.
        while not any(s > killed_at for _, s, _ in writer.acked):
            assert time.monotonic() < deadline, "no commit within 60 s of the primary's loss"
            time.sleep(0.2)
        first_after = min(t for _, s, t in writer.acked if s > killed_at)
        time.sleep(1)
    finally:
        writer.stop.set()
        writer.join(10)
    new = registry_cluster.primary()
    assert new is not None and new != old
    print(f"failover: {first_after - killed_at:.1f} s from the SIGKILL of {old} to the first commit on {new}")
    acked = {i for i, _, _ in writer.acked}
    present = {int(i) for (i,) in _query(dsn, "SELECT id FROM acked")}
    assert not acked - present, f"{len(acked - present)} acknowledged rows missing after the failover"
    print(f"failover: 0 of {len(acked)} acknowledged rows missing on {new}")

    # The old primary comes back: Patroni rewinds it onto the new timeline and it streams from the new primary.
    started = time.monotonic()
    registry_cluster.restart_node(old)
    deadline = started + 60
    while True:
        node = {n.name: n for n in registry_cluster.status()}[old]
        if node.role != "leader" and node.state == "streaming" and node.sync_state in ("quorum", "sync", "potential"):
            break
        assert time.monotonic() < deadline, f"{old} did not rejoin: {node}"
        time.sleep(0.5)
    log = (registry_cluster.folder / "logs" / f"{old}.log").read_text(errors="replace")
    rewound = "pg_rewind exit code=0" in log  # not always needed: the old primary may not have written past the fork
    print(f"rejoin: {old} streaming again {time.monotonic() - started:.1f} s after its restart (pg_rewind: {rewound})")
    deadline = time.monotonic() + 10
    while len(_query(registry_cluster.node_dsn(old), "SELECT id FROM acked")) < len(present):
        assert time.monotonic() < deadline, f"{old} does not hold every row after it rejoined"
        time.sleep(0.2)


def test_down_leaves_nothing_running(registry_cluster: LocalCluster) -> None:
    pids = [p for p in (registry_cluster._process(k) for k in ("etcd", *NODES)) if p is not None]
    procs = [*pids, *(c for p in pids for c in p.children(recursive=True))]
    procs += [pm for pm in (registry_cluster._postmaster(n) for n in NODES) if pm is not None]
    ports = {registry_cluster.state["etcd"]["client"], registry_cluster.state["etcd"]["peer"]}
    ports |= {n[k] for n in registry_cluster.state["nodes"].values() for k in ("pg", "api")}
    assert len(pids) == 4
    registry_cluster.down()
    assert [p.pid for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
    listening = {c.laddr.port for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    assert not ports & listening, ports & listening
