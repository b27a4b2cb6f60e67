"""The EventStore: primary events (queries) kept by time bucket, so a lookup knows where to look from the query id.

Storage (Photon's LogsEventStore) is Parquet under ``<pipeline>/_state/eventstore/bucket=<n>/<batch tag>-q<i>.parquet``:
a batch stages its new queries under its own staging folder and moves them there, under the same file name, once the
batch is committed. The cache (Photon's CacheEventStore) lives in the Spark executors' Python workers, which the
session keeps alive across micro-batches: each worker holds the most recently used buckets in memory and, on every
lookup, lists the bucket's folders and reads only the files it has not seen. A lookup whose bucket was resident is a
hit; a bucket that has to be read from storage is a miss. Files that vanished (a staged batch that never committed)
are dropped from the cache, so a lookup never sees queries of an uncommitted batch other than its own. A batch's own
staged files are cached under their names too: they keep them when the batch commits and they move into storage.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from photon.durable import CorruptStateError, write_durably
from photon.ids import valid_ids

US = 1_000_000
RECOVER_STORE = (
    "It was synced before its batch committed, so it was damaged since. Restore it from a backup of the output "
    "folder, or move it aside (mv FILE FILE.corrupt): the pipeline then goes on, and a click whose query was only in "
    "it becomes unjoinable here (the other data center's pipeline can still join it)."
)
STORED_COLUMNS = ["query_id", "ts_us", "user_id", "query_text", "country", "ads"]


def bucket_of(ts_us: np.ndarray, bucket_s: int) -> np.ndarray:
    return np.floor_divide(ts_us, bucket_s * US)


@dataclass
class _Bucket:
    files: dict[str, pa.Table] = field(default_factory=dict)  # file name -> its queries
    table: pa.Table | None = None  # all files as one chunked table (rebuilt when the set changes)


@dataclass
class LookupStats:
    lookups: int = 0
    hits: int = 0  # lookups whose bucket was already in memory
    files_read: int = 0


class EventStoreCache:
    """Per-process cache of stored buckets for one pipeline's EventStore."""

    def __init__(self, root: Path, max_buckets: int, max_rows: int = 5_000_000):
        self.root = root
        self.max_buckets = max(1, max_buckets)
        self.max_rows = max(1, max_rows)  # memory bound: at 100k queries/s, 30 minutes would not fit in a worker
        self.buckets: OrderedDict[int, _Bucket] = OrderedDict()

    def lookup(
        self, query_ids: pa.Array, bucket_s: int, staged: Path | None = None
    ) -> tuple[pa.Table, np.ndarray, LookupStats]:
        """(queries, found, stats): row i of ``queries`` is the query of ``query_ids[i]`` where ``found[i]``.
        ``staged`` is the running batch's own staged store: its files are cached under their names, which they keep
        when the batch is committed and moved into the store."""
        stats = LookupStats(lookups=len(query_ids))
        valid, ts = valid_ids(query_ids)
        of = bucket_of(ts, bucket_s)
        tables = []
        for b in np.unique(of[valid]).tolist():
            resident = b in self.buckets
            table = self._bucket(int(b), staged, stats)
            if resident:
                stats.hits += int(np.count_nonzero(valid & (of == b)))
            if table is not None:
                tables.append(table)
        if not tables:
            return _nulls(len(query_ids)), np.zeros(len(query_ids), bool), stats
        pool = pa.concat_tables(tables)  # zero-copy: one chunk per file
        # Hash the batch's few distinct query ids and probe the buckets' ids with them (not the other way round:
        # a bucket holds far more queries than a batch has clicks).
        wanted = pc.unique(query_ids)
        probe = pc.index_in(pool.column("query_id"), value_set=wanted)
        pool_rows = np.flatnonzero(pc.is_valid(probe).to_numpy(zero_copy_only=False))
        wanted_pos = pc.drop_null(probe).to_numpy(zero_copy_only=False) if len(pool_rows) else np.zeros(0, np.int64)
        row_of = np.full(len(wanted), -1, np.int64)
        uniq, first = np.unique(wanted_pos, return_index=True)  # the first stored copy of each query
        row_of[uniq] = pool_rows[first]
        rows = row_of[pc.index_in(query_ids, value_set=wanted).to_numpy(zero_copy_only=False)]
        found = (rows >= 0) & valid
        return pool.take(pa.array(np.where(found, rows, 0))), found, stats

    def _bucket(self, b: int, staged: Path | None, stats: LookupStats) -> pa.Table | None:
        names = {}
        for root in (self.root, staged):
            folder = root / f"bucket={b}" if root is not None else None
            if folder is not None and folder.is_dir():
                names.update({n: folder / n for n in os.listdir(folder) if n.endswith(".parquet")})
        entry = self.buckets.pop(b, None) or _Bucket()
        self.buckets[b] = entry  # most recently used last
        changed = False
        for gone in set(entry.files) - set(names):
            del entry.files[gone]
            changed = True
        for name in sorted(names):
            if name not in entry.files:
                try:
                    entry.files[name] = pq.read_table(names[name], columns=STORED_COLUMNS)
                except (pa.ArrowInvalid, OSError) as exc:
                    raise CorruptStateError(f"{names[name]} cannot be read ({exc}). {RECOVER_STORE}") from None
                stats.files_read += 1
                changed = True
        if changed or entry.table is None:
            # Zero-copy: a chunk per file. Only the id column is ever combined, for the hash lookup.
            entry.table = pa.concat_tables(entry.files.values()) if entry.files else None
        while len(self.buckets) > 1 and (len(self.buckets) > self.max_buckets or self.rows() > self.max_rows):
            self.buckets.popitem(last=False)  # least recently used first; the bucket just read stays
        return entry.table

    def rows(self) -> int:
        return sum(b.table.num_rows for b in self.buckets.values() if b.table is not None)


def _nulls(n: int) -> pa.Table:
    from photon.parse import QUERY_FIELDS

    return pa.table({f.name: pa.nulls(n, f.type) for f in QUERY_FIELDS}, schema=QUERY_FIELDS)


_CACHES: dict[str, EventStoreCache] = {}


def cache_for(root: Path, max_buckets: int, max_rows: int = 5_000_000) -> EventStoreCache:
    """The process's cache for one pipeline's store (Python workers are reused across tasks and batches)."""
    key = str(root)
    cache = _CACHES.get(key)
    if cache is None or (cache.max_buckets, cache.max_rows) != (max_buckets, max_rows):
        _CACHES[key] = EventStoreCache(root, max_buckets, max_rows)
    return _CACHES[key]


def write_queries(queries: pa.Table, folder: Path, name: str, bucket_s: int) -> dict[int, int]:
    """Store one file's queries by bucket under ``folder/bucket=<n>/<name>.parquet``; {bucket: rows}."""
    buckets = bucket_of(queries.column("ts_us").to_numpy(), bucket_s)
    written = {}
    for b in np.unique(buckets).tolist():
        part = queries.filter(pa.array(buckets == b))
        atomic_write(part, folder / f"bucket={b}" / f"{name}.parquet")
        written[int(b)] = part.num_rows
    return written


def atomic_write(table: pa.Table, path: Path) -> None:
    """Write a Parquet file whole or not at all, and durably (photon.durable): every file a batch commits."""
    write_durably(path, lambda fh: pq.write_table(table, fh))
