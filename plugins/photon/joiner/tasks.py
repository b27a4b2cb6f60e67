"""The executor side of a batch: what runs in Spark's Python workers. Stage 1 (``_source_task``) reads and parses
the batch's log files, stores its new queries and reads its retries back; stage 2 (``_join_task``,
``join_partition``) runs steps 2-6 for one partition of click ids (the step numbers are the joiner's, see
``photon.joiner``). A task gets plain values (``_Task``) and sends back counts, read markers and staged files."""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from photon.joiner.adapter import ADAPTED_SCHEMA, load_adapter
from photon.joiner.common import (
    AS_IT_IS,
    JOIN_COUNTS,
    READ_MARKERS,
    REASON_BEFORE,
    REASON_GC,
    REASON_LOG_GONE,
    REASON_TOO_LATE,
    RECOVERED_PREFIX,
    SETTLE_S,
    US,
    check_code,
)
from photon.joiner.query_index import REASON_QUERY_GC
from photon.logs.ids import valid_ids
from photon.logs.parse import (
    BAD_FIELDS,
    CLICK_FIELDS,
    QUERY_FIELDS,
    Malformed,
    parse_click,
    parse_file_located,
    parse_query,
)
from photon.logs.schemas import (
    JOINED,
    QUARANTINE,
    QUARANTINE_SCHEMA,
    RAW_CAP_BYTES,
    UNJOINABLE,
    UNJOINABLE_SCHEMA,
)
from photon.logs.tables import parquet_bytes, stage_rows
from photon.pg import REPLICATION_ENV
from photon.settings import MAX_CLOCK_SKEW_S, PLAUSIBLE_FROM_US
from photon.storage import ChangingError, Entry, StorageError, Store, again, as_store, cached_store, in_flight, locate

log = logging.getLogger(__name__)

_REGISTRIES: dict[tuple[tuple[str, str], ...], Any] = {}

READ_AHEAD = 4  # a stage-1 task's log files read ahead on an object store, each held whole until parsed
CANDIDATE = pa.schema(
    [
        ("click_id", pa.string()),
        ("click_ts_us", pa.int64()),
        ("query_id", pa.string()),
        ("ad_id", pa.string()),
        ("attempts", pa.int32()),
        ("first_seen_us", pa.int64()),
        ("due_us", pa.int64()),
        # When a click re-dispatched by the verifier (a ``recovered-*`` file) was first seen here; null otherwise.
        # Its join deadline runs from then: it may be long past its own, and this replica's query may still lag.
        ("recovered_us", pa.int64()),
    ]
)
WANTED = pa.schema([("click_id", pa.string()), ("query_id", pa.string())])
# Stage 1's output, shuffled by click id: a candidate (``line`` null; ``wanted``: whether its (click, query) pair
# was in the batch's ``Wanted``), or one of the batch's own queries shipped to a click that wants it (``line``: the
# query's log line and its place in the batch's staged store, ``order``: a lookup takes the first copy; the id of
# the click it is addressed to and the query's, the rest null). The line, not the parsed query: the JVM passes
# bytes on cheaply, and a struct of lists of structs cost the shuffle a second of CPU per 60,000 clicks.
SHUFFLED = pa.schema([*CANDIDATE, ("wanted", pa.bool_()), ("line", pa.binary()), ("order", pa.int64())])
JOIN_TASK = pa.schema(
    [
        *[(name, pa.int64()) for name in JOIN_COUNTS],
        # Clicks that took a query of their own batch shipped to them (``Wanted``): said in the batch's log line, not
        # a column of the registry's batch metrics
        ("shipped", pa.int64()),
        ("latencies_s", pa.list_(pa.float64())),
    ]
)


@dataclass
class Wanted:
    """The (click id, query id) pairs of a batch's due clicks, found by a first pass over its click files and retry
    set (``BatchRunner._wanted``). A query task ships each of its queries that a pair wants through the shuffle, its
    line once to each partition a click wanting it is in, so a click finds a query of its own batch without reading
    its log line back. On an object store those lines are in objects another worker parsed: the lookups read every
    query object of a catch-up batch again, once per worker. A hint, never a rule: a click it does not name is
    looked up as ever."""

    pairs: pa.Table  # click_id, query_id: distinct
    # query_id, click_id: per query and partition of the batch's shuffle, a click there wanting it, which its line is
    # addressed to (the shuffle is by click id); every click of that partition wanting the query takes it
    to: pa.Table

    @classmethod
    def of(cls, found: pa.Table) -> Wanted:
        """From the first job's rows: click_id, query_id, and part (the click's partition in the batch's shuffle)."""
        found = found.filter(pc.and_(pc.is_valid(found.column("click_id")), pc.is_valid(found.column("query_id"))))
        pairs = found.group_by(["click_id", "query_id"], use_threads=False).aggregate([])
        to = found.group_by(["query_id", "part"], use_threads=False).aggregate([("click_id", "min")])
        return cls(pairs.select(["click_id", "query_id"]), to.select(["query_id", "click_id_min"]))

    @functools.cached_property
    def keys(self) -> pa.Array:
        return _pair_keys(self.pairs.column("click_id"), self.pairs.column("query_id"))

    def named(self, click_ids: pa.ChunkedArray | pa.Array, query_ids: pa.ChunkedArray | pa.Array) -> pa.Array:
        """Per click, whether its (click id, query id) is a pair here."""
        return pc.fill_null(pc.is_in(_pair_keys(click_ids, query_ids), value_set=self.keys), False)

    def ship(
        self, queries: pa.Table, content: bytes, offsets: np.ndarray, lengths: np.ndarray, order: int
    ) -> pa.Table | None:
        """``SHUFFLED`` rows of ``queries`` (one log file's, ``content``; row i's line at ``offsets[i]``, of
        ``lengths[i]`` bytes, its place in the batch's staged store ``order + i``): one per query and partition
        wanting it (the first of a query logged twice in the file); None if none is wanted."""
        at = pc.index_in(self.to.column("query_id"), value_set=queries.column("query_id"))
        hit = pc.is_valid(at)
        n = pc.sum(hit).as_py() or 0
        if not n:
            return None
        to = self.to.filter(hit)
        rows = pc.drop_null(at).to_numpy(zero_copy_only=False)
        lines = [content[o : o + ln] for o, ln in zip(offsets[rows].tolist(), lengths[rows].tolist(), strict=True)]
        nulls = {f.name: pa.nulls(n, f.type) for f in SHUFFLED}
        return pa.table(
            nulls
            | {
                "click_id": to.column("click_id_min"),
                "query_id": to.column("query_id"),
                "line": pa.array(lines, pa.binary()),
                "order": pa.array(rows.astype(np.int64) + order, pa.int64()),
            },
            schema=SHUFFLED,
        )


def _pair_keys(click_ids: pa.ChunkedArray | pa.Array, query_ids: pa.ChunkedArray | pa.Array) -> pa.Array:
    # The click id's length first: no two pairs share a key, whatever their ids hold (an id is checked later)
    lengths = pc.cast(pc.binary_length(click_ids), pa.string())
    return pc.binary_join_element_wise(lengths, click_ids, query_ids, ":")


class AdapterContractError(RuntimeError):
    """The adapter returned something other than one row per click, in order, with the adapted schema."""


def run_adapter(path: str, batch: pa.RecordBatch) -> pa.Table:
    """The adapter's output for ``batch``, checked against its contract (adapter.py)."""
    out = load_adapter(path)(batch)
    if isinstance(out, pa.RecordBatch):
        out = pa.Table.from_batches([out])
    if not isinstance(out, pa.Table):
        raise AdapterContractError(f"returned {type(out).__name__}, not a pyarrow RecordBatch")
    if out.num_rows != batch.num_rows:
        raise AdapterContractError(f"returned {out.num_rows} rows for {batch.num_rows} clicks")
    missing = [n for n in ADAPTED_SCHEMA.names if n not in out.schema.names]
    if missing:
        raise AdapterContractError(f"returned no column {', '.join(missing)}")
    try:
        out = out.select(ADAPTED_SCHEMA.names).cast(ADAPTED_SCHEMA)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
        raise AdapterContractError(f"returned columns of the wrong type: {exc}") from None
    if not out.column("click_id").combine_chunks().equals(batch.column("click_id")):
        raise AdapterContractError("changed or reordered the clicks (click_id differs row by row)")
    return out


def _registry(servers: Mapping[str, str], max_future_s: float, failover_s: float) -> Any:
    """One IdRegistry per Python worker (workers are reused across tasks), keeping its shard connections."""
    from photon.registry.client import IdRegistry, RegistryOptions

    key = (*sorted(servers.items()), ("max_future_s", str(max_future_s)), ("failover_s", str(failover_s)))
    if key not in _REGISTRIES:
        options = RegistryOptions(max_future_s=max_future_s, failover_s=failover_s)
        _REGISTRIES[key] = IdRegistry(dict(servers), options)
    return _REGISTRIES[key]


def _close_registries() -> None:
    while _REGISTRIES:
        _, reg = _REGISTRIES.popitem()
        reg.close()


def _future_reason(max_future_s: float) -> str:
    # "the joiner's clock" is the registry server's, as the joiner reads it (kept word for word: readers match it)
    return (
        f"stamped more than {max_future_s:g} s ahead of the joiner's clock (the registry server's; twice the maximum "
        "clock skew plus margin)"
    )


def _implausible(ts_us: np.ndarray, now_us: int, max_future_us: int) -> np.ndarray:
    return (ts_us > now_us + max_future_us) | (ts_us < PLAUSIBLE_FROM_US)


def _quarantine_implausible(name: str, content: bytes, kind: str, now_us: int, max_future_s: float) -> pa.Table:
    """Bad-line records for the events of a file stamped at an implausible time. Rare: the file is read again by the
    reference parser, which numbers its lines (the fast path agrees with it on every event)."""
    parser = parse_query if kind == "queries" else parse_click
    limit = now_us + int(max_future_s * US)
    bad: dict[str, list[Any]] = {f.name: [] for f in BAD_FIELDS}
    for i, line in enumerate(content.split(b"\n")):
        try:
            ts = parser(line)["ts_us"]
        except Malformed:
            continue
        if ts > limit or ts < PLAUSIBLE_FROM_US:
            for col, v in zip(
                BAD_FIELDS.names,
                (
                    name,
                    i + 1,
                    line[:RAW_CAP_BYTES],
                    len(line),
                    _future_reason(max_future_s) if ts > limit else REASON_BEFORE,
                ),
                strict=True,
            ):
                bad[col].append(v)
    return pa.table(bad, schema=BAD_FIELDS)


def _unparsable_file(name: str, content: bytes, exc: BaseException) -> pa.Table:
    """The last resort: a file whose parsing still raised is quarantined whole (line 0), so the batch goes on."""
    reason = f"file could not be parsed ({type(exc).__name__}: {str(exc)[:200]}); quarantined whole"
    return pa.table(
        {
            "file": [name],
            "line": [0],
            "raw": [content[:RAW_CAP_BYTES]],
            "raw_bytes": [len(content)],
            "reason": [reason],
        },
        schema=BAD_FIELDS,
    )


def _quarantine(bad: pa.Table, dc: str, kind: str, now: int) -> pa.Table:
    n = bad.num_rows
    cols = {
        "pipeline": pa.array([dc] * n, pa.string()),
        "kind": pa.array([kind] * n, pa.string()),
        **{name: bad.column(name) for name in ("file", "line", "raw", "raw_bytes", "reason")},
        "decided_at_us": pa.array(np.full(n, now, np.int64)),
    }
    return pa.table(cols, schema=QUARANTINE_SCHEMA)


def _indices(batches: Iterator[pa.RecordBatch]) -> Iterator[int]:
    for batch in batches:
        yield from batch.column("id").to_pylist()


@dataclass(frozen=True)
class _Task:
    """What every task of a batch needs: plain values, shipped to the executors with the function."""

    dc: str  # the pipeline's name, as written in the output
    tag: str
    # The batch's "now": the registry server's clock at its start, read by the driver. Every decision a later lease
    # or another host relies on (door, first seen, due times, deadlines) takes it, never the executor's own clock.
    now: int
    stage: str  # the batch's stage: a key under ``root`` (_staging/<tag>)
    state: str  # <out>/<pipeline>/_state: a folder or an s3:// URL (the workers' EventStore caches are keyed by it)
    logs: str  # <logs>/<dc>/queries, where the EventStore's index finds the query lines
    servers: tuple[tuple[str, str], ...]
    token: int
    bucket_s: int
    cache_buckets: int
    cache_max_rows: int
    max_join_delay_us: int
    retry_base_s: float
    retry_max_s: float
    adapter: str
    max_future_s: float
    # How long a registration retries a lost registry server (PHOTON_REGISTRY_FAILOVER_S, read by the driver: a
    # worker on another host may not share its environment).
    failover_s: float = 45.0
    max_clock_skew_us: int = int(MAX_CLOCK_SKEW_S * US)
    clock_offset_us: int = 0  # server minus the driver's host: joined_at_us (a measurement only) on the server's scale
    settle_s: float = SETTLE_S
    # The registry's horizon when the lease started (query_index.py): a click whose query is older is unjoinable.
    horizon_us: int | None = None
    # A backfill's second place to look: the data center's shared query index (<out>/_query_index/<dc>).
    shared_index: str | None = None
    # "<kind>/<file>" -> [size, mtime_ns]: torn or empty files the driver saw unchanged for ``settle_s``, to be read
    # only exactly so (``read_whole``)
    settled: dict[str, list[Any]] = field(default_factory=dict)
    # The driver's replication rule (PHOTON_REGISTRY_REPLICATION) and code: a Spark Connect server's workers have
    # the server's environment, and may have imported older code.
    replication: str = "required"
    code: str = ""
    batch: int = 0  # the batch's number: every output row carries it (photon.logs.tables)
    # <out>/<pipeline>: a folder or an s3:// URL, where the tasks write the tables' data files and the stage
    root: str = ""
    source_root: str = ""  # <logs>/<dc>: a folder or an s3:// URL (credentials from each worker's environment)

    @property
    def root_store(self) -> Store:
        return cached_store(self.root)  # one client per worker: every batch of the pipeline shares it

    @property
    def state_store(self) -> Store:
        return cached_store(self.state)


def ends_whole(store: Store, e: Entry) -> bool:
    """Whether a listed log file ``e`` is not empty and ends with a newline: whole, as a rename puts it in place."""
    return e.size > 0 and store.get_ranges(e.key, [(e.size - 1, e.size)])[0] == b"\n"


def read_whole(
    store: Store | Path, key: str | None = None, settled_as: tuple[int, str] | None = None
) -> tuple[bytes | None, Entry | None]:
    """(content, entry) of a closed log file (``key`` in ``store``, or the path ``store``), content None while the
    file is still changing: it changed while it was read, or it is empty or ends without a newline and is not exactly
    as the driver saw it settle (``settled_as``: (size, tag), ``Discovery._settled``: a copy still being written; a
    writer's torn tail is taken once it has settled), or it is gone (moved away since it was listed: listed again
    wherever it lands). The reader's side of EVENTS.md's rule "a closed file is whole and never changes". Never by
    the age of its modification time: that is the file server's clock, up to the maximum skew off this host's. An
    object store's object is whole as it is (a put is atomic)."""
    where, key = locate(store, key)
    try:
        content, e = where.read(key)
    except (FileNotFoundError, ChangingError):
        return None, None
    except OSError as exc:  # not a regular file (any more), unreadable: left, and listed again
        log.error("%s: cannot be read: %s", key, exc)
        return None, None
    if where.atomic or content.endswith(b"\n"):
        return content, e
    if settled_as is None or tuple(settled_as) not in ((e.size, e.etag), AS_IT_IS):
        return None, e
    return content, e


def _write_read_marker(
    root: Store,
    stage: str,
    name: str,
    skipped: list[list[str]],
    read: dict[str, list[Any]],
    indexed: int,
    quarantined: int,
    index: list[str],
) -> None:
    """What one stage-1 task tells the driver: files it left for a later batch, each file's (size, tag, inode) as
    read, how many queries it indexed, in which index files (under the stage's ``eventstore/``), and how many rows it
    quarantined. A retried task's marker replaces its failed attempt's whole."""
    marker = {"skipped": skipped, "read": read, "indexed": indexed, "quarantined": quarantined, "index": index}
    root.put(f"{stage}/{READ_MARKERS}/{name}.json", json.dumps(marker).encode())


@dataclass
class ReadMarkers:
    """The driver's side of ``_write_read_marker``, over a batch's tasks."""

    skipped: set[tuple[str, str]]  # (kind, file) left for a later batch
    read: dict[tuple[str, str], tuple[Any, ...]]  # (kind, file): (size, tag, inode) as read
    indexed: int  # queries indexed in the batch's staged EventStore (counted by its writers: never read back)
    quarantined: int  # rows of malformed lines the tasks staged for the quarantine table
    index: list[str] | None  # the index files the tasks wrote, under the stage's eventstore/ (None: a marker of old)


class MarkersMissingError(StorageError):
    """A batch's log files that no task's read marker accounts for: the batch is never committed so."""


def read_markers(
    root: Path | Store, stage: str, files: Iterable[tuple[str, str]] = (), indexed: int = 0
) -> ReadMarkers:
    """The read markers of a batch's tasks. Every one of the batch's log ``files`` (kind, name) was either read or
    left by some task, which said so in its marker: the stage is listed again while a file is missing (a store's
    listing may miss an object just put, as its adds' did under a store SIGKILLed again and again), within the storage
    retry budget; then ``MarkersMissingError``. A file taken as read without a marker would be consumed unread.
    Likewise while they count fewer than ``indexed`` queries indexed (a publisher that has only the batch's metrics)."""
    store = as_store(root)
    want = set(files)

    def found() -> ReadMarkers:
        markers = ReadMarkers(set(), {}, 0, 0, [])
        for e in store.files(f"{stage}/{READ_MARKERS}"):
            if not e.key.endswith(".json"):
                continue
            marker = json.loads(store.get(e.key))
            markers.skipped.update((k, n) for k, n in marker["skipped"])
            markers.read.update({(k.split("/", 1)[0], k.split("/", 1)[1]): tuple(v) for k, v in marker["read"].items()})
            markers.indexed += int(marker.get("indexed", 0))
            markers.quarantined += int(marker.get("quarantined", 0))
            if "index" not in marker:
                markers.index = None
            elif markers.index is not None:
                markers.index.extend(marker["index"])
        missing = want - markers.skipped - markers.read.keys()
        if markers.indexed < indexed:
            raise MarkersMissingError(
                f"{store.location(stage)}: the tasks' read markers name {markers.indexed} queries indexed of the"
                f" {indexed} the batch committed (the store's listing is missing some)"
            )
        if missing:
            (kind, name), more = min(missing), len(missing) - 1
            raise MarkersMissingError(
                f"{store.location(stage)}: no task's read marker names {kind}/{name}"
                f"{f' or {more} more file(s)' if more else ''} of the batch (the store's listing is missing some):"
                " the batch is not committed; it runs again"
            )
        return markers

    return again(found, lambda exc: isinstance(exc, MarkersMissingError))


def _read_files(
    t: _Task, sources: list[tuple[str, str, str]], files: list[int]
) -> tuple[dict[str, Store], Iterator[tuple[bytes | None, Entry | None]]]:
    """(the stores of the logs' kinds, or none for a test's paths; the ``read_whole`` answers for the log files
    ``files``, in order). On an object store the next files are read while one is parsed (a few: each is held whole)."""
    # One client per worker and kind (a child store is a client of its own); a task of a test reads paths.
    top = t.source_root.rstrip("/")
    kinds = {k: cached_store(f"{top}/{k}") for k in ("queries", "clicks")} if t.source_root else {}

    def read_file(i: int) -> tuple[bytes | None, Entry | None]:
        kind, path_s, rel = sources[i]
        as_seen = t.settled.get(f"{kind}/{rel}")
        settled_as = (int(as_seen[0]), str(as_seen[1])) if as_seen else None
        if kinds:
            return read_whole(kinds[kind], rel, settled_as)
        return read_whole(Path(path_s), settled_as=settled_as)

    remote = any(store.atomic for store in kinds.values())
    return kinds, in_flight([functools.partial(read_file, i) for i in files], READ_AHEAD if remote else 1)


def _wanted_task(
    t: _Task, sources: list[tuple[str, str, str]], groups: list[list[int]]
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The first pass of a batch (``Wanted``), one task per group of its click and retry sources: the (click id,
    query id) of each due click. Reads and writes nothing else; a file it cannot read yet is left to the batch."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow.parquet as pq

        check_code(t.code, t.adapter)
        mine = [i for g in _indices(batches) for i in groups[g]]
        _, reads = _read_files(t, sources, [i for i in mine if sources[i][0] == "clicks"])
        for i in mine:
            kind, path_s, rel = sources[i]
            if kind == "retries":
                table = pq.read_table(
                    pa.BufferReader(t.state_store.get(path_s)), columns=["click_id", "query_id", "due_us"]
                )
                table = table.filter(pc.less_equal(table.column("due_us"), t.now))
            elif kind == "clicks":
                content, _ = next(reads)
                if not content:
                    continue
                try:
                    table, _, _, _ = parse_file_located(rel, content, kind)
                except Exception:  # the batch's own pass quarantines the file: its clicks are looked up as ever
                    continue
            else:
                continue
            yield from table.select(["click_id", "query_id"]).cast(WANTED).to_batches()

    return run


def _source_task(
    t: _Task, sources: list[tuple[str, str, str]], groups: list[list[int]] | None = None, wanted: Wanted | None = None
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The first stage of a batch, one task per group of sources (each row names a group; without ``groups``, a
    source): query files are parsed and indexed by bucket in the batch's staged EventStore, and the queries
    ``wanted`` names shipped to their clicks; click files are parsed into candidates; retry files are read back as
    candidates. Malformed lines are quarantined. ``SHUFFLED`` rows out. The shuffle after this stage is the barrier
    that puts every new query in the store before any click of the batch looks for it."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow.parquet as pq
        from pyspark import TaskContext

        # At run time: the worker's own cache, never a copy pickled with this function
        from photon.joiner.eventstore import INDEX_SUFFIX, QUERY_OBJECTS, index_of, write_index

        check_code(t.code, t.adapter)

        root, stage = t.root_store, t.stage
        rerun = _a_rerun(TaskContext.get())
        stored: list[pa.Table] = []
        quarantined: list[pa.Table] = []  # staged once per task: a file per source file was 2 PUTs each on a store
        first = None
        skipped: list[list[str]] = []
        read: dict[str, list[Any]] = {}
        marker_name = ""
        mine = [i for g in _indices(batches) for i in (groups[g] if groups is not None else [g])]
        kinds, reads = _read_files(t, sources, [i for i in mine if sources[i][0] != "retries"])
        for i in mine:
            kind, path_s, rel = sources[i]  # rel: the file's name in the logs (EVENTS.md), as records name it
            if kind == "retries":  # a key in the pipeline's state
                retries = pq.read_table(pa.BufferReader(t.state_store.get(path_s)), schema=CANDIDATE)
                yield from _shuffled(retries, wanted).to_batches()
                continue
            marker_name = marker_name or f"{t.tag}-t{i:06d}"  # named after the task's first log file: unique
            whole, e = next(reads)
            if kinds and kind == "queries" and whole is not None:
                QUERY_OBJECTS.keep(kinds[kind], rel, whole)
            if whole is None or e is None:  # still being written: not consumed now, listed and read again later
                log.warning(
                    "%s/%s: still changing (%d bytes now); left for a later batch", kind, rel, e.size if e else 0
                )
                skipped.append([kind, rel])
                continue
            read[f"{kind}/{rel}"] = [e.size, e.etag, e.inode]  # the inode: a file replaced by a rename is another
            content = whole
            try:
                good, bad, offsets, lengths = parse_file_located(rel, content, kind)
            except Exception as exc:  # a parser bug must cost one file, never the pipeline
                log.error("%s/%s: quarantined whole: %r", kind, rel, exc)
                good = (QUERY_FIELDS if kind == "queries" else CLICK_FIELDS).empty_table()
                bad = _unparsable_file(rel, content, exc)
                offsets = lengths = np.zeros(0, np.int64)
            # Event time sanity at the door: an implausible stamp is decided in the batch it arrives in.
            now = t.now
            if kind == "queries" and _implausible(good.column("ts_us").to_numpy(), now, int(t.max_future_s * US)).any():
                plausible = ~_implausible(good.column("ts_us").to_numpy(), now, int(t.max_future_s * US))
                good, offsets, lengths = good.filter(pa.array(plausible)), offsets[plausible], lengths[plausible]
                bad = pa.concat_tables([bad, _quarantine_implausible(rel, content, kind, now, t.max_future_s)])
            if bad.num_rows:
                quarantined.append(_quarantine(bad, t.dc, kind, t.now))
            n = good.num_rows
            if kind == "queries":
                first = i if first is None else first
                # Its rows' place in the batch's staged store: the task's files in the order of their names (its
                # first file's number), then the rows in the order stored (write_index keeps it in each bucket)
                order = (first << 32) + sum(x.num_rows for x in stored)
                stored.append(index_of(good, rel, offsets, lengths))
                shipped = wanted.ship(good, content, offsets, lengths, order) if wanted is not None and n else None
                if shipped is not None:
                    yield from shipped.to_batches()
            elif n:
                candidates = pa.Table.from_pydict(
                    {
                        "click_id": good.column("click_id"),
                        "click_ts_us": good.column("ts_us"),
                        "query_id": good.column("query_id"),
                        "ad_id": good.column("ad_id"),
                        "attempts": pa.array(np.zeros(n, np.int32)),
                        "first_seen_us": pa.array(np.full(n, t.now, np.int64)),
                        "due_us": pa.array(np.full(n, t.now, np.int64)),
                        "recovered_us": pa.array(
                            np.full(n, t.now, np.int64)
                            if rel.rpartition("/")[2].startswith(RECOVERED_PREFIX)
                            else [None] * n,
                            pa.int64(),
                        ),
                    },
                    CANDIDATE,
                )
                yield from _shuffled(candidates, wanted).to_batches()
        indexed = quarantined_rows = 0
        index_files: list[str] = []
        if stored:  # one file per task and bucket: fewer, larger files for the lookups to read
            index = pa.concat_tables(stored)
            name = f"{t.tag}-q{first:06d}"
            written = write_index(index, root, f"{stage}/eventstore", name, t.bucket_s)
            index_files = [f"bucket={b}/{name}{INDEX_SUFFIX}" for b in written]
            indexed = index.num_rows
        if (quarantined or rerun) and marker_name:  # named as the marker: unique in the batch, the same in a retry
            rows = pa.concat_tables(quarantined) if quarantined else pa.table({})
            quarantined_rows = stage_rows(root, QUARANTINE, stage, marker_name, rows, t.batch, replace=rerun)
        if read or skipped:
            _write_read_marker(root, stage, marker_name, skipped, read, indexed, quarantined_rows, index_files)

    return run


def _shuffled(candidates: pa.Table, wanted: Wanted | None) -> pa.Table:
    """``CANDIDATE`` rows as ``SHUFFLED`` rows, each marked whether ``wanted`` names its pair."""
    n = candidates.num_rows
    named = (
        wanted.named(candidates.column("click_id"), candidates.column("query_id"))
        if wanted is not None and n
        else pa.array(np.zeros(n, bool))
    )
    candidates = candidates.append_column("wanted", named).append_column("line", pa.nulls(n, pa.binary()))
    return candidates.append_column("order", pa.nulls(n, pa.int64()))


def _join_task(t: _Task) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """Steps 2-6 for one partition of candidates (all copies of a click id land in the same partition)."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        check_code(t.code, t.adapter)
        os.environ[REPLICATION_ENV] = t.replication  # this task's registry connections follow its driver's rule
        ctx = TaskContext.get()
        part = ctx.partitionId() if ctx is not None else 0
        rows = pa.Table.from_batches(list(batches), SHUFFLED)
        rerun = _a_rerun(ctx)
        query = pc.is_valid(rows.column("line"))
        shipped = rows.filter(query).select(["click_id", "query_id", "line", "order"])
        rows = rows.filter(pc.invert(query)).drop_columns(["line", "order"])
        try:
            counts, latencies = join_partition(t, rows, part, shipped, rerun)
        finally:
            if t.code:
                # On a Spark Connect server every client session gets Python workers of its own, which outlive it
                # by about a minute: kept, their registry connections used up the server's max_connections after
                # a few short joins. Closed after each task instead (a connection costs milliseconds).
                _close_registries()
        yield pa.RecordBatch.from_pydict(
            {**{k: [v] for k, v in counts.items()}, "latencies_s": [latencies.tolist()]}, JOIN_TASK
        )

    return run


def _a_rerun(ctx: Any) -> bool:
    """Whether this task ran before in this batch (Spark's retry of a failed try): its records replace the earlier
    try's, even for a kind it has no rows of. (A stage Spark submits again starts its tasks' attempt numbers over,
    and PySpark does not say the stage's attempt: such a rerun is not known here.)"""
    return ctx is not None and ctx.attemptNumber() > 0


def join_partition(
    t: _Task, rows: pa.Table, part: int, shipped: pa.Table | None = None, rerun: bool = False
) -> tuple[dict[str, int], np.ndarray]:
    """Dedupe, registry pre-filter, EventStore lookup, adapter, registration, staged output for one partition of
    candidates (``CANDIDATE``, and ``wanted`` if the batch had a ``Wanted``); ``shipped``: the batch's own queries
    shipped to the partition (``SHUFFLED``'s click_id, query_id, line, order). Returns the partition's counts and
    the joined clicks' latencies. ``rerun``: the task may have run before (``_a_rerun``)."""
    from photon.joiner.eventstore import cache_for
    from photon.registry.client import Outcome
    from photon.registry.owners import Token

    counts = dict.fromkeys((*JOIN_COUNTS, "shipped"), 0)
    root, stage = t.root_store, t.stage
    name = f"{t.tag}-p{part:04d}"
    if "wanted" not in rows.schema.names:
        rows = rows.append_column("wanted", pa.array(np.zeros(rows.num_rows, bool)))
    # One row per click id: a due copy first, then the earliest seen; a copy the verifier re-dispatched lends the
    # kept row its recovery time (the click's deadline runs from there, whichever copy is kept).
    rows = rows.append_column("_due", pc.less_equal(rows.column("due_us"), t.now))
    rows = rows.append_column("_i", pa.array(np.arange(rows.num_rows, dtype=np.int64)))
    order = rows.sort_by([("click_id", "ascending"), ("_due", "descending"), ("first_seen_us", "ascending")])
    kept = order.group_by("click_id", use_threads=False).aggregate([("_i", "first"), ("recovered_us", "max")])
    rows = rows.take(kept.column("_i_first"))
    rows = rows.set_column(rows.schema.get_field_index("recovered_us"), "recovered_us", kept.column("recovered_us_max"))
    due_mask = rows.column("_due").to_numpy(zero_copy_only=False)
    waiting = rows.filter(pa.array(~due_mask)).select(CANDIDATE.names)
    due = rows.filter(pa.array(due_mask)).select([*CANDIDATE.names, "wanted"])
    counts["clicks"] = due.num_rows
    counts["retries_in"] = int(np.count_nonzero(due.column("attempts").to_numpy() > 0))
    unjoinable: list[pa.Table] = []
    retry = [waiting]
    latencies = np.zeros(0)

    def give_up(rows: pa.Table, reason: pa.Array | str) -> None:
        n = rows.num_rows
        if n:
            unjoinable.append(
                pa.table(
                    {
                        "click_id": rows.column("click_id"),
                        "query_id": rows.column("query_id"),
                        "ad_id": rows.column("ad_id"),
                        "click_ts_us": rows.column("click_ts_us"),
                        "decided_at_us": pa.array(np.full(n, t.now, np.int64)),
                        "pipeline": pa.array([t.dc] * n, pa.string()),
                        "reason": reason if isinstance(reason, pa.Array) else pa.array([reason] * n, pa.string()),
                    },
                    schema=UNJOINABLE_SCHEMA,
                )
            )

    if due.num_rows:
        # Event time sanity at the door (by the batch's server time, which the registry's own check is also given:
        # the same bound on the same clock, so it never refuses what passed here).
        ts = due.column("click_ts_us").to_numpy()
        now = t.now
        ahead = ts > now + int(t.max_future_s * US)
        give_up(due.filter(pa.array(ahead)), _future_reason(t.max_future_s))
        give_up(due.filter(pa.array(ts < PLAUSIBLE_FROM_US)), REASON_BEFORE)
        due = due.filter(pa.array(~_implausible(ts, now, int(t.max_future_s * US))))
    if due.num_rows:
        reg = _registry(dict(t.servers), t.max_future_s, t.failover_s)
        # 2. registry pre-filter: someone else's click is dropped; ours (a retry after a crash) goes on.
        found = reg.lookup(due.column("click_id"))
        taken = found.registered & (found.tokens != t.token)
        counts["prefiltered"] = int(np.count_nonzero(taken))
        give_up(due.filter(pa.array(~taken & found.too_old)), REASON_GC)
        live = due.filter(pa.array(~taken & ~found.too_old))
        if t.horizon_us is not None:  # the EventStores keep nothing older (EVENTS.md): no point waiting for it
            q_valid, q_ts = valid_ids(live.column("query_id"))
            forgotten = q_valid & (q_ts < t.horizon_us)
            give_up(live.filter(pa.array(forgotten)), REASON_QUERY_GC)
            live = live.filter(pa.array(~forgotten))
        # 3. EventStore: the worker's cache of stored buckets, plus this batch's staged queries; for a backfill, then
        # the data center's shared query index.
        cache = cache_for(f"{t.state.rstrip('/')}/eventstore", t.logs, t.cache_buckets, t.cache_max_rows)
        staged = (root, f"{stage}/eventstore")
        queries, hit, stats = _look_up(t, cache, live, shipped, staged)
        live = live.drop_columns(["wanted"])
        if t.shared_index is not None and not hit.all():
            shared = cache_for(t.shared_index, t.logs, t.cache_buckets, t.cache_max_rows)
            ids = live.column("query_id").combine_chunks()
            queries, hit = lookup_also(shared, ids, t.bucket_s, queries, hit, stats)
        counts["cache_lookups"], counts["cache_hits"], counts["shipped"] = stats.lookups, stats.hits, stats.shipped
        miss = live.filter(pa.array(~hit))
        live_hit = live.filter(pa.array(hit))
        q = queries.filter(pa.array(hit))
        # 4. adapter: its contract is checked, and a broken adapter turns its clicks into unjoinable/ rows with its
        # error as the reason, never into lost clicks or a failed batch.
        adapted = ADAPTED_SCHEMA.empty_table()
        if live_hit.num_rows:
            try:
                adapted = run_adapter(
                    t.adapter,
                    pa.RecordBatch.from_pydict(
                        {
                            "click_id": live_hit.column("click_id").combine_chunks(),
                            "click_ts_us": live_hit.column("click_ts_us").combine_chunks(),
                            "query_id": live_hit.column("query_id").combine_chunks(),
                            "ad_id": live_hit.column("ad_id").combine_chunks(),
                            "query_ts_us": q.column("ts_us").combine_chunks(),
                            "user_id": q.column("user_id").combine_chunks(),
                            "query_text": q.column("query_text").combine_chunks(),
                            "country": q.column("country").combine_chunks(),
                            "ads": q.column("ads").combine_chunks(),
                        }
                    ),
                )
            except Exception as exc:
                give_up(live_hit, f"adapter {t.adapter} failed: {type(exc).__name__}: {str(exc)[:300]}")
        filtered = pc.is_valid(adapted.column("reason")).to_numpy(zero_copy_only=False)
        give_up(adapted.filter(pa.array(filtered)), adapted.column("reason").filter(pa.array(filtered)))
        keep = adapted.filter(pa.array(~filtered))
        # 5. registration: one transaction per shard, under the batch's token.
        if keep.num_rows:
            res = reg.register(keep.column("click_id"), Token.from_value(t.token), now_us=t.now)
            counts["registry_txns"] += len(res.shards)
            counts["registry_rows"] += sum(s.rows for s in res.shards)
            counts["registry_retries"] += res.retries
            outcome = np.asarray(res.outcomes)
            # A measurement (latency), not a decision: this worker's clock on the server's scale, never before now.
            joined_at = max(t.now, int(time.time() * US) + t.clock_offset_us)
            won = (outcome == Outcome.WON) | (outcome == Outcome.WON_AGAIN)
            counts["won_again"] = int(np.count_nonzero(outcome == Outcome.WON_AGAIN))
            counts["wasted"] = int(np.count_nonzero(outcome == Outcome.LOST))
            give_up(keep.filter(pa.array(outcome == Outcome.TOO_OLD)), REASON_GC)
            out = keep.filter(pa.array(won))
            n = out.num_rows
            if n:
                out = out.drop_columns(["reason"])
                out = out.append_column("joined_at_us", pa.array(np.full(n, joined_at, np.int64)))
                out = out.append_column("pipeline", pa.array([t.dc] * n, pa.string()))
                stage_rows(root, JOINED, stage, name, out, t.batch)
                latencies = (joined_at - out.column("click_ts_us").to_numpy()) / US
            counts["joined"] = n
        # 3b. no query yet: back to wait with exponential backoff, or give up past the maximum join delay, which
        # runs from the click's time, but never from later than the maximum clock skew after it was first seen (a
        # click stamped ahead waits no longer than an honest one), or from its recovery.
        first_seen = miss.column("first_seen_us").to_numpy() + t.max_clock_skew_us
        since = np.maximum(
            np.minimum(miss.column("click_ts_us").to_numpy(), first_seen),
            pc.fill_null(miss.column("recovered_us"), 0).to_numpy(),
        )
        late = t.now - since > t.max_join_delay_us
        gone = stats.unreadable[~hit]  # its query was stored, but its log line no longer reads back
        give_up(miss.filter(pa.array(late & ~gone)), REASON_TOO_LATE)
        give_up(miss.filter(pa.array(late & gone)), REASON_LOG_GONE)
        again = miss.filter(pa.array(~late))
        attempts = again.column("attempts").to_numpy()
        backoff = np.minimum(t.retry_max_s, t.retry_base_s * np.power(2.0, attempts))
        # Never past the deadline: a query arriving in a click's last seconds must still find it.
        due = np.minimum(t.now + (backoff * US).astype(np.int64), since[~late] + t.max_join_delay_us)
        again = again.set_column(
            again.schema.get_field_index("attempts"), "attempts", pa.array(attempts + 1, pa.int32())
        )
        again = again.set_column(again.schema.get_field_index("due_us"), "due_us", pa.array(due, pa.int64()))
        retry.append(again)
    if unjoinable:
        table = pa.concat_tables(unjoinable)
        counts["unjoinable"] = table.num_rows
        stage_rows(root, UNJOINABLE, stage, name, table, t.batch)
    # A rerun's kinds without rows: an earlier try's records of them (clicks it joined, given up now) replaced
    for kind in (JOINED, UNJOINABLE) if rerun else ():
        if not counts[kind]:
            stage_rows(root, kind, stage, name, pa.table({}), t.batch, replace=True)
    retries = pa.concat_tables(retry)
    counts["retried"] = retries.num_rows
    if retries.num_rows or rerun:  # a rerun's none in place of the clicks its first try left waiting
        t.state_store.put(f"retries/{t.tag}/{name}.parquet", parquet_bytes(retries.cast(CANDIDATE)))
    return counts, latencies


def _look_up(
    t: _Task, cache: Any, live: pa.Table, shipped: pa.Table | None, staged: tuple[Store, str]
) -> tuple[pa.Table, np.ndarray, Any]:
    """Step 3 for ``live`` clicks: (queries, hit, stats) as ``EventStoreCache.lookup`` gives them, each the first copy
    of its query that reads back: one stored by an earlier batch first, then the batch's own. A click ``Wanted`` named
    is looked up in the store only, then takes the first line shipped to its partition (every query of the batch's
    own it could want was shipped there); any other in the store and in the batch's staged queries (``staged``)."""
    from photon.joiner.eventstore import LookupStats, nulls, parse_lines

    n = live.num_rows
    ids = live.column("query_id").combine_chunks()
    named = live.column("wanted").to_numpy(zero_copy_only=False)
    parts, rows, hit = [nulls(n)], np.arange(n), np.zeros(n, bool)
    stats = LookupStats(lookups=n, unreadable=np.zeros(n, bool))

    def took(at: np.ndarray, got: pa.Table, found: np.ndarray) -> None:
        rows[at[found]] = sum(p.num_rows for p in parts) + np.flatnonzero(found)
        hit[at[found]] = True
        stats.unreadable[at[found]] = False
        parts.append(got.cast(parts[0].schema))

    for at, where in ((np.flatnonzero(named), None), (np.flatnonzero(~named), staged)):
        if len(at):
            more, found, more_stats = cache.lookup(ids.take(pa.array(at)), t.bucket_s, where)
            stats.hits += more_stats.hits
            stats.files_read += more_stats.files_read
            stats.lines_read += more_stats.lines_read
            stats.lines_missing += more_stats.lines_missing
            stats.unreadable[at] = more_stats.unreadable
            took(at, more, found)
    at = np.flatnonzero(named & ~hit)
    if shipped is not None and shipped.num_rows and len(at):
        first = shipped.sort_by("order")  # index_in takes the first match: the first copy in store order
        where = pc.index_in(ids.take(pa.array(at)), value_set=first.column("query_id"))
        sent = pc.is_valid(where).to_numpy(zero_copy_only=False)
        at = at[sent]
        if len(at):
            # Parsed again, as a line read back from the logs is (each parsed in stage 1 as the very query it names)
            got, found = parse_lines(first.column("line").take(pc.drop_null(where)).to_pylist())
            found &= pc.fill_null(pc.equal(got.column("query_id"), ids.take(pa.array(at))), False).to_numpy(
                zero_copy_only=False
            )
            took(at, got, found)
            stats.shipped = int(np.count_nonzero(found))
            stats.hits += stats.shipped
    queries = parts[0] if len(parts) == 1 else pa.concat_tables(parts).take(pa.array(rows))
    return queries, hit, stats


def lookup_also(
    store: Any, query_ids: pa.Array, bucket_s: int, queries: pa.Table, hit: np.ndarray, stats: Any
) -> tuple[pa.Table, np.ndarray]:
    """Look the ids not ``hit`` yet up in a second store; (queries, hit) for all of them, and ``stats`` updated (a
    query found there is no longer unreadable)."""
    missing = np.flatnonzero(~hit)
    more, found, more_stats = store.lookup(query_ids.take(pa.array(missing)), bucket_s)
    stats.hits += more_stats.hits
    stats.files_read += more_stats.files_read
    stats.lines_read += more_stats.lines_read
    stats.lines_missing += more_stats.lines_missing
    stats.unreadable[missing] = (stats.unreadable[missing] | more_stats.unreadable) & ~found
    if not found.any():
        return queries, hit
    rows = np.arange(len(hit))
    rows[missing[found]] = len(hit) + np.flatnonzero(found)
    hit = hit.copy()
    hit[missing[found]] = True
    return pa.concat_tables([queries, more.cast(queries.schema)]).take(pa.array(rows)), hit
