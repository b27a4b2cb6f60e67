"""The EventStore cache: finds stored and staged queries, reads each file once, forgets what was never committed."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pyarrow as pa

from photon.eventstore import EventStoreCache, write_queries
from photon.parse import QUERY_FIELDS

T0 = 1_763_700_000_000_000
BUCKET_S = 10


def queries(ts: list[int], text: str = "q") -> pa.Table:
    return pa.Table.from_pylist(
        [
            {
                "query_id": f"10.0.0.1-7-{t}",
                "ts_us": t,
                "user_id": "u",
                "query_text": f"{text}{t}",
                "country": "DE",
                "ads": [{"ad_id": "a", "advertiser_id": "x", "bid_micros": 1}],
            }
            for t in ts
        ],
        schema=QUERY_FIELDS,
    )


def ids(ts: list[int]) -> pa.Array:
    return pa.array([f"10.0.0.1-7-{t}" for t in ts], pa.string())


def test_lookup_hits_staged_files_and_forgets_uncommitted(tmp_path: Path) -> None:
    store, stage = tmp_path / "store", tmp_path / "stage"
    a, b = T0, T0 + 15_000_000  # two buckets
    write_queries(queries([a, a + 1]), store, "b1-q0", BUCKET_S)
    write_queries(queries([b]), stage, "b2-q0", BUCKET_S)
    cache = EventStoreCache(store, max_buckets=4)

    found_q, found, stats = cache.lookup(ids([a, b, a + 5, a + 1]), BUCKET_S, stage)
    assert found.tolist() == [True, True, False, True]
    assert found_q.column("query_text").to_pylist()[:2] == [f"q{a}", f"q{b}"]
    assert (stats.lookups, stats.hits, stats.files_read) == (4, 0, 2)

    # The batch commits: its staged file moves into the store under the same name; nothing is read again.
    folder = f"bucket={b // (BUCKET_S * 1_000_000)}"
    os.makedirs(store / folder, exist_ok=True)
    shutil.move(stage / folder / "b2-q0.parquet", store / folder / "b2-q0.parquet")
    _, found, stats = cache.lookup(ids([a, b]), BUCKET_S, tmp_path / "next-stage")
    assert found.tolist() == [True, True] and (stats.hits, stats.files_read) == (2, 0)

    # A batch that never commits: its staged queries are seen by that batch only.
    write_queries(queries([a + 2]), stage, "b3-q0", BUCKET_S)
    assert cache.lookup(ids([a + 2]), BUCKET_S, stage)[1].tolist() == [True]
    shutil.rmtree(stage)
    assert cache.lookup(ids([a + 2]), BUCKET_S, tmp_path / "b4")[1].tolist() == [False]


def test_duplicates_invalid_ids_and_eviction(tmp_path: Path) -> None:
    store = tmp_path / "store"
    write_queries(queries([T0], "first"), store, "b1-q0", BUCKET_S)
    write_queries(queries([T0], "second"), store, "b2-q0", BUCKET_S)
    cache = EventStoreCache(store, max_buckets=2)
    q, found, _ = cache.lookup(pa.array([f"10.0.0.1-7-{T0}", "not-an-id", None], pa.string()), BUCKET_S)
    assert found.tolist() == [True, False, False]
    assert q.column("query_text")[0].as_py() == f"first{T0}"
    for i in range(1, 4):  # three more buckets: the oldest is evicted
        write_queries(queries([T0 + i * 10_000_000]), store, f"b{i + 2}-q0", BUCKET_S)
        cache.lookup(ids([T0 + i * 10_000_000]), BUCKET_S)
    assert len(cache.buckets) == 2
    _, found, stats = cache.lookup(ids([T0]), BUCKET_S)
    assert found.tolist() == [True] and stats.hits == 0 and stats.files_read == 2


def test_row_bound_evicts_least_recently_used_buckets(tmp_path: Path) -> None:
    store = tmp_path / "store"
    for i in range(3):
        write_queries(queries([T0 + i * 10_000_000 + j for j in range(10)]), store, f"b{i}-q0", BUCKET_S)
    cache = EventStoreCache(store, max_buckets=10, max_rows=25)
    for i in range(3):
        assert cache.lookup(ids([T0 + i * 10_000_000]), BUCKET_S)[1].tolist() == [True]
    assert len(cache.buckets) == 2 and cache.rows() == 20  # the oldest bucket went to keep 25 rows at most
