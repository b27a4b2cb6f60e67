"""Output table maintenance (``photon table maintain``, ``photon.tools.maintenance``, the DAG
photon_table_maintenance): compaction keeps every row once and each pipeline's published batch; vacuum deletes the
old data files no commit names and never a committed one, nor one a batch staged and has not published yet; a
retention under the minimum is refused in one line; two maintenance runs at once do not duplicate rows (they did:
delta-rs commits two compactions of the same files, each with its copy); and the key guarantee with real processes:
two pipelines' publishers committing batch after batch while `photon table maintain` runs again and again, two at a
time, some runs SIGKILLed, then each pipeline's table holds every batch it published once, whole. Real `photon join`
leases beside maintenance (and killed maintenance) are the nemesis's (tests/integration/test_nemesis.py)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pytest
from deltalake import DeltaTable

from photon.joiner.common import batch_tag
from photon.joiner.publish import publish_files
from photon.logs import tables
from photon.logs.ids import make_id
from photon.logs.schemas import JOINED, JOINED_SCHEMA, QUARANTINE, UNJOINABLE
from photon.storage import S3Store, Store
from photon.tools import storage_server
from photon.tools.maintenance import (
    LOCK,
    MIN_RETENTION_HOURS,
    MaintenanceError,
    MaintenanceLockLost,
    StoreLock,
    TableInvariantError,
    maintain,
)

pytestmark = pytest.mark.integration
US = 1_000_000
HOUR_US = 3600 * US
ROOT = Path(__file__).resolve().parents[2]
T0 = 1_790_000_000 * US - 1_790_000_000 * US % HOUR_US  # the start of an hour
OLD = time.time() - 200 * 3600  # older than the default retention (168 h)


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}"}


def photon(*args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "photon", *args], env=env(), cwd=ROOT, capture_output=True, text=True, **kw
    )


def rows(pipeline: str, batch: int, n: int, hours: int = 2) -> pa.Table:
    """``n`` joined rows of ``batch``, spread over ``hours`` hours from T0 (one id per batch and row)."""
    ts = [T0 + (i % hours) * HOUR_US + batch * 1000 + i for i in range(n)]
    ids = [make_id("10.0.0.1", batch, t) for t in ts]
    cols: dict[str, Any] = {f.name: [f"{f.name}-{i}" for i in range(n)] for f in JOINED_SCHEMA}
    cols |= {"click_id": ids, "click_ts_us": ts, "query_ts_us": ts, "joined_at_us": ts, "bid_micros": [1] * n}
    cols["pipeline"] = [pipeline] * n
    return pa.table(cols, schema=JOINED_SCHEMA)


def _name(root: Path | Store) -> str:
    return root.name if isinstance(root, Path) else root.url.rstrip("/").rpartition("/")[2]


def stage(root: Path | Store, batch: int, n: int, epoch: int = 1) -> str:
    """Stage batch ``batch`` as a joiner's tasks do: data files in the table's folder, their adds under the stage
    (returned: its key under ``root``)."""
    folder = f"_staging/{batch_tag(batch, epoch)}"
    tables.stage_rows(root, JOINED, folder, f"{batch_tag(batch, epoch)}-t0", rows(_name(root), batch, n), batch)
    return folder


def publish(root: Path | Store, batches: range, n: int = 5) -> None:
    """Batches committed and published as a lease does: staged, then published (the stage removed after)."""
    tables.ensure_tables(root)
    for k in batches:
        stage(root, k, n)
        publish_files(root, _name(root), k, 1)


def joined(out: Path, pipeline: str = "dc-a") -> DeltaTable:
    return DeltaTable(str(out / pipeline / JOINED))


def click_ids(dt: DeltaTable) -> list[str]:
    return dt.to_pyarrow_dataset().to_table(columns=["click_id"])["click_id"].to_pylist()


def test_compaction_keeps_every_row_once_and_the_published_batch(tmp_path: Path) -> None:
    out = tmp_path / "out"
    publish(out / "dc-a", range(1, 41))
    dt = joined(out)
    ids, version = sorted(click_ids(dt)), dt.version()
    assert len(dt.file_uris()) == 80  # a file per batch and hour
    # A dry run says what the run will do (it said "80 -> 80 data files, 0 compacted" to a newcomer), changing nothing.
    dry = next(r for r in maintain(out, dry_run=True).tables if r.kind == JOINED)
    assert (dry.files_compacted, dry.files_written, len(dry.hours_compacted)) == (80, 2, 2), dry
    assert (dry.before.files, dry.after.files) == (80, 2) and joined(out).version() == version
    report = maintain(out)
    t = next(r for r in report.tables if r.kind == JOINED)
    assert (t.files_compacted, t.files_written, t.after.files) == (80, 2, 2)
    dt = joined(out)
    assert len(dt.file_uris()) == 2 and t.files_compacted == 80 and len(t.hours_compacted) == 2
    assert sorted(click_ids(dt)) == ids  # the same rows, each once
    # Compaction carries no application transaction: the pipeline's published batch is what it was.
    assert dt.transaction_version("photon/dc-a") == 40
    assert [h["operation"] for h in dt.history(2)] == ["OPTIMIZE", "OPTIMIZE"] and dt.version() == version + 2
    # A reader finds a batch's rows by value after compaction (as the verifier does).
    assert dt.to_pyarrow_dataset().count_rows(filter=ds.field("batch") == 7) == 5
    # The checkpoint is at the newest version: a reader opening the table reads no commit after it.
    assert t.checkpoint == dt.version() and t.after.commits_since_checkpoint == 0
    # A publisher after maintenance: its next batch commits; a batch already published commits nothing again.
    publish(out / "dc-a", range(41, 42))
    assert publish_files(out / "dc-a", "dc-a", 41, 1) == {JOINED: "none", UNJOINABLE: "none", QUARANTINE: "none"}
    assert tables.publish_batch(out / "dc-a", "dc-a", 40, stage(out / "dc-a", 40, 5, epoch=2))[JOINED] == "already"
    assert sorted(click_ids(joined(out))) == sorted(ids + [i for i in rows("dc-a", 41, 5)["click_id"].to_pylist()])
    again = next(r for r in maintain(out).tables if r.kind == JOINED)
    assert again.hours_compacted == sorted(tables.hour_of(T0 + h * HOUR_US) for h in range(2))  # the new files only
    assert again.files_compacted == 4 and len(joined(out).file_uris()) == 2


def test_vacuum_deletes_old_unreferenced_files_never_committed_or_staged_ones(tmp_path: Path) -> None:
    out, root = tmp_path / "out", tmp_path / "out" / "dc-a"
    publish(root, range(1, 4))
    maintain(out)  # batches 1-3 compacted: their small files replaced (removed from the table now)
    publish(root, range(4, 6))
    table = root / JOINED
    # Batch 6 crashed before its registry commit: the next lease start removed its stage, its files stay. Batch 7
    # was committed to the registry but its pipeline died before publishing: its stage is still there.
    crashed = stage(root, 6, 5)
    orphans = sorted(str(p.relative_to(table)) for p in table.rglob("b0000000006-*.parquet"))
    shutil.rmtree(root / crashed)
    stage(root, 7, 5)
    unpublished_files = sorted(p for p in table.rglob("b0000000007-*.parquet"))
    young_orphan = table / "hour=2026010100" / "young.parquet"
    young_orphan.parent.mkdir()
    young_orphan.write_bytes(b"not yet committed")
    # Every file old but the young orphan: committed ones, replaced ones (removed just now), staged ones.
    everything = [p for p in table.rglob("*.parquet") if "_delta_log" not in p.parts and p != young_orphan]
    for p in everything:
        os.utime(p, (OLD, OLD))
    named = sorted(joined(out).file_uris())
    dry = next(r for r in maintain(out, dry_run=True).tables if r.kind == JOINED)
    assert dry.vacuumed == orphans and all((table / p).exists() for p in orphans)  # reported, nothing deleted
    t = next(r for r in maintain(out).tables if r.kind == JOINED)
    assert t.vacuumed == orphans and len(orphans) == 2  # batch 6's two hours
    assert not any((table / p).exists() for p in orphans)
    assert t.spared == 2 and all(p.exists() for p in unpublished_files)  # batch 7's stage names them
    assert all(Path(p).exists() for p in named) and young_orphan.exists()
    # Files the compaction replaced are kept for the retention (a reader of an older snapshot reads them), however
    # old their own time.
    assert len([p for p in everything if p.exists()]) == len(everything) - len(orphans)
    # Batch 7 rolled forward now: its files are all there, and every row of batches 1-5 and 7 reads.
    publish_files(root, "dc-a", 7, 1)
    got = Counter(joined(out).to_pyarrow_dataset().to_table(columns=["batch"])["batch"].to_pylist())
    assert got == {k: 5 for k in (1, 2, 3, 4, 5, 7)}


def test_vacuum_spares_a_committed_batch_s_files_its_stage_listing_misses(tmp_path: Path) -> None:
    """The vacuum spared a not-yet-published batch's old files only by the add records its stage listed. A listing
    missing one (SeaweedFS, SIGKILLed again and again, kept an acknowledged add record out of its folder's listing)
    had them deleted, and the batch, published later, named files gone. A data file whose name starts with a stage
    folder's batch tag is spared as well, whatever that stage's records list."""
    out, root = tmp_path / "out", tmp_path / "out" / "dc-a"
    publish(root, range(1, 3))
    folder = stage(root, 3, 5)  # committed, not published
    table = root / JOINED
    record = next((root / folder).rglob("*.json"))
    kept = record.read_bytes()
    record.unlink()  # as the stage's listing misses it
    unpublished = sorted(table.rglob("b0000000003-*.parquet"))
    for p in table.rglob("*.parquet"):
        os.utime(p, (OLD, OLD))
    t = next(r for r in maintain(out).tables if r.kind == JOINED)
    assert t.vacuumed == [] and t.spared == 2 and all(p.exists() for p in unpublished)
    record.write_bytes(kept)  # listed again
    publish_files(root, "dc-a", 3, 1, expect={JOINED: 5})
    got = Counter(joined(out).to_pyarrow_dataset().to_table(columns=["batch"])["batch"].to_pylist())
    assert got == {1: 5, 2: 5, 3: 5}


def test_a_retention_below_the_minimum_is_refused_in_one_line(tmp_path: Path) -> None:
    out = tmp_path / "out"
    publish(out / "dc-a", range(1, 4))
    version = joined(out).version()
    r = photon("table", "maintain", "--out", str(out), "--retention-hours", str(MIN_RETENTION_HOURS - 1))
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [
        f"error: --retention-hours {MIN_RETENTION_HOURS - 1} is below the minimum of {MIN_RETENTION_HOURS} h: a batch "
        "writes its data files before its commit, and a shorter retention could vacuum them; nothing was changed "
        "(--force accepts it, only with no pipeline or backfill writing to these tables)"
    ]
    assert joined(out).version() == version and len(joined(out).file_uris()) == 6  # nothing compacted either
    r = photon("table", "maintain", "--out", str(out), "--pipeline", "dc-x")
    assert (
        r.returncode == 2
        and r.stderr.strip() == f"error: no output table for pipeline dc-x under {out}; nothing was changed"
    )
    # The minimum, and the DAG's form holds the same one.
    from airflow.dag_processing.dagbag import DagBag

    dag = DagBag(dag_folder=str(ROOT / "dags")).dags["photon_table_maintenance"]
    assert dag.params.get_param("retention_hours").schema["minimum"] == MIN_RETENTION_HOURS
    r = photon("table", "maintain", "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tables"][0]["files_compacted"] == 6


def maintain_process(out: Path) -> subprocess.Popen[str]:
    """`photon table maintain --json` over ``out``, a process of its own."""
    return subprocess.Popen(
        [sys.executable, "-m", "photon", "table", "maintain", "--out", str(out), "--json"],
        env=env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_two_maintenance_runs_at_once_keep_every_row_once(tmp_path: Path) -> None:
    """Two runs, each a process of its own, compacting the same hours at once. Without the lock (``LOCK``) delta-rs
    committed both compactions and the table held every row twice (3 times out of 3 here)."""
    out = tmp_path / "out"
    for rnd in range(3):
        publish(out / "dc-a", range(rnd * 60 + 1, rnd * 60 + 61), n=3)
        runs = [maintain_process(out) for _ in range(2)]
        reports = [p.communicate(timeout=300) for p in runs]
        assert [p.returncode for p in runs] == [0, 0], reports
        compacted = [json.loads(o)["tables"][0]["files_compacted"] for o, _ in reports]
        assert sorted(compacted) == [0, 120 + (2 if rnd else 0)]  # one run compacted, the other found it done
        ids = click_ids(joined(out))
        assert len(ids) == len(set(ids)) == 180 * (rnd + 1)
    assert (out / "dc-a" / LOCK).exists()


def test_two_maintenance_runs_at_once_on_a_bucket_keep_every_row_once(
    s3_server: storage_server.Server, bucket: str
) -> None:
    """The same race on an object store, where no flock exists: the runs take turns through the put-if-absent lock
    (``StoreLock``); one compacts, the other finds it done; the lock's generations are released and pruned."""
    out = S3Store(f"s3://{bucket}/out")
    publish(out.child("dc-a"), range(1, 41), n=3)
    runs = [
        subprocess.Popen(
            [sys.executable, "-m", "photon", "table", "maintain", "--out", out.url, "--json"],
            env=env() | s3_server.env(),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    reports = [p.communicate(timeout=300) for p in runs]
    assert [p.returncode for p in runs] == [0, 0], reports
    compacted = sorted(json.loads(o)["tables"][0]["files_compacted"] for o, _ in reports)
    assert compacted == [0, 80], reports
    uri, options = out.delta_location("dc-a/joined")
    dt = DeltaTable(uri, storage_options=options)
    ids = click_ids(dt)
    assert len(ids) == len(set(ids)) == 120 and dt.transaction_version("photon/dc-a") == 40
    locks = sorted(e.key.rpartition("/")[2] for e in out.listing("dc-a/_maintenance"))
    assert locks == ["lock-000000000001.json", "lock-000000000001.released"], locks


def test_a_dead_run_s_lock_on_a_bucket_is_taken_over_after_its_lease_and_its_holder_stops_compacting(
    s3_server: storage_server.Server, bucket: str
) -> None:
    """A run killed while holding the object store's lock never releases it: the next waits out the lease (by the
    store's clock), then takes the next generation; the old holder, were it alive, starts no compaction since. And a
    run past half its lease leaves its hours to the next run, saying so, with every row in place."""
    root = S3Store(f"s3://{bucket}/out/dc-a")
    dead = StoreLock(root, lease_s=3.0)
    dead.acquire()
    dead.check()  # within its lease, and nobody took over
    t0 = time.monotonic()
    taker = StoreLock(root, lease_s=3.0)
    taker.acquire()
    waited = time.monotonic() - t0
    assert 3.0 + StoreLock.MARGIN_S - 1.0 <= waited < 30, waited  # the lease, plus the margin, by the store's clock
    assert (dead.generation, taker.generation) == (0, 1)
    with pytest.raises(MaintenanceLockLost):
        dead.check()
    taker.release()
    t0 = time.monotonic()
    after = StoreLock(root, lease_s=3.0)
    after.acquire()  # released: at once
    assert after.generation == 2 and time.monotonic() - t0 < 5
    after.release()

    out = S3Store(f"s3://{bucket}/out")
    publish(out.child("dc-a"), range(1, 11), n=3)
    report = maintain(out, lock_lease_s=0.001)  # past half its lease before its first compaction
    assert [t.hours_left for t in report.tables if t.kind == JOINED] == [["2026092114", "2026092115"]]
    assert sum(t.files_compacted for t in report.tables) == 0
    report = maintain(out)
    (t,) = [t for t in report.tables if t.kind == JOINED]
    assert t.files_compacted == 20 and t.hours_left == [] and t.after.rows == 30


def test_the_bucket_lock_holds_against_twin_records_a_stale_listing_and_names_that_are_no_lock(
    s3_server: storage_server.Server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three ways a reviewer broke ``StoreLock``, each once a duplicate in the table: (1) two runs whose records
    were the same bytes (same host and pid: two containers) both "won" one generation, put-if-absent counting a key
    that holds one's own bytes as one's own; (2) a run listing before others took, released and pruned generations
    created a pruned one again and held it beside the holder of the newest; (3) names under ``_maintenance/`` that are
    no generation: a released marker left from before (a second run then took the next generation at once), digits
    that are not ASCII, and a key taken by a folder (acquire spun for ever)."""
    import threading

    monkeypatch.setattr(StoreLock, "POLL_S", 0.2)
    monkeypatch.setattr("socket.gethostname", lambda: "twin")
    monkeypatch.setattr("os.getpid", lambda: 1)
    for k in range(3):  # (1)
        root = S3Store(f"s3://{bucket}/twins{k}")
        locks = [StoreLock(root, 60.0) for _ in range(2)]
        go = threading.Barrier(2)
        threads = [threading.Thread(target=lambda lk=lk, go=go: (go.wait(), lk.acquire()), daemon=True) for lk in locks]
        for th in threads:
            th.start()
        time.sleep(1.5)
        holders = [lk for lk in locks if lk.generation is not None]
        assert len(holders) == 1, [lk.generation for lk in locks]
        holders[0].release()
        for th in threads:
            th.join(10)
        assert sorted(lk.generation if lk.generation is not None else -1 for lk in locks) == [-1, 1]

    root = S3Store(f"s3://{bucket}/stale")  # (2)
    for _ in range(3):
        done = StoreLock(root, 60.0)
        done.acquire()
        done.release()
    holder = StoreLock(root, 60.0)
    holder.acquire()
    assert holder.generation == 3
    late = StoreLock(root, 60.0)
    listings = iter([({}, set())])  # its first listing from before the others came and went
    real = late._generations
    monkeypatch.setattr(late, "_generations", lambda: next(listings, None) or real())
    waiting = threading.Thread(target=late.acquire, daemon=True)
    waiting.start()
    time.sleep(1.5)
    assert late.generation is None and waiting.is_alive()  # it created generation 0 again, and gave it up
    holder.check()
    holder.release()
    waiting.join(10)
    assert late.generation == 4
    late.release()

    root = S3Store(f"s3://{bucket}/junk")  # (3)
    for name in ("lock-000000000000.released", "lock-\u00b2.json", "lock-\u0663.json", "lock-12.json", "notes"):
        root.put(f"_maintenance/{name}", b"left here")
    first = StoreLock(root, 60.0)
    first.acquire()
    assert first.generation == 0
    second = StoreLock(root, 60.0)
    said: list[BaseException] = []

    def take() -> None:
        try:
            second.acquire()
        except MaintenanceError as exc:
            said.append(exc)

    taking = threading.Thread(target=take, daemon=True)
    taking.start()
    time.sleep(1.0)
    assert second.generation is None, "a marker left from before released a live holder's generation"
    root.put("_maintenance/lock-000000000001.json/x", b"a folder where the next generation goes")
    first.release()
    taking.join(10)
    assert not taking.is_alive() and second.generation is None  # it gave up, in one line
    key = f"{root.url}/_maintenance/lock-000000000001.json"
    assert [str(e) for e in said] == [
        f"{key}: cannot be created, yet is no lock: delete the key {key} and everything under {key}/"
    ]


def test_a_table_holding_a_click_twice_is_never_compacted(tmp_path: Path) -> None:
    """Two compactions that both committed (a holder paused past its lease: what no lease can stop) leave an hour's
    rows twice; the one that saw it may have died before it checked. The next run finds the hour holding clicks twice
    and stops, naming it, before compacting it (and counting the duplicates as the rows to keep)."""
    out = tmp_path / "out"
    publish(out / "dc-a", range(1, 4), n=2)
    dt = joined(out)
    again = dt.to_pyarrow_dataset().to_table(filter=ds.field("batch") == 2)
    from deltalake import write_deltalake

    write_deltalake(str(out / "dc-a" / JOINED), again, mode="append", partition_by=[tables.PARTITION])
    with pytest.raises(TableInvariantError, match="holds 1 click\\(s\\) twice"):
        maintain(out)
    assert len(joined(out).file_uris()) == 8  # nothing compacted (3 batches and the copy, over 2 hours)


def test_compactions_racing_a_publisher_commit_both_and_keep_every_batch_once(tmp_path: Path) -> None:
    """A publisher process committing 300 batches as fast as it can, compacted all along: Delta's conflict check
    puts each compaction after the appends that won the race (a compaction's read version is then older than the
    commit before it), and both go on; every batch is in the table once, whole."""
    out = tmp_path / "out"
    publish(out / "dc-a", range(1, 2))
    code = (
        f"from pathlib import Path; from {__name__} import publish; publish(Path({str(out / 'dc-a')!r}), range(2, 301))"
    )
    publisher = subprocess.Popen([sys.executable, "-c", code], env=env(), cwd=ROOT, stderr=subprocess.PIPE, text=True)
    runs = 0
    while publisher.poll() is None:
        maintain(out)
        runs += 1
    assert publisher.returncode == 0, publisher.stderr.read() if publisher.stderr else ""
    dt = joined(out)
    history = dt.history()
    rebased = [h for h in history if h["operation"] == "OPTIMIZE" and h["readVersion"] < h["version"] - 1]
    assert rebased and runs > 1, [(h["version"], h["operation"], h.get("readVersion")) for h in history]
    got = Counter(dt.to_pyarrow_dataset().to_table(columns=["batch"])["batch"].to_pylist())
    assert got == {k: 5 for k in range(1, 301)}
    ids = click_ids(dt)
    assert len(ids) == len(set(ids)) == 1500 and dt.transaction_version("photon/dc-a") == 300


def test_the_maintenance_dag_maintains_every_pipeline(tmp_path: Path, airflow_db: str, monkeypatch: Any) -> None:
    from airflow.dag_processing.dagbag import DagBag

    out = tmp_path / "out"
    publish(out / "dc-a", range(1, 11))
    publish(out / "backfill-dc-b-202601010000", range(1, 6))
    monkeypatch.setenv("AIRFLOW_VAR_PHOTON_OUT", str(out))
    run = DagBag(dag_folder=str(ROOT / "dags")).dags["photon_table_maintenance"].test()
    assert {ti.task_id: str(ti.state) for ti in run.get_task_instances()} == {"maintain_tables": "success"}
    assert len(joined(out).file_uris()) == 2 and len(joined(out, "backfill-dc-b-202601010000").file_uris()) == 2
    assert joined(out, "backfill-dc-b-202601010000").transaction_version("photon/backfill-dc-b-202601010000") == 5


# -- The key guarantee, with real processes -----------------------------------------------------------------------


def publish_until(root: Path, stop: Path, last: Path) -> None:
    """What a lease's driver does to its tables, batch after batch (staged by "tasks", then published under the batch's
    txn), until ``stop`` exists; the last batch's number is written to ``last``."""
    tables.ensure_tables(root)
    k = 0
    while not stop.exists():
        k += 1
        stage(root, k, 5)
        publish_files(root, root.name, k, 1)
    last.write_text(str(k))


def appended_after_compaction(out: Path, pipeline: str) -> bool:
    ops = [h["operation"] for h in reversed(joined(out, pipeline).history())]
    return "OPTIMIZE" in ops and "WRITE" in ops[ops.index("OPTIMIZE") :]


def test_maintenance_killed_and_racing_two_publishing_pipelines_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    """Two pipelines' publishers (processes) commit batch after batch while `photon table maintain` runs two at a time,
    again and again, some runs SIGKILLed part-way (seeded). It goes on until, in both tables, an append committed after
    a compaction and runs were killed; then every batch of each pipeline is in its table once, whole, and the txn
    version is its last batch. (The nemesis runs the same maintenance beside real `photon join` leases.)"""
    rng = random.Random(2611291)
    out, stop = tmp_path / "out", tmp_path / "stop"
    pipelines = ("dc-a", "dc-b")
    publishers = []
    for dc in pipelines:
        args = f"Path({str(out / dc)!r}), Path({str(stop)!r}), Path({str(tmp_path / (dc + '.last'))!r})"
        code = f"from pathlib import Path; from {__name__} import publish_until; publish_until({args})"
        publishers.append(subprocess.Popen([sys.executable, "-c", code], env=env(), cwd=ROOT, stderr=subprocess.PIPE))
    reports: list[dict[str, Any]] = []
    killed, deadline = 0, time.monotonic() + 300
    try:
        while not all((out / dc / JOINED).is_dir() for dc in pipelines):
            time.sleep(0.1)
        while time.monotonic() < deadline:
            if killed >= 2 and len(reports) >= 4 and all(appended_after_compaction(out, dc) for dc in pipelines):
                break
            assert all(p.poll() is None for p in publishers), [p.stderr.read() for p in publishers if p.stderr]
            runs = [maintain_process(out) for _ in range(2)]
            if rng.random() < 0.4:  # killed wherever it is: importing, waiting for the lock, compacting, vacuuming
                time.sleep(rng.uniform(0.5, 4.0))
                runs[0].kill()
            for p in runs:
                o, e = p.communicate(timeout=300)
                if p.returncode == -signal.SIGKILL:
                    killed += 1
                    continue
                assert p.returncode == 0, e
                reports.append(json.loads(o))
    finally:
        stop.touch()
        for p in publishers:
            p.wait(timeout=120)
    for p in publishers:
        assert p.returncode == 0, p.stderr.read() if p.stderr else ""
    assert killed >= 2 and all(appended_after_compaction(out, dc) for dc in pipelines), (killed, reports)
    assert sum(t["files_compacted"] for r in reports for t in r["tables"]) > 0, reports
    final = maintain(out)  # once more, with nobody appending
    for dc in pipelines:
        last = int((tmp_path / f"{dc}.last").read_text())
        dt = joined(out, dc)
        got = Counter(dt.to_pyarrow_dataset().to_table(columns=["batch"])["batch"].to_pylist())
        assert got == {k: 5 for k in range(1, last + 1)} and last > 5, dc
        want = [i for k in range(1, last + 1) for i in rows(dc, k, 5)["click_id"].to_pylist()]
        assert sorted(click_ids(dt)) == sorted(want)  # the very rows, each once
        assert dt.transaction_version(f"photon/{dc}") == last
    # Maintenance with nobody appending leaves one file per hour.
    for t in (t for t in final.tables if t.kind == JOINED):
        hours = pc.unique(DeltaTable(str(out / t.pipeline / t.kind)).to_pyarrow_table(columns=["hour"])["hour"])
        assert t.after.files == len(hours) == 2, t
