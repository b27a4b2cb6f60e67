"""The EventStore: where each primary event (query) is, kept by time bucket, so a lookup knows where to look from the
query id alone.

As Photon's LogsEventStore, it stores an index, not the queries: per query its id, its time, and where its line is in
the logs (file, byte offset, length). The logs keep every line (closed files never change, EVENTS.md), so a lookup
reads just the lines of the queries its clicks want and parses them again. A batch's first stage parses every query
line anyway (every line must become an event or a quarantine record), so storing the index costs about 50 bytes per
query instead of a copy of every query, and a lookup reads a few lines instead of whole buckets of queries.

Storage is Arrow IPC files under ``<pipeline>/_state/eventstore/bucket=<n>/<batch tag>-q<i>.arrow`` (in a folder,
memory-mapped when read; in an object store, read whole): a batch stages its index under its own staging folder and
moves it there, under the same file name, once the batch is committed. The cache (Photon's CacheEventStore) lives in the
Spark executors' Python workers, which the session keeps alive across micro-batches: each worker holds the most recently
used buckets' indexes in memory and, on every lookup, lists the bucket's folders and reads only the files it has not
seen. A lookup whose bucket was resident is a hit; a bucket that has to be read from storage is a miss. Files that
vanished (a staged batch that never committed) are dropped from the cache, so a lookup never sees queries of an
uncommitted batch other than its own. A batch's own staged files are cached under their names too: they keep them when
the batch commits.

Stores written before the index (``.parquet`` files holding whole queries) are still read.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from photon.durable import CorruptStateError
from photon.logs.ids import valid_ids
from photon.storage import LocalStore, StorageError, Store, as_store, cached_store, in_flight, locate

log = logging.getLogger(__name__)
US = 1_000_000
RECOVER_STORE = (
    "It was synced before its batch committed, so it was damaged since. Restore it from a backup of the output "
    "folder, or move it aside (mv FILE FILE.corrupt): the pipeline then goes on, and a click whose query was only in "
    "it becomes unjoinable here (the other data center's pipeline can still join it)."
)
INDEX = pa.schema(
    [
        ("query_id", pa.string()),
        ("ts_us", pa.int64()),
        ("file", pa.dictionary(pa.int32(), pa.string())),  # the log file's name under queries/ (EVENTS.md)
        ("offset", pa.int64()),  # of the line's first byte
        ("length", pa.int64()),  # of the line, without its newline
    ]
)
INDEX_SUFFIX, LEGACY_SUFFIX = ".arrow", ".parquet"
FETCH_AHEAD = 4  # query objects a lookup reads at once on an object store
STORED_COLUMNS = ["query_id", "ts_us", "user_id", "query_text", "country", "ads"]  # a legacy file's columns


def bucket_of(ts_us: np.ndarray, bucket_s: int) -> np.ndarray:
    return np.floor_divide(ts_us, bucket_s * US)


def index_of(queries: pa.Table, file: str, offsets: np.ndarray, lengths: np.ndarray) -> pa.Table:
    """The index rows of one log file's queries (row i's line starts at ``offsets[i]``)."""
    n = queries.num_rows
    return pa.table(
        {
            "query_id": queries.column("query_id"),
            "ts_us": queries.column("ts_us"),
            "file": pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), pa.array([file], pa.string())),
            "offset": pa.array(offsets, pa.int64()),
            "length": pa.array(lengths, pa.int64()),
        },
        schema=INDEX,
    )


@dataclass
class _Bucket:
    files: dict[str, pa.Table] = field(default_factory=dict)  # index file name -> its rows
    legacy: dict[str, pa.Table] = field(default_factory=dict)  # legacy file name -> its queries
    table: pa.Table | None = None  # all index files as one chunked table (rebuilt when the set changes)
    legacy_table: pa.Table | None = None


@dataclass
class LookupStats:
    lookups: int = 0
    hits: int = 0  # lookups whose bucket was already in memory (or, in a join task, whose query was shipped)
    shipped: int = 0  # of those, in a join task: the query shipped with the click (tasks.Wanted)
    files_read: int = 0  # store files read
    lines_read: int = 0  # query lines read back from the logs
    lines_missing: int = 0  # indexed lines that could not be read back as their query (a log file gone or changed)
    # Per requested id: indexed, but no stored copy read back (its log files removed or changed since).
    unreadable: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))


class EventStoreCache:
    """Per-process cache of stored buckets for one pipeline's EventStore, over one data center's query logs."""

    def __init__(
        self, root: Path | str | Store, logs: Path | str | Store, max_buckets: int, max_rows: int = 20_000_000
    ):
        # The store's folder (a pipeline's _state/eventstore, a shared index), a folder or an object store
        self.root = cached_store(root) if isinstance(root, str) else as_store(root)
        # <logs>/<dc>/queries, a folder or a store: index rows name their files relative to it
        self.logs = cached_store(logs) if isinstance(logs, str) else as_store(logs)
        self.max_buckets = max(1, max_buckets)
        self.max_rows = max(1, max_rows)  # memory bound, at about 60 bytes per indexed query
        self.buckets: OrderedDict[int, _Bucket] = OrderedDict()

    def lookup(
        self, query_ids: pa.Array, bucket_s: int, staged: tuple[Store, str] | Path | None = None
    ) -> tuple[pa.Table, np.ndarray, LookupStats]:
        """(queries, found, stats): row i of ``queries`` is the query of ``query_ids[i]`` where ``found[i]``.
        ``staged`` is the running batch's own staged store (a store and the folder's key in it, or a path): its
        files are cached under their names, which they keep when the batch is committed and moved into the store."""
        from photon.logs.parse import QUERY_FIELDS

        stats = LookupStats(lookups=len(query_ids), unreadable=np.zeros(len(query_ids), bool))
        valid, ts = valid_ids(query_ids)
        of = bucket_of(ts, bucket_s)
        index, legacy = [], []
        for b in np.unique(of[valid]).tolist():
            resident = b in self.buckets
            entry = self._bucket(int(b), staged, stats)
            if resident:
                stats.hits += int(np.count_nonzero(valid & (of == b)))
            if entry.table is not None:
                index.append(entry.table)
            if entry.legacy_table is not None:
                legacy.append(entry.legacy_table)
        queries = nulls(len(query_ids))
        found = np.zeros(len(query_ids), bool)
        wanted = pc.unique(query_ids)
        if index:
            # Every stored copy of a wanted id, in store order (the same query may be stored more than once: logged
            # twice, recovered, a file moved into a partition); each id takes the first copy that reads back as
            # itself, so a copy whose log file is gone does not hide another.
            pool = pa.concat_tables(index)  # zero-copy: one chunk per file
            probe = pc.index_in(pool.column("query_id"), value_set=wanted)
            copies = np.flatnonzero(pc.is_valid(probe).to_numpy(zero_copy_only=False))
            if len(copies):
                of_wanted = pc.drop_null(probe).to_numpy(zero_copy_only=False)
                got, ok = self._read_lines(pool.take(pa.array(copies)), stats)
                readable = np.flatnonzero(ok)
                pick = np.full(len(wanted), -1, np.int64)
                uniq, first = np.unique(of_wanted[readable], return_index=True)
                pick[uniq] = readable[first]
                indexed = np.zeros(len(wanted), bool)
                indexed[of_wanted] = True
                at = pc.fill_null(pc.index_in(query_ids, value_set=wanted), -1).to_numpy()
                sel = np.where(at >= 0, pick[np.maximum(at, 0)], -1)
                found = (sel >= 0) & valid
                stats.unreadable = valid & (at >= 0) & indexed[np.maximum(at, 0)] & ~found
                queries = got.take(pa.array(np.where(found, sel, 0)))
        if legacy and not found.all():
            pool = pa.concat_tables(legacy)
            rows = _first_rows(pool.column("query_id"), wanted, query_ids)
            old = (rows >= 0) & valid & ~found
            if old.any():
                # Stitch per column: row i comes from the legacy pool where ``old``, from the index's result otherwise.
                from_old = pool.select(STORED_COLUMNS).cast(QUERY_FIELDS).take(pa.array(np.where(old, rows, 0)))
                mask = pa.array(old)
                queries = pa.table(
                    {n: pc.if_else(mask, from_old.column(n), queries.column(n)) for n in QUERY_FIELDS.names},
                    schema=QUERY_FIELDS,
                )
                found |= old
                stats.unreadable &= ~old
        return queries, found, stats

    def _read_lines(self, rows: pa.Table, stats: LookupStats) -> tuple[pa.Table, np.ndarray]:
        """The queries of index ``rows`` read back from the logs and parsed again, in row order, and whether each
        read back as the query it was indexed as (a log file deleted or changed since is a miss, and logged)."""
        from photon.logs.parse import QUERY_FIELDS

        n = rows.num_rows
        if not n:
            return QUERY_FIELDS.empty_table(), np.zeros(0, bool)
        files = rows.column("file").combine_chunks()
        names = files.dictionary.to_pylist()
        codes = files.indices.to_numpy(zero_copy_only=False)
        offsets, lengths = rows.column("offset").to_numpy(), rows.column("length").to_numpy()
        order = np.argsort(codes, kind="stable")
        lines: list[bytes] = [b""] * n
        unread = 0
        plan = []
        for code in np.unique(codes).tolist():
            at = order[np.searchsorted(codes[order], code) : np.searchsorted(codes[order], code, side="right")]
            plan.append((code, at, list(zip(offsets[at].tolist(), lengths[at].tolist(), strict=True))))
        # The objects this worker keeps are sliced first: keeping a fetched one could evict one before its lines are
        # read (a catch-up batch's lookups fetched every query object again, those this worker had just parsed too).
        held = {code: QUERY_OBJECTS.held(self.logs, names[code], _ends(spans)) for code, _, spans in plan}

        def fetch(code: int, spans: list[tuple[int, int]]) -> tuple[bytes | None, list[bytes]] | OSError:
            try:
                return QueryObjects.fetch(self.logs, names[code], _ends(spans))
            except OSError as exc:
                return exc

        # The others read a few at once on an object store (each a round trip), in a thread each.
        to_fetch = [functools.partial(fetch, code, spans) for code, _, spans in plan if held[code] is None]
        fetched = in_flight(to_fetch, FETCH_AHEAD if self.logs.atomic else 1)
        for code, at, spans in plan:
            try:
                got = held[code]
                if got is None:
                    answer = next(fetched)
                    if isinstance(answer, OSError):
                        raise answer
                    content, got = answer
                    if content is not None:
                        QUERY_OBJECTS.keep(self.logs, names[code], content)
            except OSError as exc:
                # Gone (or not a regular file): a miss. A folder's other errors (permissions) too, as ever; an object
                # store's (unreachable, throttled) fail the batch, which runs again: never a click decided on them.
                if self.logs.atomic and not isinstance(exc, FileNotFoundError):
                    raise
                log.error("EventStore: %d quer(ies) indexed in %s cannot be read back: %s", len(at), names[code], exc)
                unread += len(at)
                continue
            short = 0
            for i, raw, (_, ln) in zip(at.tolist(), got, spans, strict=True):
                lines[i] = _indexed_line(raw, ln)
                short += len(raw) != ln
            if short:  # truncated or emptied since: said per file, as a file gone is
                log.error(
                    "EventStore: %d quer(ies) indexed in %s cannot be read back: the file ends before them",
                    short,
                    names[code],
                )
                unread += short
        stats.lines_read += n
        # Each line must be the very query indexed there (same id and time).
        got, ok = parse_lines(lines)
        for column in ("query_id", "ts_us"):
            ok &= pc.fill_null(pc.equal(got.column(column), rows.column(column)), False).to_numpy(zero_copy_only=False)
        missing = int(np.count_nonzero(~ok))
        stats.lines_missing += missing
        if missing > unread:
            log.error(
                "EventStore: %d indexed quer(ies) did not read back as themselves (log files changed)", missing - unread
            )
        return got, ok

    def _bucket(self, b: int, staged: tuple[Store, str] | Path | None, stats: LookupStats) -> _Bucket:
        names: dict[str, tuple[Store, str]] = {}
        places: list[tuple[Store, str]] = [(self.root, "")]
        if staged is not None:
            places.append(staged if isinstance(staged, tuple) else (as_store(staged), ""))
        for store, prefix in places:
            folder = f"{prefix}/bucket={b}" if prefix else f"bucket={b}"
            # One listing per bucket and lookup (a folder gone: pruned behind the registry's horizon just now)
            for e in store.files(folder):
                name = e.key.rpartition("/")[2]
                if name.endswith((INDEX_SUFFIX, LEGACY_SUFFIX)):
                    names[name] = (store, e.key)
        entry = self.buckets.pop(b, None) or _Bucket()
        self.buckets[b] = entry  # most recently used last
        changed = False
        for files in (entry.files, entry.legacy):
            for gone in set(files) - set(names):
                del files[gone]
                changed = True
        for name in sorted(names):
            files = entry.files if name.endswith(INDEX_SUFFIX) else entry.legacy
            if name not in files:
                try:
                    files[name] = read_store_file(*names[name])
                except FileNotFoundError:
                    continue  # pruned between the listing and the read: as if not listed
                stats.files_read += 1
                changed = True
        if changed or (entry.table is None and entry.files):
            # Zero-copy: a chunk per file (memory-mapped). Only the id column is ever hashed.
            entry.table = pa.concat_tables(entry.files.values()) if entry.files else None
            entry.legacy_table = pa.concat_tables(entry.legacy.values()) if entry.legacy else None
        while len(self.buckets) > 1 and (len(self.buckets) > self.max_buckets or self.rows() > self.max_rows):
            self.buckets.popitem(last=False)  # least recently used first; the bucket just read stays
        return entry

    def rows(self) -> int:
        return sum(t.num_rows for b in self.buckets.values() for t in (b.table, b.legacy_table) if t is not None)


def parse_lines(lines: list[bytes]) -> tuple[pa.Table, np.ndarray]:
    """Query lines (each without its newline) parsed together, Arrow's fast path: (per line its query, and whether
    one parsed out of it). Each event is matched to the line it came from by its offset."""
    from photon.logs.parse import parse_file_located

    n = len(lines)
    if not n:
        return nulls(0), np.zeros(0, bool)
    buffer = b"".join(line + b"\n" for line in lines)
    good, _, starts, _ = parse_file_located("eventstore", buffer, "queries")
    line_starts = np.cumsum([0] + [len(line) + 1 for line in lines[:-1]], dtype=np.int64)
    row_of_line = np.full(n, -1, np.int64)
    # An event counts only where it starts exactly at one of the lines (a line holds no newline where its readers
    # slice it: ``_indexed_line``; so this is a guard, not the rule: an event starting inside a line must never
    # shift another's row).
    at_line = np.minimum(np.searchsorted(line_starts, starts), n - 1)
    exact = line_starts[at_line] == starts
    row_of_line[at_line[exact]] = np.flatnonzero(exact)
    ok = row_of_line >= 0
    return (good.take(pa.array(np.maximum(row_of_line, 0))) if good.num_rows else nulls(n)), ok


class QueryObjects:
    """The query log objects of an object store this Python worker read whole (its stage-1 tasks parse them; a
    lookup that wants many lines of one reads it whole), kept across batches up to ``MAX_BYTES``, least recently
    used out first: lookups slice the lines they want out of them. Without it every join task fetched every query
    object's lines again at every batch, a request per object (a live batch's lookups span the last minutes' query
    objects) or, where its lines are dense, the whole object: live click latency p50 rose from 1.7 s to 3.0-3.4 s at
    20,000 events/s per replica, and a catch-up batch read its query objects 1 + (join tasks per worker) times.
    A closed object never changes (EVENTS.md); one put again under its key is read as it was when kept, and each
    line still reads back only as the very query indexed there. A folder's files need none: the page cache keeps
    them."""

    MAX_BYTES = 256 << 20
    WHOLE = 8  # ranges of one object from which it is read whole (and kept) rather than by ranges
    LARGEST = 64 << 20  # an object larger than this is never kept

    def __init__(self) -> None:
        self.objects: OrderedDict[tuple[str, str], bytes] = OrderedDict()
        self.size = 0

    def keep(self, store: Store, key: str, content: bytes) -> None:
        if not store.atomic or len(content) > min(self.LARGEST, self.MAX_BYTES):
            return
        old = self.objects.pop((store.url, key), None)
        self.size += len(content) - (len(old) if old is not None else 0)
        self.objects[(store.url, key)] = content
        while self.size > self.MAX_BYTES:
            self.size -= len(self.objects.popitem(last=False)[1])

    def ranges(self, store: Store, key: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        got = self.held(store, key, ranges)
        if got is not None:
            return got
        content, got = self.fetch(store, key, ranges)
        if content is not None:
            self.keep(store, key, content)
        return got

    def held(self, store: Store, key: str, ranges: list[tuple[int, int]]) -> list[bytes] | None:
        """The ranges, out of the object kept here (used last now); None if it is not kept."""
        content = self.objects.get((store.url, key)) if store.atomic else None
        if content is None:
            return None
        self.objects.move_to_end((store.url, key))
        return [content[start:end] for start, end in ranges]

    @classmethod
    def fetch(cls, store: Store, key: str, ranges: list[tuple[int, int]]) -> tuple[bytes | None, list[bytes]]:
        """(the whole object to keep, or None; the ranges) read from the store, the object whole where many of its
        lines are wanted. Reads the store only (safe in a thread): the caller keeps what it returns."""
        if store.atomic and len(ranges) >= cls.WHOLE:
            content = store.get(key)
            return content, [content[start:end] for start, end in ranges]
        return None, store.get_ranges(key, ranges)


QUERY_OBJECTS = QueryObjects()


def _ends(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(offset, length) spans as (start, end) ranges."""
    return [(o, o + n) for o, n in spans]


def _indexed_line(raw: bytes, length: int) -> bytes:
    """The bytes an index row names (``raw``, read from its offset), or ``b""`` (a blank line: parsed as no event, so
    a miss) where they can no longer be one line: the file was truncated or rewritten, and the slice ends early or
    holds a newline and part of another line (a replica re-shipped with its lines in another order)."""
    return raw if len(raw) == length and b"\n" not in raw else b""


def _first_rows(pool_ids: pa.ChunkedArray, wanted: pa.Array, query_ids: pa.Array) -> np.ndarray:
    """Per requested id, the pool row of its first stored copy, or -1. Hashes the batch's few distinct ids and probes
    the pool's ids with them (not the other way round: a bucket holds far more queries than a batch has clicks)."""
    probe = pc.index_in(pool_ids, value_set=wanted)
    pool_rows = np.flatnonzero(pc.is_valid(probe).to_numpy(zero_copy_only=False))
    wanted_pos = pc.drop_null(probe).to_numpy(zero_copy_only=False) if len(pool_rows) else np.zeros(0, np.int64)
    row_of = np.full(len(wanted), -1, np.int64)
    uniq, first = np.unique(wanted_pos, return_index=True)
    row_of[uniq] = pool_rows[first]
    at = pc.fill_null(pc.index_in(query_ids, value_set=wanted), -1).to_numpy()
    return np.where(at >= 0, row_of[np.maximum(at, 0)] if len(row_of) else -1, -1)


def read_store_file(where: Path | Store, key: str | None = None) -> pa.Table:
    """One store file (``key`` in a store, or the path ``where``): an index (a folder's memory-mapped, nothing
    copied) or a legacy file of whole queries. FileNotFoundError if it is gone; CorruptStateError, naming it, if it
    cannot be read."""
    store, key = locate(where, key)
    name = store.location(key)
    try:
        if isinstance(store, LocalStore):
            path = store.path(key)
            if key.endswith(INDEX_SUFFIX):
                return pa.ipc.open_file(pa.memory_map(str(path))).read_all()
            return pq.read_table(path, columns=STORED_COLUMNS)
        data = pa.py_buffer(store.get(key))
        if key.endswith(INDEX_SUFFIX):
            return pa.ipc.open_file(data).read_all()
        return pq.read_table(pa.BufferReader(data), columns=STORED_COLUMNS)
    except FileNotFoundError:
        raise
    except StorageError as exc:
        if store.atomic:
            raise  # an object store that failed: the task fails and runs again, never a file taken for damaged
        raise CorruptStateError(f"{name} cannot be read ({exc}). {RECOVER_STORE}") from None
    except (pa.ArrowInvalid, OSError) as exc:
        raise CorruptStateError(f"{name} cannot be read ({exc}). {RECOVER_STORE}") from None


def nulls(n: int) -> pa.Table:
    from photon.logs.parse import QUERY_FIELDS

    return pa.table({f.name: pa.nulls(n, f.type) for f in QUERY_FIELDS}, schema=QUERY_FIELDS)


_CACHES: dict[str, EventStoreCache] = {}
# Pipelines whose caches a worker keeps, the most recently used: a Spark Connect server's workers live on across
# processes, and every backfilled hour is a pipeline of its own.
MAX_CACHES = 4


def cache_for(root: Path | str, logs: str, max_buckets: int, max_rows: int = 20_000_000) -> EventStoreCache:
    """The process's cache for one pipeline's store (``root``: the URL or folder of its EventStore; Python workers
    are reused across tasks and batches); ``logs``: the URL (or folder) of ``<logs>/<dc>/queries``."""
    key = str(root)
    cache = _CACHES.pop(key, None)
    if cache is None or (cache.logs.url, cache.max_buckets, cache.max_rows) != (
        cached_store(logs).url,
        max_buckets,
        max_rows,
    ):
        cache = EventStoreCache(key, logs, max_buckets, max_rows)
    _CACHES[key] = cache  # last: the most recently used
    while len(_CACHES) > MAX_CACHES:
        del _CACHES[next(iter(_CACHES))]
    return cache


def write_index(index: pa.Table, root: Path | Store, folder: str, name: str, bucket_s: int) -> dict[int, int]:
    """Store index rows by bucket under ``<folder>/bucket=<n>/<name>.arrow`` of ``root`` (``folder`` "" for its
    top); {bucket: rows}. Each file written whole (a retried task writes the same name again)."""
    store = as_store(root)
    top = f"{folder.strip('/')}/" if folder.strip("/") else ""
    buckets = bucket_of(index.column("ts_us").to_numpy(), bucket_s)
    # On an object store compressed (zstd: about a fifth of the bytes): each byte is put, copied when the batch is
    # published and got by every worker's lookups. A folder's stay plain: they are memory-mapped, nothing copied.
    options = pa.ipc.IpcWriteOptions(compression="zstd" if store.atomic else None)
    written = {}
    for b in np.unique(buckets).tolist():
        part = index.filter(pa.array(buckets == b)).combine_chunks()
        part = part.unify_dictionaries()  # one dictionary per file: the IPC file format allows no replacement
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, part.schema, options=options) as writer:
            writer.write_table(part)
        store.put(f"{top}bucket={b}/{name}{INDEX_SUFFIX}", sink.getvalue().to_pybytes())
        written[int(b)] = part.num_rows
    return written


def index_rows(root: Path | Store, folder: str = "") -> int:
    """Queries indexed under ``folder`` of a store (a batch's staged index)."""
    store = as_store(root)
    return sum(read_store_file(store, e.key).num_rows for e in store.listing(folder) if e.key.endswith(INDEX_SUFFIX))
