"""The nemesis checker finds what it must: rows planted in Delta tables written here with deltalake alone (no project
code), each wrong one way. A checker that finds nothing when the output is wrong passes every chaos run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

from tests.nemesis.checker import _snapshots, duplicates, wrong_batches, wrong_hours

US = 1_000_000
T = 1_790_000_000 * US  # 2026-09-21 14:13:20 UTC


def write(out: Path, pipeline: str, rows: list[tuple[str, int, str, int]], batch: int) -> None:
    """Append (click id, click time, hour, batch) rows to ``pipeline``'s joined table under txn version ``batch``."""
    cid, ts, hour, b = (list(c) for c in zip(*rows, strict=True))
    t = pa.table({"click_id": cid, "query_id": ["q"] * len(cid), "click_ts_us": ts, "hour": hour, "batch": b})
    props = CommitProperties(app_transactions=[Transaction(f"photon/{pipeline}", batch)])
    write_deltalake(str(out / pipeline / "joined"), t, mode="append", partition_by=["hour"], commit_properties=props)


def test_the_checker_finds_a_wrong_hour_a_wrong_batch_and_a_duplicate_and_ignores_uncommitted_files(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    write(out, "dc-a", [("c1", T, "2026092114", 1), ("c2", T, "2026092115", 1)], batch=1)  # c2: the next hour
    write(out, "dc-a", [("c3", T, "2026092114", 2), ("c4", T, "2026092114", 9)], batch=2)  # c4: batch 9 unpublished
    write(out, "dc-b", [("c5", T, "2026092114", 1), ("c1", T, "2026092114", 1)], batch=1)  # c1 again, other pipeline
    write(out, "dc-b", [("c6", T - 3600 * US, "2026092113", 0)], batch=2)  # batch 0: no batch has that number
    # A crashed batch's data file sits in the table folder, named by no commit: never read.
    part = next((out / "dc-a" / "joined" / "hour=2026092114").glob("*.parquet"))
    shutil.copy(part, part.with_name("crashed-batch-3.parquet"))
    snapshots = _snapshots(out, "joined", "click_id", "click_ts_us", "hour", "batch")
    assert [(p, last) for p, last, _ in snapshots] == [("dc-a", 2), ("dc-b", 2)]
    assert wrong_hours([(c, ts, h) for _, _, rows in snapshots for c, ts, h, _ in rows]) == ["c2"]
    assert wrong_batches([(p, last, [(r[0], r[3]) for r in rows]) for p, last, rows in snapshots]) == ["c4", "c6"]
    assert duplicates(out) == ["c1"]
    # The uncommitted copy would have made every row of that file a duplicate.
    assert sum(len(rows) for _, _, rows in snapshots) == 7
    assert DeltaTable(str(out / "dc-a" / "joined")).version() == 1
