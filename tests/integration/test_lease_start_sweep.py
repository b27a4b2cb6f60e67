"""A lease start sweeps what earlier leases left (stages never committed, retry sets nobody reads). Found in review:
a start that stalls before its sweep (on an object store a sweep is a listing and a delete per object, which a
throttled store can stretch past the staleness bound) is fenced by a standby, which then runs its first batch; the
stalled (zombie) start's sweep then removed the successor's stage (its batch committed, published with no rows: lost,
and every verifier pass stopped on the missing evidence) or its retry set (the clicks waiting there lost for good).
A sweep now removes only what an earlier epoch wrote. On a bucket and on a folder; the joiners' Spark is not needed
(the successor's batch is written as its tasks write it)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from photon.joiner.common import JoinSettings, batch_tag
from photon.joiner.lease import Joiner
from photon.joiner.publish import STAGING
from photon.joiner.tasks import CANDIDATE
from photon.logs.tables import parquet_bytes
from photon.registry.admin import init_registry
from photon.storage import Store

pytestmark = pytest.mark.integration


@pytest.fixture(params=["s3", "local"])
def pair(
    request: pytest.FixtureRequest, tmp_path: Path, make_db: Callable[[], str], login_as: Callable[[str, str], str]
) -> tuple[Joiner, Joiner]:
    """Two joiners of dc-a on one output (a bucket's prefix, or a folder), as a stalled lease start and the standby
    that fences it: (zombie, successor). No Spark: the successor's batch is written as its tasks write it."""
    if request.param == "s3":
        request.getfixturevalue("s3_server")
        out: str | Path = f"s3://{request.getfixturevalue('bucket')}/out"
    else:
        out = tmp_path / "out"
    logs = tmp_path / "logs"
    for kind in ("clicks", "queries"):
        (logs / "dc-a" / kind).mkdir(parents=True)
    admin = make_db()
    init_registry({"main": admin}, num_shards=4)
    servers = {"main": login_as(admin, "photon_joiner")}
    settings = JoinSettings(parallelism=2)
    return Joiner("dc-a", logs, out, servers, None, settings), Joiner("dc-a", logs, out, servers, None, settings)


@contextlib.contextmanager
def stalled_start(zombie: Joiner, store: Store, prefix: str) -> Iterator[None]:
    """The zombie's lease start, run in a thread and held just before it lists ``prefix`` of ``store`` to sweep (a
    slow store) until the block ends; then it goes on, and is waited for."""
    stalled, go_on = threading.Event(), threading.Event()
    folders = store.folders

    def slow_folders(where: str = "") -> list[str]:
        if where == prefix:
            stalled.set()
            go_on.wait(60)
        return folders(where)

    store.folders = slow_folders  # type: ignore[method-assign]
    th = threading.Thread(target=zombie.start)
    th.start()
    assert stalled.wait(60)
    try:
        yield
    finally:
        go_on.set()
        th.join(60)


def test_a_fenced_lease_starts_sweep_leaves_its_successors_retry_set(pair: tuple[Joiner, Joiner]) -> None:
    zombie, successor = pair
    with stalled_start(zombie, zombie.state_store, "retries"):
        # The standby found the lease stale and took over; its first batch leaves clicks waiting in its retry set
        # (as join_partition writes it), and commits.
        lease = successor.start()
        assert zombie.lease is not None and lease.epoch > zombie.lease.epoch
        tag = batch_tag(1, lease.epoch)
        waiting = pa.table(
            {n: pa.array([None], CANDIDATE.field(n).type) for n in CANDIDATE.names}, schema=CANDIDATE
        ).set_column(0, "click_id", pa.array(["10.0.0.1-1-1764000000000000"]))
        successor.batches.state_store.put(f"retries/{tag}/{tag}-p0000.parquet", parquet_bytes(waiting))
    successor.state.commit(lease, 1, [], {})
    successor.batches.publish(1, lease.epoch)
    successor.batches.retry_key = f"retries/{tag}"
    assert successor.batches.retry_files(), "the successor's committed retry set was removed by the fenced start"


def test_a_fenced_lease_starts_sweep_leaves_its_successors_stage(pair: tuple[Joiner, Joiner]) -> None:
    """The same, stalled just before it lists the stages to sweep (its last heartbeat, after publishing, passed):
    the successor's staged batch must survive, and its commit publish every row."""
    from deltalake import DeltaTable

    from photon.joiner.common import JOIN_COUNTS
    from photon.joiner.publish import stage_key
    from photon.logs import tables
    from photon.logs.schemas import JOINED, JOINED_SCHEMA

    zombie, successor = pair
    n, base = 3, 1_764_000_000_000_000
    with stalled_start(zombie, zombie.root, STAGING):
        lease = successor.start()
        rows = pa.table(
            {
                f.name: (
                    pa.array([f"10.0.0.1-1-{base + i}" for i in range(n)])
                    if f.name == "click_id"
                    else pa.array([base + i for i in range(n)], f.type)
                    if f.type == pa.int64()
                    else pa.array(["x"] * n, f.type)
                )
                for f in JOINED_SCHEMA
            },
            schema=JOINED_SCHEMA,
        )
        tables.stage_rows(successor.root, JOINED, stage_key(1, lease.epoch), "p0000", rows, 1)  # its tasks' output
    metrics = {**dict.fromkeys(JOIN_COUNTS, 0), "joined": n, "clicks": n, "started_at_us": base, "duration_s": 1.0}
    metrics |= {"query_files": 0, "click_files": 0, "queries": 0, "quarantined": 0}
    successor.state.commit(lease, 1, [], metrics)  # registry commit: the clicks are the pipeline's now
    successor.batches.publish(1, lease.epoch)
    uri, opts = successor.root.delta_location(JOINED)
    got = DeltaTable(uri, storage_options=opts or None).to_pyarrow_table(columns=["click_id"]).num_rows
    assert got == n, f"batch 1 committed {n} joined clicks, its table holds {got}: lost"
