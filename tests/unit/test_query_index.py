"""The EventStore pruned behind the registry's horizon (query_index.prune): files of buckets older than the horizon
minus the clock skew are removed, a recent query still hits, and a worker's cache drops what was pruned; the shared
index lists only sealed partitions in range."""

from __future__ import annotations

from pathlib import Path

from photon.joiner.eventstore import EventStoreCache
from photon.joiner.query_index import DONE_DIR, indexed, keep_from_us, partitions_to_index, prune
from photon.logs.layout import partition_of

from .test_eventstore import BUCKET_S, T0, ids, store_queries

US = 1_000_000


def test_prune_removes_buckets_behind_the_horizon_and_the_cache_drops_them(tmp_path: Path) -> None:
    logs, store = tmp_path / "logs", tmp_path / "store"
    old, edge, recent = T0, T0 + 100 * US, T0 + 3_600 * US
    horizon = edge + 10 * US  # keep_from = edge: the bucket holding it is kept whole
    store_queries(logs, store, "b1-q0", [old, old + 1])
    store_queries(logs, store, "b2-q0", [edge])
    store_queries(logs, store, "b3-q0", [recent])
    cache = EventStoreCache(store, logs, max_buckets=10)
    _, found, _ = cache.lookup(ids([old, edge, recent]), BUCKET_S)
    assert found.tolist() == [True, True, True]
    files_before = sorted(p.relative_to(store) for p in store.rglob("*.arrow"))

    pruned = prune(store, horizon, BUCKET_S)

    assert keep_from_us(horizon) == edge
    left = sorted(p.relative_to(store) for p in store.rglob("*.arrow"))
    assert (pruned.buckets, pruned.files) == (1, 1) and pruned.bytes > 0
    assert left == [f for f in files_before if not str(f).startswith(f"bucket={old // (BUCKET_S * US)}/")]
    # The resident cache drops the pruned file (and only it): the old query misses, the others still hit.
    queries, found, stats = cache.lookup(ids([old, edge, recent]), BUCKET_S)
    assert found.tolist() == [False, True, True] and stats.files_read == 0
    assert queries.column("ts_us").to_pylist()[1:] == [edge, recent]
    assert not cache.buckets[old // (BUCKET_S * US)].files
    assert prune(store, horizon, BUCKET_S).buckets == 0  # idempotent


def test_shared_index_lists_sealed_partitions_in_range_and_prunes_their_markers(tmp_path: Path) -> None:
    queries = tmp_path / "queries"
    parts = [partition_of(T0 + m * 60 * US) for m in range(5)]
    for p in parts:
        (queries / p).mkdir(parents=True)
        (queries / p / "10.0.0.1-1-1.jsonl").write_bytes(b"")
        (queries / p / "10.0.0.1-1-2.jsonl.inprogress").write_bytes(b"")
    found = partitions_to_index(queries, parts[1], parts[4], sealed=parts[3])
    assert found == [(p, [f"{p}/10.0.0.1-1-1.jsonl"]) for p in parts[1:3]]  # parts[3] and later: not sealed yet

    root = tmp_path / "index"
    (root / DONE_DIR).mkdir(parents=True)
    for p in parts:
        (root / DONE_DIR / p.replace("/", "")).write_text("0\n")
    assert indexed(root) == set(parts)
    # A partition ending more than the skew before the oldest query kept holds none of them: its marker goes.
    pruned = prune(root, T0 + 3 * 60 * US + 20 * US, BUCKET_S)
    assert pruned.done_markers == 3 and indexed(root) == set(parts[3:])
