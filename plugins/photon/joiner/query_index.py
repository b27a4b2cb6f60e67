"""The shared query index of a data center, and the registry's horizon that bounds every EventStore.

A live pipeline's EventStore holds every query it has seen since it started, so a click finds its query however long
after it comes, up to the registry's horizon. A backfill of one window reads only its own window's files; so that it
joins every click the live pipeline would have, it also looks up the data center's shared query index:

    <out>/_query_index/<dc>/bucket=<n>/<YYYYmmddHHMM>.arrow     index rows of one sealed arrival partition
    <out>/_query_index/<dc>/_done/<YYYYmmddHHMM>                written last: that partition is wholly indexed

in the EventStore's own index format (``EventStoreCache`` reads it as it is; its rows name the log files under
``<logs>/<dc>/queries``). A sealed partition never changes (EVENTS.md), so it is parsed once, by whichever backfill
first needs it, in Spark tasks; later backfills find its done-marker and parse nothing. Two backfills indexing the
same partition at once write the same files under the same names, each whole (a store's put): the second replaces
a file with an identical one, and a lookup that sees part of a partition only misses queries it
would not have found at all.

The horizon (EVENTS.md): the registry forgets click ids below its GC threshold, so the lowest threshold over the
shards is the horizon; before GC first runs, the default retention (plus the maximum clock skew, as GC computes it)
before the registry server's clock. An EventStore keeps queries stamped at or after the horizon minus the maximum
clock skew (``prune``); a click whose query is older than the horizon is unjoinable with ``REASON_QUERY_GC``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from photon.logs.layout import SEAL_S, list_closed, partition_of, sealed_before
from photon.settings import MAX_CLOCK_SKEW_S, MAX_FUTURE_S, PLAUSIBLE_FROM_US
from photon.storage import Store, as_store, cached_store

log = logging.getLogger(__name__)
US = 1_000_000
INDEX_DIR = "_query_index"  # under <out>: its leading "_" keeps every reader of pipeline folders away from it
DONE_DIR = "_done"
REASON_QUERY_GC = (
    "its query is older than the registry's garbage-collection horizon (query logs and the EventStore are kept only "
    "that long)"
)
BUILT = pa.schema([("part", pa.string()), ("files", pa.int64()), ("queries", pa.int64())])


def index_root(out: Path | Store, dc: str) -> Store:
    """The data center's shared query index in the output ``out`` (a folder or a store)."""
    return as_store(out).child(f"{INDEX_DIR}/{dc}")


def registry_horizon_us(
    servers: Mapping[str, str], retention_s: float | None = None, max_clock_skew_s: float = MAX_CLOCK_SKEW_S
) -> tuple[int, int]:
    """(horizon, the main server's clock), both in epoch microseconds. The horizon is the lowest GC threshold over
    every shard when GC has run on all of them, else ``retention_s`` (GC's default) plus the maximum clock skew before
    the main server's clock. Needs only what the joiner's role may read (``shard_state``, ``clock_us()``)."""
    from photon.pg import autocommit
    from photon.registry import sql as q
    from photon.registry.admin import server_clock_us
    from photon.registry.client import MAIN, read_layout
    from photon.registry.gc import DEFAULT_RETENTION_S, gc_target_us

    layout, _ = read_layout(servers[MAIN])
    by_server: dict[str, list[Any]] = {}
    for ref in layout.shards():
        by_server.setdefault(layout.server_of(ref), []).append(ref)
    thresholds = []
    for server, refs in sorted(by_server.items()):
        with autocommit(servers[server]) as conn, conn.cursor() as cur:
            for ref in refs:
                cur.execute(q.READ_THRESHOLD, (ref.version, ref.shard_no))
                row = cur.fetchone()
                thresholds.append(int(row[0]) if row is not None else 0)
    now = server_clock_us(servers[MAIN])
    lowest = min(thresholds, default=0)
    if lowest > 0:
        return lowest, now
    retention = DEFAULT_RETENTION_S if retention_s is None else retention_s
    return gc_target_us(now, retention, max_clock_skew_s), now


def keep_from_us(horizon_us: int, max_clock_skew_s: float = MAX_CLOCK_SKEW_S) -> int:
    """The oldest query time an EventStore keeps: the horizon minus the maximum clock skew (a click may be stamped
    up to the skew before its query)."""
    return horizon_us - int(max_clock_skew_s * US)


@dataclass
class Pruned:
    buckets: int = 0
    files: int = 0
    bytes: int = 0
    done_markers: int = 0


def prune(where: Path | Store, horizon_us: int, bucket_s: int, max_clock_skew_s: float = MAX_CLOCK_SKEW_S) -> Pruned:
    """Remove the ``bucket=<n>`` folders of an EventStore (a pipeline's ``_state/eventstore`` or a shared index)
    whose every query is stamped before ``keep_from_us(horizon_us)``, and a shared index's done-markers of partitions
    that can hold no query at or after it (a file arrives at most the skew before its first event). Safe beside
    lookups: a worker's cache drops the files it finds gone (``EventStoreCache._bucket``); an open memory map stays
    readable until it is let go."""
    out = Pruned()
    store = as_store(where)
    keep_us = keep_from_us(horizon_us, max_clock_skew_s)
    first_kept = keep_us // (bucket_s * US)  # the bucket holding keep_us is kept whole
    for name in store.folders():
        if not name.startswith("bucket="):
            continue
        try:
            b = int(name.removeprefix("bucket="))
        except ValueError:
            continue
        if b >= first_kept:
            continue
        for e in store.listing(name):
            out.files += 1
            out.bytes += e.size
        store.remove_all(name)
        out.buckets += 1
    last_gone = partition_of(keep_us - int(max_clock_skew_s * US))  # partitions before it end too early
    for e in store.files(DONE_DIR):
        marker = e.key.rpartition("/")[2]
        if len(marker) == 12 and marker.isdigit() and f"{marker[:8]}/{marker[8:]}" < last_gone:
            store.delete(e.key)
            out.done_markers += 1
    return out


def partitions_to_index(queries: Path | Store, first: str, last: str, sealed: str) -> list[tuple[str, list[str]]]:
    """The arrival partitions of ``queries`` (``<logs>/<dc>/queries``, a folder or a store) from ``first`` to
    ``last`` (inclusive) that are sealed (before ``sealed``), each with its closed files' names. Lists from ``first``
    on only."""
    found: dict[str, list[str]] = {}
    for f in list_closed(queries, first):
        if f.part is None:
            continue
        if f.part > last or f.part >= sealed:
            break  # oldest first: nothing later is in range
        found.setdefault(f.part, []).append(f.rel)
    return [(part, sorted(names)) for part, names in found.items()]


def marker_name(part: str) -> str:
    return part.replace("/", "")


def indexed(root: Path | Store) -> set[str]:
    """The partitions whose done-marker is there."""
    markers = [e.key.rpartition("/")[2] for e in as_store(root).files(DONE_DIR)]
    return {f"{m[:8]}/{m[8:]}" for m in markers if len(m) == 12}


def _index_task(
    queries: str, root: str, parts: list[tuple[str, list[str]]], bucket_s: int, now_us: int, max_future_s: float
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """One Spark task per group of partitions: parse every file of a partition (as a batch's first stage does; bad
    lines are skipped here, a pipeline that consumes the file quarantines them), index its plausible queries by
    bucket, then write its done-marker."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from photon.joiner.eventstore import index_of, write_index
        from photon.logs.parse import parse_file_located

        limit = now_us + int(max_future_s * US)
        for batch in batches:
            for i in batch.column("id").to_pylist():
                part, files = parts[i]
                tables = []
                store = cached_store(queries)
                for rel in files:
                    try:
                        content = store.get(rel)  # a named pipe in a folder: an error, no hang
                    except OSError as exc:
                        if store.atomic and not isinstance(exc, FileNotFoundError):
                            raise  # an object store that failed: the task fails, nothing is marked indexed
                        log.error("query index: %s/%s not indexed: %s", queries, rel, exc)
                        continue
                    try:
                        good, _, offsets, lengths = parse_file_located(rel, content, "queries")
                    except Exception as exc:  # a file gone or a parser bug: the partition is indexed without it
                        log.error("query index: %s/%s not indexed: %r", queries, rel, exc)
                        continue
                    ts = good.column("ts_us").to_numpy()
                    ok = (ts <= limit) & (ts >= PLAUSIBLE_FROM_US)
                    if not ok.all():
                        good, offsets, lengths = good.filter(pa.array(ok)), offsets[ok], lengths[ok]
                    if good.num_rows:
                        tables.append(index_of(good, rel, offsets, lengths))
                rows = 0
                if tables:
                    table = pa.concat_tables(tables)
                    rows = table.num_rows
                    write_index(table, cached_store(root), "", marker_name(part), bucket_s)
                # Last: a partition with a marker is wholly indexed, and never parsed again.
                cached_store(root).put(f"{DONE_DIR}/{marker_name(part)}", f"{rows}\n".encode())
                yield pa.RecordBatch.from_pydict({"part": [part], "files": [len(files)], "queries": [rows]}, BUILT)

    return run


def ensure_indexed(
    spark: Any,
    queries: Path | Store,
    root: Path | Store,
    *,
    first: str,
    last: str,
    now_us: int,
    bucket_s: int,
    parallelism: int,
    seal_s: float = SEAL_S,
    max_future_s: float = MAX_FUTURE_S,
) -> dict[str, int]:
    """Index every sealed query partition from ``first`` to ``last`` that has no done-marker yet, in Spark tasks (a
    partition per task row, spread over ``parallelism`` slices). Returns what it did: partitions in range, already
    indexed, indexed now, files and queries parsed now."""
    from pyspark.sql.pandas.types import from_arrow_schema

    in_range = partitions_to_index(queries, first, last, sealed_before(now_us, seal_s))
    done = indexed(root)
    todo = [(p, files) for p, files in in_range if p not in done]
    stats = {"partitions": len(in_range), "already": len(in_range) - len(todo), "indexed": 0, "files": 0}
    stats["queries"] = 0
    if todo:
        n = len(todo)
        rows = (
            spark.range(0, n, 1, max(1, min(n, parallelism)))
            .mapInArrow(
                _index_task(as_store(queries).url, as_store(root).url, todo, bucket_s, now_us, max_future_s),
                from_arrow_schema(BUILT),
            )
            .collect()
        )
        stats["indexed"] = len(rows)
        stats["files"] = sum(int(r["files"]) for r in rows)
        stats["queries"] = sum(int(r["queries"]) for r in rows)
    return stats


def index_range(
    window_end_us: int, horizon_us: int, after_end_s: float, max_clock_skew_s: float = MAX_CLOCK_SKEW_S
) -> tuple[str, str]:
    """The arrival partitions a window's clicks may find their queries in: from the one the oldest query kept can
    have arrived in (a file arrives at most the clock skew before its first event; a late click's query may be
    anywhere back to the horizon) to ``after_end_s`` after the window's end (the maximum join delay and margins: a
    click's query reaches the logs at most that long after the click)."""
    first = partition_of(keep_from_us(horizon_us, max_clock_skew_s) - int(max_clock_skew_s * US))
    last = partition_of(window_end_us + int(after_end_s * US))
    return first, last
