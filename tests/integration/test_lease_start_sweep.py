"""A lease start sweeps what earlier leases left (stages never committed, retry sets nobody reads). Found in review:
a start that stalls before its sweep (on an object store a sweep is a listing and a delete per object, which a
throttled store can stretch past the staleness bound) is fenced by a standby, which then runs its first batch; the
stalled (zombie) start's sweep then removed the successor's stage (its batch committed, published with no rows: lost,
and every verifier pass stopped on the missing evidence) or its retry set (the clicks waiting there lost for good).
A sweep now removes only what an earlier epoch wrote. On a bucket and on a folder; the joiners' Spark is not needed
(the successor's batch is written as its tasks write it)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pytest

from photon.joiner.common import JoinSettings, batch_tag
from photon.joiner.lease import Joiner
from photon.joiner.publish import STAGING
from photon.joiner.tasks import CANDIDATE
from photon.logs.tables import parquet_bytes
from photon.registry.admin import init_registry
from photon.storage import LocalStore, S3Store

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("kind", ["s3", "local"])
def test_a_fenced_lease_starts_sweep_leaves_its_successors_retry_set(
    kind: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    make_db: Callable[[], str],
    login_as: Callable[[str, str], str],
) -> None:
    if kind == "s3":
        request.getfixturevalue("s3_server")
        bucket = request.getfixturevalue("bucket")
        out: str | Path = f"s3://{bucket}/out"
    else:
        out = tmp_path / "out"
    logs = tmp_path / "logs"
    (logs / "dc-a" / "clicks").mkdir(parents=True)
    (logs / "dc-a" / "queries").mkdir(parents=True)
    admin = make_db()
    init_registry({"main": admin}, num_shards=4)
    servers = {"main": login_as(admin, "photon_joiner")}
    settings = JoinSettings(parallelism=2)
    zombie = Joiner("dc-a", logs, out, servers, None, settings)
    successor = Joiner("dc-a", logs, out, servers, None, settings)

    # The zombie's lease start stalls before it lists the retry sets to sweep (a slow store).
    stalled, go_on = threading.Event(), threading.Event()
    folders = zombie.state_store.folders

    def slow_folders(prefix: str = "") -> list[str]:
        if prefix == "retries":
            stalled.set()
            go_on.wait(60)
        return folders(prefix)

    zombie.state_store.folders = slow_folders  # type: ignore[method-assign]
    errors: list[BaseException] = []

    def start_zombie() -> None:
        try:
            zombie.start()
        except BaseException as exc:
            errors.append(exc)

    th = threading.Thread(target=start_zombie)
    th.start()
    assert stalled.wait(60)

    # The standby found the lease stale and took over; its first batch leaves clicks waiting in its retry set
    # (as join_partition writes it), and commits.
    lease = successor.start()
    assert lease.epoch > zombie.lease.epoch  # type: ignore[union-attr]
    tag = batch_tag(1, lease.epoch)
    waiting = pa.table(
        {n: pa.array([None], CANDIDATE.field(n).type) for n in CANDIDATE.names}, schema=CANDIDATE
    ).set_column(0, "click_id", pa.array(["10.0.0.1-1-1764000000000000"]))
    successor.batches.state_store.put(f"retries/{tag}/{tag}-p0000.parquet", parquet_bytes(waiting))

    go_on.set()  # the zombie's start goes on with its cleanup
    th.join(60)

    successor.state.commit(lease, 1, [], {})
    successor.batches.publish(1, lease.epoch)
    successor.batches.retry_key = f"retries/{tag}"
    store = successor.batches.state_store
    assert isinstance(store, (LocalStore, S3Store))
    kept = [e.key for e in successor.batches.retry_files()]
    assert kept, f"the successor's committed retry set was removed by the fenced lease's start (errors: {errors})"


@pytest.mark.parametrize("kind", ["s3", "local"])
def test_a_fenced_lease_starts_sweep_leaves_its_successors_stage(
    kind: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    make_db: Callable[[], str],
    login_as: Callable[[str, str], str],
) -> None:
    """The same, stalled just before it lists the stages to sweep (its last heartbeat, after publishing, passed):
    the successor's staged batch must survive, and its commit publish every row."""
    from deltalake import DeltaTable

    from photon.joiner.publish import stage_key
    from photon.logs import tables
    from photon.logs.schemas import JOINED, JOINED_SCHEMA

    if kind == "s3":
        request.getfixturevalue("s3_server")
        bucket = request.getfixturevalue("bucket")
        out: str | Path = f"s3://{bucket}/out"
    else:
        out = tmp_path / "out"
    logs = tmp_path / "logs"
    (logs / "dc-a" / "clicks").mkdir(parents=True)
    (logs / "dc-a" / "queries").mkdir(parents=True)
    admin = make_db()
    init_registry({"main": admin}, num_shards=4)
    servers = {"main": login_as(admin, "photon_joiner")}
    settings = JoinSettings(parallelism=2)
    zombie = Joiner("dc-a", logs, out, servers, None, settings)
    successor = Joiner("dc-a", logs, out, servers, None, settings)
    stalled, go_on = threading.Event(), threading.Event()
    folders = zombie.root.folders

    def slow_folders(prefix: str = "") -> list[str]:
        if prefix == STAGING:
            stalled.set()
            go_on.wait(60)
        return folders(prefix)

    zombie.root.folders = slow_folders  # type: ignore[method-assign]
    th = threading.Thread(target=lambda: zombie.start())
    th.start()
    assert stalled.wait(60)

    lease = successor.start()
    n = 3
    base = 1_764_000_000_000_000
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

    go_on.set()
    th.join(60)

    from photon.joiner.common import JOIN_COUNTS

    metrics = {**dict.fromkeys(JOIN_COUNTS, 0), "joined": n, "clicks": n, "started_at_us": base, "duration_s": 1.0}
    metrics |= {"query_files": 0, "click_files": 0, "queries": 0, "quarantined": 0}
    successor.state.commit(lease, 1, [], metrics)  # registry commit: the clicks are the pipeline's now
    successor.batches.publish(1, lease.epoch)
    uri, opts = successor.root.delta_location(JOINED)
    got = DeltaTable(uri, storage_options=opts or None).to_pyarrow_table(columns=["click_id"]).num_rows
    assert got == n, f"batch 1 committed {n} joined clicks, its table holds {got}: lost"
