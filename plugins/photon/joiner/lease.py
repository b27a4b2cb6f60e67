"""The micro-batch joiner (Photon's dispatcher + joiner) on Spark: one long-lived session, one batch per trigger.

Batch k of pipeline P, under a lease with epoch E, is one Spark job of two stages:
- Stage 1, one task per few new files (and retry files): query files are parsed and their queries stored by time
  bucket in the batch's staged EventStore; click files are parsed into candidates, the retry set read back;
  malformed lines go to quarantine with a reason.
- Shuffle by click id, so every copy of a click lands in one partition (and every new query is stored before any
  lookup). Stage 2, in each partition:
  2. registry pre-filter: drop clicks another batch already registered (Photon's dispatcher lookup);
  3. EventStore lookup: the worker's cache of recent buckets (the Python workers live as long as the session), the
     stored buckets it has not seen, and this batch's staged queries; for a backfill, then the data center's shared
     query index (query_index.py). A click whose query is older than the registry's horizon is unjoinable at once;
     clicks without a query wait for a retry with exponential backoff, or go to unjoinable/ once older than the
     maximum join delay;
  4. the adapter merges the query's fields into the click;
  5. registration of the partition's joined ids, one transaction per shard, under token (P, k);
  6. the rows won, the unjoinable clicks and the new retry set are written, staged under ``b<k>-e<E>``.
  Only counts and latencies go back to the driver.
7. The driver commits batch k with its metrics (fenced by E, in order), then moves the staged output into place.

A crash anywhere re-runs batch k from the last committed state; registrations of the dead attempt carry the same
token, come back WON_AGAIN and are written then. A zombie lease can register but never commit or publish.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from photon.durable import check_parquet, fsync_dir, make_dirs
from photon.joiner.adapter import ADAPTED_SCHEMA, load_adapter
from photon.joiner.eventstore import RECOVER_STORE, index_rows, open_regular, read_store_file
from photon.joiner.query_index import REASON_QUERY_GC
from photon.joiner.state import Lease, PipelineState
from photon.logs.ids import valid_ids
from photon.logs.layout import list_closed, part_of_name, partition_of, sealed_before
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
    JOINED_SCHEMA,
    QUARANTINE,
    QUARANTINE_SCHEMA,
    RAW_CAP_BYTES,
    UNJOINABLE,
    UNJOINABLE_SCHEMA,
)
from photon.registry.clock import ClockSkewError, ServerClock
from photon.settings import MAX_CLOCK_SKEW_S, MAX_FUTURE_S, PLAUSIBLE_FROM_US, time_bound_s

log = logging.getLogger(__name__)
US = 1_000_000

SETTLE_S = 5.0  # see JoinSettings.settle_s
READ_MARKERS = "_read"  # under a batch's stage: per stage-1 task, the files it left for later and the sizes it read
HOLD_POLL_S = 0.25  # while a lease holds on for a starting standby, how often it asks whether it is ready
SUCCESSOR_WAIT_S = 1.5  # ...and how long it waits for an answer (the registry answers in milliseconds)

REASON_TOO_LATE = "query not found within the maximum join delay"
REASON_GC = "older than the registry's garbage-collection threshold"
REASON_LOG_GONE = (
    "its query was stored, but its line in the query logs no longer reads back (log file removed or changed): keep "
    "query logs as long as the registry's retention"
)
RECOVER_RETRIES = (
    "It was synced before its batch committed, so it was damaged since. Restore it from a backup of the output "
    "folder, or move it aside (mv FILE FILE.corrupt): the pipeline then goes on, and the clicks that were waiting in "
    "it get no outcome from this pipeline (the other data center's can still join them; `photon audit` lists any "
    "click left without an outcome)."
)
REASON_BEFORE = "stamped before 2010-01-01: not a plausible time"
JOIN_COUNTS = (
    "clicks",
    "retries_in",
    "prefiltered",
    "cache_lookups",
    "cache_hits",
    "joined",
    "won_again",
    "wasted",
    "unjoinable",
    "retried",
    "registry_txns",
    "registry_rows",
    "registry_retries",
)


@dataclass(frozen=True)
class JoinSettings:
    max_join_delay_s: float = 120.0
    trigger_interval_s: float = 1.0
    retry_base_s: float = 1.0  # first retry after this long, doubling up to retry_max_s
    retry_max_s: float = 16.0
    bucket_s: int = 10  # EventStore time bucket: a lookup hashes the ids of the buckets its clicks need
    cache_buckets: int = 180  # buckets of queries kept in each Python worker (the CacheEventStore): 30 minutes...
    cache_max_rows: int = 20_000_000  # ...or fewer indexed queries (about 60 bytes each), about a gigabyte
    max_click_files: int = 2_000  # per batch; every new query file is always taken (the EventStore comes first)
    adapter: str = "photon.joiner.adapter:default_adapter"
    parallelism: int | None = None  # tasks per stage; None: the session's default parallelism (its cores)
    # A backfill's window: only click files whose first event is stamped in [window_start_us, window_end_us), and
    # query files from max_join_delay_s + window_margin_s before it to window_margin_s after it, so the window's
    # clicks find their queries. The margin must exceed the time one log file spans. None: every file.
    window_start_us: int | None = None
    window_end_us: int | None = None
    window_margin_s: float = 120.0
    # A live joiner heartbeats this often, idle or not; the verifier's grace period must be several times longer.
    heartbeat_s: float = 5.0
    # An event stamped further ahead of the registry server's clock is decided at the door (a click: unjoinable/, a
    # query: quarantine/), and the registry refuses such ids with the same bound: twice the skew plus a margin.
    max_future_s: float = MAX_FUTURE_S
    # Every clock is off from true time by at most this much (EVENTS.md): a lease whose host is further from the
    # registry server's refuses to run; the seal follows it (settings.time_bound_s).
    max_clock_skew_s: float = MAX_CLOCK_SKEW_S

    @property
    def seal_s(self) -> float:
        return time_bound_s(self.max_clock_skew_s)

    # A closed file that is empty or whose last byte is not a newline is taken only once it has not changed for this
    # long (a copy still being written, EVENTS.md "Closed files"); a whole file is taken at once.
    settle_s: float = SETTLE_S


@dataclass
class BatchResult:
    batch_seq: int
    metrics: dict[str, Any] = field(default_factory=dict)


def _maybe_crash(point: str, batch_seq: int, lease_batch: int) -> None:
    """Fault injection for tests: PHOTON_CRASH_AT=<point>@<batch> kills this process with SIGKILL right there;
    ``<point>@+<n>`` at the lease's n-th batch."""
    if os.environ.get("PHOTON_CRASH_AT") in (f"{point}@{batch_seq}", f"{point}@+{lease_batch}"):
        os.kill(os.getpid(), signal.SIGKILL)


# -- executor-side functions (they run in Spark's Python workers) ----------------------------------------------

_REGISTRIES: dict[tuple[tuple[str, str], ...], Any] = {}

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
RECOVERED_PREFIX = "recovered-"
JOIN_TASK = pa.schema(
    [
        *[(name, pa.int64()) for name in JOIN_COUNTS],
        ("latencies_s", pa.list_(pa.float64())),
    ]
)


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


def _registry(servers: Mapping[str, str], max_future_s: float) -> Any:
    """One IdRegistry per Python worker (workers are reused across tasks), keeping its shard connections."""
    from photon.registry.client import IdRegistry, RegistryOptions

    key = (*sorted(servers.items()), ("max_future_s", str(max_future_s)))
    if key not in _REGISTRIES:
        _REGISTRIES[key] = IdRegistry(dict(servers), RegistryOptions(max_future_s=max_future_s))
    return _REGISTRIES[key]


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
    stage: str
    state: str
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
    max_clock_skew_us: int = int(MAX_CLOCK_SKEW_S * US)
    clock_offset_us: int = 0  # server minus the driver's host: joined_at_us (a measurement only) on the server's scale
    settle_s: float = SETTLE_S
    # The registry's horizon when the lease started (query_index.py): a click whose query is older is unjoinable.
    horizon_us: int | None = None
    # A backfill's second place to look: the data center's shared query index (<out>/_query_index/<dc>).
    shared_index: str | None = None
    # "<kind>/<file>" -> [size, mtime_ns]: torn or empty files the driver saw unchanged for ``settle_s``, to be read
    # only exactly so (``read_whole``)
    settled: dict[str, list[int]] = field(default_factory=dict)


AS_IT_IS = (-1, -1)  # ``read_whole``'s ``settled_as`` for a file still changing past the seal bound: read as it is


def ends_whole(path: str | Path, st: os.stat_result) -> bool:
    """Whether a listed log file (``st``) is not empty and ends with a newline: whole, as a rename puts it in place."""
    if st.st_size == 0:
        return False
    with open(path, "rb") as fh:
        return os.pread(fh.fileno(), 1, st.st_size - 1) == b"\n"


def read_whole(path: Path, settled_as: tuple[int, int] | None = None) -> tuple[bytes | None, int, int, int]:
    """(content, size, mtime_ns, inode) of a closed log file, content None while the file is still changing: its size or
    modification time moved while it was read, or it is empty or ends without a newline and is not exactly as the
    driver saw it settle (``settled_as``: (size, mtime_ns), ``Joiner._settled``: a copy still being written; a
    writer's torn tail is taken once it has settled), or it is gone (moved away since it was listed: listed again
    wherever it lands). The reader's side of EVENTS.md's rule "a closed file is whole and never changes". Never by
    the age of its modification time: that is the file server's clock, up to the maximum skew off this host's."""
    try:
        before = os.stat(path)
        with open_regular(path) as fh:  # a named pipe in its place: an error, never a task blocked for good
            content = fh.read()
        after = os.stat(path)
    except FileNotFoundError:
        return None, 0, 0, 0
    except OSError as exc:  # not a regular file (any more), unreadable: left, and listed again
        log.error("%s: cannot be read: %s", path, exc)
        return None, 0, 0, 0
    size, mtime, ino = after.st_size, after.st_mtime_ns, after.st_ino
    if (before.st_size, before.st_mtime_ns, before.st_ino) != (size, mtime, ino) or len(content) != size:
        return None, size, mtime, ino
    if not content.endswith(b"\n") and (settled_as is None or tuple(settled_as) not in ((size, mtime), AS_IT_IS)):
        return None, size, mtime, ino
    return content, size, mtime, ino


def _write_read_marker(stage: Path, name: str, skipped: list[list[str]], read: dict[str, list[int]]) -> None:
    """What one stage-1 task tells the driver: files it left for a later batch, and each file's (size, mtime, inode)
    as read."""
    path = stage / READ_MARKERS / f"{name}.json"
    make_dirs(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps({"skipped": skipped, "read": read}))
    os.replace(tmp, path)  # a retried task's marker replaces its failed attempt's whole


def read_markers(stage: Path) -> tuple[set[tuple[str, str]], dict[tuple[str, str], tuple[int, ...]]]:
    """The driver's side of ``_write_read_marker``: ((kind, file) left for later, {(kind, file): (size, mtime,
    inode)})."""
    skipped: set[tuple[str, str]] = set()
    read: dict[tuple[str, str], tuple[int, ...]] = {}
    folder = stage / READ_MARKERS
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        marker = json.loads(path.read_text())
        skipped.update((k, n) for k, n in marker["skipped"])
        read.update({(k.split("/", 1)[0], k.split("/", 1)[1]): tuple(v) for k, v in marker["read"].items()})
    return skipped, read


def _source_task(
    t: _Task, sources: list[tuple[str, str, str]], groups: list[list[int]] | None = None
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The first stage of a batch, one task per group of sources (each row names a group; without ``groups``, a
    source): query files are parsed and indexed by bucket in the batch's staged EventStore; click files are parsed
    into candidates; retry files are read back as candidates. Malformed lines are quarantined. The shuffle after
    this stage is the barrier that puts every new query in the store before any click of the batch looks for it."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow.parquet as pq

        from photon.joiner.eventstore import atomic_write, index_of, write_index

        stage = Path(t.stage)
        stored: list[pa.Table] = []
        first = None
        skipped: list[list[str]] = []
        read: dict[str, list[int]] = {}
        marker_name = ""
        for i in (i for g in _indices(batches) for i in (groups[g] if groups is not None else [g])):
            kind, path_s, rel = sources[i]  # rel: the file's name in the logs (EVENTS.md), as records name it
            path = Path(path_s)
            if kind == "retries":
                yield from pq.read_table(path, schema=CANDIDATE).to_batches()
                continue
            marker_name = marker_name or f"{t.tag}-t{i:06d}"  # named after the task's first log file: unique
            as_seen = t.settled.get(f"{kind}/{rel}")
            whole, size, mtime, ino = read_whole(path, (as_seen[0], as_seen[1]) if as_seen else None)
            if whole is None:  # still being written: not consumed now, listed and read again by a later batch
                log.warning("%s: still changing (%d bytes now); left for a later batch", path, size)
                skipped.append([kind, rel])
                continue
            read[f"{kind}/{rel}"] = [size, mtime, ino]  # the inode: a file replaced by a rename is another
            content = whole
            try:
                good, bad, offsets, lengths = parse_file_located(rel, content, kind)
            except Exception as exc:  # a parser bug must cost one file, never the pipeline
                log.error("%s: quarantined whole: %r", path, exc)
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
                name = f"{t.tag}-{kind[0]}{i:06d}.parquet"
                atomic_write(_quarantine(bad, t.dc, kind, t.now), stage / QUARANTINE / name)
            n = good.num_rows
            if kind == "queries":
                stored.append(index_of(good, rel, offsets, lengths))
                first = i if first is None else first
            elif n:
                yield from pa.Table.from_pydict(
                    {
                        "click_id": good.column("click_id"),
                        "click_ts_us": good.column("ts_us"),
                        "query_id": good.column("query_id"),
                        "ad_id": good.column("ad_id"),
                        "attempts": pa.array(np.zeros(n, np.int32)),
                        "first_seen_us": pa.array(np.full(n, t.now, np.int64)),
                        "due_us": pa.array(np.full(n, t.now, np.int64)),
                        "recovered_us": pa.array(
                            np.full(n, t.now, np.int64) if path.name.startswith(RECOVERED_PREFIX) else [None] * n,
                            pa.int64(),
                        ),
                    },
                    CANDIDATE,
                ).to_batches()
        if stored:  # one file per task and bucket: fewer, larger files for the lookups to read
            write_index(pa.concat_tables(stored), stage / "eventstore", f"{t.tag}-q{first:06d}", t.bucket_s)
        if read or skipped:
            _write_read_marker(stage, marker_name, skipped, read)

    return run


def _join_task(t: _Task) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """Steps 2-6 for one partition of candidates (all copies of a click id land in the same partition)."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        part = ctx.partitionId() if ctx is not None else 0
        rows = pa.Table.from_batches(list(batches), CANDIDATE)
        counts, latencies = join_partition(t, rows, part)
        yield pa.RecordBatch.from_pydict(
            {**{k: [v] for k, v in counts.items()}, "latencies_s": [latencies.tolist()]}, JOIN_TASK
        )

    return run


def join_partition(t: _Task, rows: pa.Table, part: int) -> tuple[dict[str, int], np.ndarray]:
    """Dedupe, registry pre-filter, EventStore lookup, adapter, registration, staged output for one partition.
    Returns the partition's counts and the joined clicks' latencies."""
    from photon.joiner.eventstore import atomic_write, cache_for
    from photon.registry.client import Outcome
    from photon.registry.owners import Token

    counts = dict.fromkeys(JOIN_COUNTS, 0)
    stage, state = Path(t.stage), Path(t.state)
    name = f"{t.tag}-p{part:04d}.parquet"
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
    due = rows.filter(pa.array(due_mask)).select(CANDIDATE.names)
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
        reg = _registry(dict(t.servers), t.max_future_s)
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
        cache = cache_for(state / "eventstore", Path(t.logs), t.cache_buckets, t.cache_max_rows)
        queries, hit, stats = cache.lookup(live.column("query_id").combine_chunks(), t.bucket_s, stage / "eventstore")
        if t.shared_index is not None and not hit.all():
            shared = cache_for(Path(t.shared_index), Path(t.logs), t.cache_buckets, t.cache_max_rows)
            ids = live.column("query_id").combine_chunks()
            queries, hit = lookup_also(shared, ids, t.bucket_s, queries, hit, stats)
        counts["cache_lookups"], counts["cache_hits"] = stats.lookups, stats.hits
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
                atomic_write(out.select(JOINED_SCHEMA.names).cast(JOINED_SCHEMA), stage / JOINED / name)
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
        atomic_write(table, stage / UNJOINABLE / name)
    retries = pa.concat_tables(retry)
    counts["retried"] = retries.num_rows
    if retries.num_rows:
        atomic_write(retries.cast(CANDIDATE), state / "retries" / t.tag / name)
    return counts, latencies


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


# -- the driver ------------------------------------------------------------------------------------------------


class Joiner:
    def __init__(
        self,
        dc: str,
        logs: Path,
        out: Path,
        servers: Mapping[str, str],
        spark: Any,
        settings: JoinSettings | None = None,
        *,
        pipeline: str | None = None,
        clock: ServerClock | None = None,
    ):
        """Joins ``<logs>/<dc>`` into ``<out>/<pipeline>``; the pipeline (its state, token owner and output folder)
        is named after the data center unless given, as a backfill names its own. ``clock``: the registry main
        server's (measured here unless given)."""
        self.dc, self.logs, self.out = dc, logs, out
        self.pipeline = pipeline or dc
        if not re.fullmatch(r"[a-z][a-z0-9_-]{0,30}", self.pipeline):
            raise ValueError(
                f"pipeline name {self.pipeline!r}: 1 to 31 lowercase letters, digits, '-' or '_', "
                "starting with a letter"
            )
        self.servers = dict(servers)
        self.spark = spark
        self.s = settings or JoinSettings()
        self.clock = clock or ServerClock(self.servers["main"], self.s.max_clock_skew_s)
        self.state = PipelineState(self.servers["main"], self.pipeline)
        self.root = out / self.pipeline
        self.state_dir = self.root / "_state"
        self.staging = self.root / "_staging"
        self.lease: Lease | None = None
        self.last_batch = 0  # last batch committed (by this lease or before it)
        self.consumed: set[tuple[str, str]] = set()
        # Per kind, the oldest log partition still to list (layout.py); None: every partition.
        self.marks: dict[str, str | None] = {"queries": None, "clicks": None}
        self._next_marks: dict[str, str | None] = dict(self.marks)
        self.retry_dir: Path | None = None
        self._first_ts: dict[Path, int] = {}
        # (kind, file) -> (size, mtime_ns) as this lease's batches read it: a consumed file that changes after is
        # reported once (``_changed``, quarantined by the next batch), never silently left half read.
        self._read_sizes: dict[tuple[str, str], tuple[int, ...]] = {}
        self._changed: list[dict[str, Any]] = []
        self.horizon_us: int | None = None  # the registry's horizon at the lease's start (query_index.py)
        self.shared_index: Path | None = None  # a backfill's: the data center's shared query index
        self.index_stats: dict[str, Any] = {}  # what the last lease start did to the shared index (tests, logs)
        # Files seen torn or empty: (size, mtime_ns, monotonic time seen so since, first seen changing), and those
        # seen settle (``_settled``)
        self._seen: dict[tuple[str, str], tuple[int, int, float, float]] = {}
        self._settled_as: dict[tuple[str, str], tuple[int, int]] = {}
        self._not_files: set[tuple[str, str]] = set()
        self._whole: dict[tuple[str, str], tuple[int, int, int]] = {}  # listed, not consumed, seen whole: as stat-ed
        self.parallelism = max(1, self.s.parallelism or int(spark.sparkContext.defaultParallelism))
        load_adapter(self.s.adapter)  # fail fast on a bad adapter path

    # lease start: recover, then load state --------------------------------------------------------------
    def start(self) -> Lease:
        lease = self._start(None)
        assert lease is not None
        return lease

    def _start(self, unless_live_within_s: float | None, overdue_after_s: float | None = None) -> Lease | None:
        """A new lease, then recovery and state; None (nothing done) if ``unless_live_within_s`` is given and a live
        lease holds the pipeline (one that started more than ``overdue_after_s`` ago is fenced all the same)."""
        self.clock.measure()  # a host whose clock is off more than the skew takes no lease (ClockSkewError)
        self.clock.check()
        lease = self.state.start_lease(unless_live_within_s=unless_live_within_s, overdue_after_s=overdue_after_s)
        if lease is None:
            return None
        self.lease = lease
        self.root.mkdir(parents=True, exist_ok=True)
        meta = self.root / "_pipeline.json"  # which logs this output came from (the auditor reads it)
        tmp = meta.with_name(f"._pipeline.json.{os.getpid()}")
        tmp.write_text(json.dumps({"pipeline": self.pipeline, "dc": self.dc}) + "\n")
        os.replace(tmp, meta)
        committed = {(b, e): published for b, e, published in self.state.open_batches()}
        for (b, e), published in sorted(committed.items()):
            if not published:
                self._publish(b, e)
                self.state.heartbeat(lease)  # alive while it publishes: a standby must not take it for dead
        keep = {self._tag(*max(committed))} if committed else set()  # the last batch's retry set: the live one
        shutil.rmtree(self.staging, ignore_errors=True)  # whatever is still staged was never committed
        retries = self.state_dir / "retries"
        if retries.is_dir():
            for d in retries.iterdir():
                if d.name not in keep:
                    shutil.rmtree(d, ignore_errors=True)
        self.marks = self.state.marks() if committed else self._first_marks()
        self._next_marks = dict(self.marks)
        self.consumed = self.state.consumed(self.marks)
        self.last_batch = self.lease.last_batch
        last = max(committed, default=None)
        retry = self.state_dir / "retries" / self._tag(*last) if last else None
        self.retry_dir = retry if retry and retry.is_dir() else None
        self._check_state()
        self._prepare_lookups()
        log.info("%s: lease epoch %d, last batch %d", self.pipeline, self.lease.epoch, self.lease.last_batch)
        return self.lease

    # hand-over: a standby lease warms up while the current one runs, and takes over when it ends ------------
    def warm_up(self) -> None:
        """Run a batch's own job once before the take-over, so the first batch after it costs what any batch costs (a
        fresh session's first job pays for the JVM's shuffle and Arrow paths, the Python workers' imports, parser,
        registry connections and the EventStore's recent buckets). The job reads a made-up query file and a made-up
        click file: clicks older than the maximum join delay whose queries are nowhere (their ids name the recent
        buckets, which the workers' EventStore caches load looking for them), decided unjoinable into a throwaway
        stage folder. It reads the registry and the pipeline's store and writes nothing but its own folder, removed
        after. A failure here costs only the warm-up."""
        folder = self.staging / f"warm-up-{os.uname().nodename}-{os.getpid()}"
        try:
            self._dry_batch(folder)
        except Exception as exc:  # an optimisation: the lease works without it
            log.warning("%s: warm-up batch failed (the first batch will be slower): %r", self.pipeline, exc)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _dry_batch(self, folder: Path) -> None:
        now = self.clock.now_us()
        bucket_us = self.s.bucket_s * US
        buckets = int(self.s.max_join_delay_s // self.s.bucket_s) + 2  # the buckets the next clicks' queries are in
        old = now - int((self.s.max_join_delay_s + 60) * US)  # too old to wait for a query: decided at once
        query = {"query_id": f"127.0.0.1-1-{now}", "ts_us": now, "user_id": "u", "query_text": "warm-up"}
        query |= {"country": "DE", "ads": [{"ad_id": "a1", "advertiser_id": "adv1", "bid_micros": 1}]}
        clicks = [
            {"click_id": f"127.0.0.1-2-{old + i}", "ts_us": old + i, "ad_id": "a1"}
            | {"query_id": f"127.0.0.1-3-{now - 1 - (i % buckets) * bucket_us}"}
            for i in range(max(buckets, 4 * self.parallelism))
        ]
        sources = []
        for kind, lines in (("queries", [query]), ("clicks", clicks)):
            path = folder / kind / f"warm-up-{kind}.jsonl"
            make_dirs(path.parent)
            path.write_bytes(b"".join(json.dumps(x).encode() + b"\n" for x in lines))
            sources.append((kind, str(path), path.name))
        rows = self._job(self._task("warm-up", now, folder / "stage", token=0), sources)  # no click registered
        decided = sum(int(r["unjoinable"]) for r in rows)
        if decided != len(clicks) or any(int(r["joined"]) or int(r["retried"]) for r in rows):
            raise AssertionError(f"warm-up batch: {len(clicks)} made-up clicks, got {[r.asDict() for r in rows]}")

    def take_over(self, *, stale_s: float, timeout_s: float) -> str:
        """Wait for the pipeline's current lease to end (released, or stale), then start this lease at once; a
        lease that started more than ``timeout_s`` ago and holds on is fenced. Returns why the pipeline was free.
        Two standbys never fence each other: the lease starts only if, at that moment and by the server's clock, no
        live lease holds the pipeline or the one that does is still overdue (``PipelineState.start_lease``); the
        standby that lost the race finds the winner's fresh lease and waits for its whole term."""
        while True:
            why = self.state.wait_for_turn(stale_s=stale_s, timeout_s=timeout_s)
            if self._start(stale_s, timeout_s if why == "timeout" else None) is not None:
                return why

    def release(self) -> None:
        if self.lease is not None:
            self.state.release(self.lease)

    def _first_marks(self) -> dict[str, str | None]:
        """Where a new pipeline starts listing: everything, or for a backfill window the partitions its files can
        have arrived in (a file arrives after its first event, give or take the clock skew)."""
        s = self.s
        if s.window_start_us is None:
            return {"queries": None, "clicks": None}
        seal = int(self.s.seal_s * US)
        first_query = s.window_start_us - int((s.max_join_delay_s + s.window_margin_s) * US)
        return {"queries": partition_of(first_query - seal), "clicks": partition_of(s.window_start_us - seal)}

    def _prepare_lookups(self) -> None:
        """At a lease's start: read the registry's horizon, prune the pipeline's EventStore behind it, and for a
        backfill make sure the data center's shared query index covers every sealed query partition from the horizon
        to the window's end plus the maximum join delay and margins (only partitions not yet indexed are parsed)."""
        from photon.joiner.query_index import ensure_indexed, index_range, index_root, prune, registry_horizon_us

        skew = self.s.max_clock_skew_s
        self.horizon_us, now = registry_horizon_us(self.servers, max_clock_skew_s=skew)
        pruned = prune(self.state_dir / "eventstore", self.horizon_us, self.s.bucket_s, skew)
        if pruned.buckets:
            log.info("%s: EventStore pruned behind the registry's horizon: %s", self.pipeline, pruned)
        if self.s.window_end_us is None:
            return
        self.shared_index = index_root(self.out, self.dc)
        pruned = prune(self.shared_index, self.horizon_us, self.s.bucket_s, skew)
        after_s = self.s.max_join_delay_s + 2 * self.s.window_margin_s + self.s.seal_s
        first, last = index_range(self.s.window_end_us, self.horizon_us, after_s, skew)
        t0 = time.monotonic()
        built = ensure_indexed(
            self.spark,
            self.logs / self.dc / "queries",
            self.shared_index,
            first=first,
            last=last,
            now_us=now,
            bucket_s=self.s.bucket_s,
            parallelism=self.parallelism,
            seal_s=self.s.seal_s,
            max_future_s=self.s.max_future_s,
        )
        self.index_stats = {**built, "seconds": time.monotonic() - t0, "pruned_buckets": pruned.buckets}
        log.info(
            "%s: shared query index %s, %s..%s: %s in %.1fs (pruned %s)",
            *(self.pipeline, self.shared_index, first, last, built, time.monotonic() - t0, pruned),
        )

    def _check_state(self) -> None:
        """Fail the lease at its start, naming the file, if a state file the next batches read is empty or truncated
        (a damaged disk), rather than failing every batch of every lease on it."""
        if self.retry_dir is not None:
            for p in sorted(self.retry_dir.glob("*.parquet")):
                check_parquet(p, RECOVER_RETRIES)
        # The EventStore's newest minute, which the next lookups read first (named from the clock, not listed: the
        # store holds every bucket ever written). An older damaged file is named when a lookup reads it.
        store = self.state_dir / "eventstore"
        newest = self.clock.now_us() // US // self.s.bucket_s
        for b in range(newest - max(1, 60 // self.s.bucket_s), newest + 1):
            folder = store / f"bucket={b}"
            for p in sorted(folder.iterdir()) if folder.is_dir() else []:
                if p.suffix == ".parquet":
                    check_parquet(p, RECOVER_STORE)
                elif p.suffix == ".arrow":
                    read_store_file(p)  # raises CorruptStateError naming it

    @staticmethod
    def _tag(batch: int, epoch: int) -> str:
        return batch_tag(batch, epoch)

    # the loop --------------------------------------------------------------------------------------------
    held_s = 0.0  # how long the last run() went on past its term, waiting for a standby to be ready
    _holding = False

    def run(
        self,
        *,
        run_for_s: float | None = None,
        until_caught_up: bool = False,
        drain: bool = False,
        max_batches: int | None = None,
        on_batch: Callable[[BatchResult], None] | None = None,
        hand_over_wait_s: float = 0.0,
    ) -> list[BatchResult]:
        """Run batches until ``run_for_s`` passes (a lease), or until caught up: no new file, and the retries that
        were due have had one batch since the last new file. With ``drain``, until no retry is left at all.

        A lease ends right after a batch, once its term ends before the next trigger would. If a standby of the
        pipeline is still starting then (``PipelineState.successor``), it keeps joining, up to ``hand_over_wait_s``
        past its term, until the standby is ready: the caller then releases the pipeline and the standby takes over
        at once, instead of the pipeline waiting for a Spark start.

        Once per heartbeat period, between batches, the offset to the registry server's clock is measured again: a
        host whose clock drifted further than the maximum clock skew stops after its current batch and raises
        :class:`ClockSkewError`."""
        if self.lease is None:
            self.start()
        assert self.lease is not None
        with self.state.heartbeating(self.lease, self.s.heartbeat_s):
            results = self._loop(run_for_s, until_caught_up, drain, max_batches, on_batch, hand_over_wait_s)
        if self.clock_error is not None:  # its batches are committed; the caller releases the lease and fails
            raise self.clock_error
        return results

    def _loop(
        self,
        run_for_s: float | None,
        until_caught_up: bool,
        drain: bool,
        max_batches: int | None,
        on_batch: Callable[[BatchResult], None] | None,
        hand_over_wait_s: float = 0.0,
    ) -> list[BatchResult]:
        deadline = time.monotonic() + run_for_s if run_for_s is not None else None
        self.held_s, self._holding, self.clock_error = 0.0, False, None
        k = self.last_batch
        results = []
        retried_since_files = False
        while True:
            t0 = time.monotonic()
            if self._clock_off():
                break
            q_files, c_files = self._new_files()
            pending, due = self._retry_counts()
            ran = False
            if q_files or c_files or self._changed:
                retried_since_files = False
                ran = True
            elif due and (drain or not until_caught_up or not retried_since_files):
                retried_since_files = True
                ran = True
            elif until_caught_up and (not drain or pending == 0):
                break
            if ran:
                k += 1
                results.append(self.run_batch(k, q_files, c_files))
                if on_batch:
                    on_batch(results[-1])
            if max_batches is not None and len(results) >= max_batches:
                break
            if deadline is not None and self._lease_over(t0, deadline, hand_over_wait_s):
                break
            if self._pause(t0 + self.s.trigger_interval_s, deadline, hand_over_wait_s):
                break
        return results

    clock_error: ClockSkewError | None = None  # why the last run() stopped early: this host's clock drifted off

    def _clock_off(self) -> bool:
        """Between batches, once per heartbeat period: measure the offset to the server again; True (and
        ``clock_error`` set) if this host's clock has drifted past the bound, so the lease stops after the batch it
        ran. A registry that cannot be reached keeps the last offset (the batch itself will fail or wait)."""
        if time.monotonic() - self.clock.measured_at < self.s.heartbeat_s:
            return False
        try:
            self.clock.measure()
        except Exception as exc:
            log.warning("%s: cannot measure the registry server's clock: %s", self.pipeline, exc)
            return False
        try:
            self.clock.check()
        except ClockSkewError as exc:
            log.error("%s: %s", self.pipeline, exc)
            self.clock_error = exc
            return True
        return False

    _asking: Future[str | None] | None = None

    def _successor(self, timeout_s: float) -> str | None:
        """``PipelineState.successor()``, waited for at most ``timeout_s`` (TimeoutError). The server's statement
        timeout bounds only what the server runs: a query it never gets or never answers (a connection dropped by
        the network, a stuck pooler, a frozen server, a hanging DNS lookup or connect) must not hold the lease past
        its bound. A question still unanswered is waited for again, never asked twice at once."""
        if self._asking is None or self._asking.done():
            asking: Future[str | None] = Future()

            def ask() -> None:
                try:
                    asking.set_result(self.state.successor())
                except BaseException as exc:
                    asking.set_exception(exc)

            threading.Thread(target=ask, name=f"photon-successor-{self.pipeline}", daemon=True).start()
            self._asking = asking
        return self._asking.result(timeout=max(0.0, timeout_s))

    def _pause(self, next_at: float, deadline: float | None, wait_s: float) -> bool:
        """Sleep until the next trigger. While the lease holds on for a standby, ask every ``HOLD_POLL_S`` instead,
        and end it as soon as the standby is ready or the hold reaches its bound: a long trigger interval never
        stretches the hold, and no trigger starts past the bound (a batch begun before it still runs to its end)."""
        while (left := next_at - time.monotonic()) > 0:
            if not self._holding or deadline is None:
                time.sleep(left)
                return False
            time.sleep(min(HOLD_POLL_S, left))
            if self._lease_over(next_at - self.s.trigger_interval_s, deadline, wait_s):
                return True
        return False

    def _lease_over(self, t0: float, deadline: float, wait_s: float) -> bool:
        """After a trigger (``t0``): whether the lease ends now. Not before its term ends by the next trigger; then
        at once, unless a standby is still starting and the lease has held on for less than ``wait_s`` past its
        term (a ready standby takes over the moment the lease releases; with none coming, the next lease starts
        cold whenever the lease ends)."""
        now = time.monotonic()
        if max(now, t0 + self.s.trigger_interval_s) < deadline:
            return False
        if self._holding:  # only a hold counts: a batch that ends past the term is not one
            self.held_s = max(0.0, now - deadline)
        if wait_s <= 0 or now >= deadline + wait_s:
            return True
        try:
            successor = self._successor(min(SUCCESSOR_WAIT_S, deadline + wait_s - now))
        except Exception as exc:  # unreachable, or no answer in time: hold on (within the bound), and ask again
            if not self._holding:
                log.warning("%s: cannot tell whether a standby is coming: %s", self.pipeline, exc)
            successor = "starting"
        if successor != "starting":
            return True
        if not self._holding:
            log.info("%s: lease term over; joining on while a standby starts (up to %.0fs)", self.pipeline, wait_s)
            self._holding = True
        self.held_s = max(0.0, now - deadline)
        return False

    def _new_files(self) -> tuple[list[str], list[str]]:
        """New closed files, oldest arrival first, and the verifier's re-dispatched clicks before any other: under a
        backlog bigger than ``max_click_files`` no file waits behind later ones, whatever its name. Only partitions
        from the pipeline's mark on are listed; the marks the batch will commit move past partitions that are
        sealed and left with nothing to consume."""
        sealed = sealed_before(self.clock.now_us(), self.s.seal_s)  # the server's clock: marks never move back

        seen: dict[tuple[str, str], tuple[int, int, float, float]] = {}
        whole: dict[tuple[str, str], tuple[int, int, int]] = {}
        self._settled_as = {}

        def listing(kind: str, cap: int | None) -> list[str]:
            folder = self.logs / self.dc / kind
            new, settling = [], []
            for f in list_closed(folder, self.marks[kind]):
                if (kind, f.rel) in self.consumed:
                    self._check_consumed(kind, folder, f.rel)
                    continue
                try:
                    path = os.path.join(folder, f.rel)  # a str: a Path per file is most of a backlog's listing time
                    st = os.stat(path)
                    if not stat.S_ISREG(st.st_mode):  # a directory named like a log file: not one, never read
                        if (kind, f.rel) not in self._not_files:
                            self._not_files.add((kind, f.rel))
                            log.error("%s: %s/%s is not a regular file: skipped", self.pipeline, kind, f.rel)
                        continue
                    if not self._settled(kind, f.rel, path, st, seen, whole):
                        settling.append(f.rel)  # a copy still being written: no batch for it yet
                        continue
                except FileNotFoundError:
                    continue
                except OSError as exc:  # unreadable now (permissions, a stale NFS handle): held, and said
                    log.error("%s: %s/%s cannot be read yet: %s", self.pipeline, kind, f.rel, exc)
                    settling.append(f.rel)
                    continue
                new.append((not f.name.startswith(RECOVERED_PREFIX), st.st_mtime_ns, f.rel))
            chosen = [n for _, _, n in sorted(new) if self._in_window(kind, folder / n)]
            chosen = chosen[:cap] if cap is not None else chosen
            taken = set(chosen)
            left = [p for _, _, n in new if n not in taken and (p := part_of_name(n)) is not None]
            left += [p for n in settling if (p := part_of_name(n)) is not None]
            mark = min([*left, sealed])
            # Never back: the lease before found everything behind its mark sealed and consumed, and this lease
            # loaded no consumed-file record from there (a host whose clock is behind would list it again).
            self._next_marks[kind] = mark if self.marks[kind] is None else max(mark, self.marks[kind] or "")
            return chosen

        found = listing("queries", None), listing("clicks", self.s.max_click_files)
        self._seen, self._whole = seen, whole  # only files listed now: bounded by them, not every file ever listed
        return found

    def _settled(
        self, kind: str, rel: str, path: str, st: os.stat_result, seen: dict[Any, Any], whole: dict[Any, Any]
    ) -> bool:
        """Whether a listed file may be read now: it ends with a newline (whole: at once), or this lease has seen it
        with the same size and mtime for ``settle_s`` by its own monotonic clock (an empty or torn-tailed file: a
        copy still being written, or a crashed writer's). Never by the mtime's age: the file server's clock may be
        the maximum skew off this host's, either way, or set by ``touch -d``. A settled torn file is read only as
        seen (``_Task.settled``). One still changing after the seal bound (``seal_s``, 60 s) since first seen so is
        taken as it is then, with a logged error: waiting longer would hold the listing mark back for good (every
        batch listing every partition since); what it gains after is reported as a consumed file's change."""
        sig = (st.st_size, st.st_mtime_ns, st.st_ino)
        if self._whole.get((kind, rel)) == sig or ends_whole(path, st):
            whole[(kind, rel)] = sig  # not opened again while it stays so (a backlog is listed at every batch)
            return True
        now = time.monotonic()
        size, mtime, since, first = self._seen.get((kind, rel), (-1, -1, now, now))
        if (size, mtime) != (st.st_size, st.st_mtime_ns):
            since = now
        overdue = now - first >= self.s.seal_s
        if now - since >= self.s.settle_s or overdue:
            if overdue and now - since < self.s.settle_s:
                log.error(
                    "%s: %s/%s still changing %.0f s after it was first listed (%d bytes now): taken as it is; a "
                    "closed file must be renamed into place whole (EVENTS.md)",
                    self.pipeline, kind, rel, now - first, st.st_size,
                )  # fmt: skip
            self._settled_as[(kind, rel)] = AS_IT_IS if overdue else (st.st_size, st.st_mtime_ns)
        seen[(kind, rel)] = (st.st_size, st.st_mtime_ns, since, first)  # kept while listed (taken, not consumed yet)
        return (kind, rel) in self._settled_as

    def _check_consumed(self, kind: str, folder: Path, rel: str) -> None:
        """A file this lease consumed must never change (EVENTS.md). If it did (appended in place, a copy that paused
        at a line's end, a replica re-shipped), say so once: a logged error now, and a quarantine record naming the
        file and the bytes never read, written by the next batch."""
        seen = self._read_sizes.get((kind, rel))
        if seen is None:
            return
        try:
            st = os.stat(folder / rel)
        except FileNotFoundError:
            return
        if (st.st_size, st.st_mtime_ns, st.st_ino) == seen:
            return
        del self._read_sizes[(kind, rel)]  # reported once
        size = seen[0]
        raw = b""
        if st.st_ino != seen[2]:  # another file renamed into its place: none of it read
            with contextlib.suppress(OSError), open_regular(folder / rel) as fh:
                raw = fh.read(RAW_CAP_BYTES)
            size = 0
            what = f"replaced by another file after it was consumed (its {st.st_size} bytes never read)"
        elif st.st_size > size:
            with contextlib.suppress(OSError), open_regular(folder / rel) as fh:
                fh.seek(size)
                raw = fh.read(RAW_CAP_BYTES)
            what = f"{st.st_size - size} bytes appended after it was consumed (bytes {size}..{st.st_size} never read)"
        else:
            what = f"rewritten after it was consumed ({size} bytes read, {st.st_size} bytes now; the change not read)"
        reason = f"closed file changed: {what}; writers must rename a file into place whole (EVENTS.md)"
        log.error("%s: %s/%s: %s", self.pipeline, kind, rel, reason)
        self._changed.append(
            {"kind": kind, "file": rel, "line": 0, "raw": raw, "raw_bytes": max(0, st.st_size - size), "reason": reason}
        )

    def _behind_marks(self, path: Path) -> bool:
        """A log file in a partition behind its kind's mark: it is never listed again."""
        rel = path.relative_to(self.logs / self.dc)  # <kind>/<day>/<minute>/<name>, or <kind>/<name>
        if len(rel.parts) != 4:
            return False
        mark = self.marks.get(rel.parts[0])
        return mark is not None and f"{rel.parts[1]}/{rel.parts[2]}" < mark

    def _in_window(self, kind: str, path: Path) -> bool:
        s = self.s
        if s.window_start_us is None or s.window_end_us is None:
            return True
        start, end = s.window_start_us, s.window_end_us
        if kind == "queries":
            start -= int((s.max_join_delay_s + s.window_margin_s) * US)
            end += int(s.window_margin_s * US)
        if path not in self._first_ts:
            self._first_ts[path] = first_event_us(path)
        return start <= self._first_ts[path] < end

    def _retry_counts(self) -> tuple[int, int]:
        """(waiting, due) retries. Asked on every trigger, so it reads the small retry set with Arrow rather than
        starting a Spark job while the joiner is idle."""
        import pyarrow.parquet as pq

        if self.retry_dir is None or not any(self.retry_dir.glob("*.parquet")):
            return 0, 0
        due_us = pq.read_table(self.retry_dir, columns=["due_us"])["due_us"].to_numpy()
        return len(due_us), int(np.count_nonzero(due_us <= self.clock.now_us()))

    def _task(self, tag: str, now: int, stage: Path, token: int) -> _Task:
        return _Task(
            dc=self.pipeline,
            tag=tag,
            now=now,
            stage=str(stage),
            state=str(self.state_dir),  # the workers' EventStore caches are keyed by it
            logs=str(self.logs / self.dc / "queries"),
            servers=tuple(sorted(self.servers.items())),
            token=token,
            bucket_s=self.s.bucket_s,
            cache_buckets=self.s.cache_buckets,
            cache_max_rows=self.s.cache_max_rows,
            max_join_delay_us=int(self.s.max_join_delay_s * US),
            retry_base_s=self.s.retry_base_s,
            retry_max_s=self.s.retry_max_s,
            adapter=self.s.adapter,
            max_future_s=self.s.max_future_s,
            max_clock_skew_us=int(self.s.max_clock_skew_s * US),
            clock_offset_us=self.clock.offset.offset_us,
            settle_s=self.s.settle_s,
            horizon_us=self.horizon_us,
            shared_index=str(self.shared_index) if self.shared_index is not None else None,
            settled={f"{k}/{n}": [size, mtime] for (k, n), (size, mtime) in self._settled_as.items()},
        )

    def _job(self, t: _Task, sources: list[tuple[str, str, str]]) -> list[Any]:
        """A batch's one Spark job: parse every source (queries stored first: the shuffle is a barrier), then
        steps 2-6 per partition of click ids; one row of counts per task."""
        from pyspark.sql.pandas.types import from_arrow_schema

        groups = balanced_groups([_size(p) for _, p, _ in sources], self.parallelism)
        return (
            self._tasks(len(groups))
            .mapInArrow(_source_task(t, sources, groups), from_arrow_schema(CANDIDATE))
            .repartition(self.parallelism, "click_id")
            .mapInArrow(_join_task(t), from_arrow_schema(JOIN_TASK))
            .collect()
        )

    def _tasks(self, n: int) -> Any:
        """A DataFrame of task indices 0..n-1 spread over the executors: each task reads its own files."""
        return self.spark.range(0, n, 1, max(1, min(n, self.parallelism)))

    def run_batch(self, k: int, q_files: list[str], c_files: list[str]) -> BatchResult:
        """One micro-batch, one Spark job of two stages: parse (and store the new queries), shuffle by click id,
        steps 2-6 in each partition. Only counts and latencies come back to the driver."""
        assert self.lease is not None
        lease = self.lease
        t_start = time.time()
        now = self.clock.now_us()
        tag = self._tag(k, lease.epoch)
        t = self._task(tag, now, self.staging / tag, lease.token(k).value)
        metrics: dict[str, Any] = {"started_at_us": now, "query_files": len(q_files), "click_files": len(c_files)}

        sources = [("queries", str(self.logs / self.dc / "queries" / n), n) for n in q_files]
        sources += [("clicks", str(self.logs / self.dc / "clicks" / n), n) for n in c_files]
        if self.retry_dir is not None:
            sources += [("retries", str(p), p.name) for p in sorted(self.retry_dir.glob("*.parquet"))]
        counts = dict.fromkeys(JOIN_COUNTS, 0)
        latencies: list[float] = []
        if sources:
            for r in self._job(t, sources):
                for name in JOIN_COUNTS:
                    counts[name] += int(r[name])
                latencies.extend(r["latencies_s"] or [])
        t_job = time.time()
        skipped, read = read_markers(Path(t.stage))
        changed = self._quarantine_changed(Path(t.stage), tag, now)
        _maybe_crash("after_register", k, k - lease.last_batch)
        metrics.update(counts)
        metrics["queries"] = index_rows(Path(t.stage) / "eventstore")
        metrics["quarantined"] = _parquet_rows(Path(t.stage) / QUARANTINE)
        q = np.quantile(np.asarray(latencies), [0.5, 0.9, 0.99]).tolist() if latencies else [None] * 3
        metrics.update({"latency_p50_s": q[0], "latency_p90_s": q[1], "latency_p99_s": q[2]})
        metrics["duration_s"] = time.time() - t_start

        # 7. commit (fenced, in order, with the consumed files and the metrics), then publish.
        files = [("queries", n) for n in q_files] + [("clicks", n) for n in c_files]
        files = [f for f in files if f not in skipped]  # still being written: listed and read again later
        _maybe_crash("before_commit", k, k - lease.last_batch)
        # The commit also acknowledges the newest shard configuration, planned ones included: a reshard waits for it.
        # (The executors' registries follow a new layout when a shard's server refuses their old one.)
        marks = _marks_before(dict(self._next_marks), skipped)
        if skipped:
            log.info("%s batch %d: %d file(s) still being written, left for later", self.pipeline, k, len(skipped))
        self.state.commit(lease, k, files, metrics, marks=marks)
        _maybe_crash("after_commit", k, k - lease.last_batch)
        self._publish(k, lease.epoch)
        self.consumed.update(files)
        self._read_sizes.update({f: read[f] for f in files if f in read})
        del self._changed[:changed]
        if marks != self.marks:  # forget what is behind the marks: it is never listed again
            self.marks = marks
            self.consumed = {
                (kind, n)
                for kind, n in self.consumed
                if (p := part_of_name(n)) is None or (m := marks[kind]) is None or p >= m
            }
            self._first_ts = {p: ts for p, ts in self._first_ts.items() if not self._behind_marks(p)}
            self._read_sizes = {f: v for f, v in self._read_sizes.items() if f in self.consumed}
        self.retry_dir = self.state_dir / "retries" / t.tag
        self.last_batch = k
        took = (t_job - t_start, time.time() - t_job)
        log.info("%s batch %d: job %.2fs, commit %.2fs: %s", self.pipeline, k, *took, metrics)
        return BatchResult(k, metrics)

    def _quarantine_changed(self, stage: Path, tag: str, now: int) -> int:
        """Stage the quarantine records of consumed files found changed (``_check_consumed``); how many."""
        from photon.joiner.eventstore import atomic_write

        n = len(self._changed)
        for kind in ("queries", "clicks"):
            rows = [{k: v for k, v in r.items() if k != "kind"} for r in self._changed[:n] if r["kind"] == kind]
            if rows:
                bad = pa.Table.from_pylist(rows, schema=BAD_FIELDS)
                atomic_write(
                    _quarantine(bad, self.pipeline, kind, now), stage / QUARANTINE / f"{tag}-changed-{kind}.parquet"
                )
        return n

    def _publish(self, k: int, epoch: int) -> None:
        publish_files(self.root, batch_tag(k, epoch))
        self.state.mark_published(k)


def _marks_before(marks: dict[str, str | None], skipped: set[tuple[str, str]]) -> dict[str, str | None]:
    """Listing marks that stay at or before every partition holding a file left for later, so it is listed again."""
    for kind, name in skipped:
        part, mark = part_of_name(name), marks.get(kind)
        if part is not None and mark is not None and part < mark:
            marks[kind] = part
    return marks


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0  # its task finds it gone (a retry set behind a lease start) the same way


def balanced_groups(sizes: list[int], n: int) -> list[list[int]]:
    """Sources into at most ``n`` groups of about equal bytes, one task each (a task's time is mostly parsing, which
    goes with the bytes): the largest first, each into the lightest group (LPT). Each group keeps its sources in
    their order, so a task takes its query files first. Splitting by count left one core idle for a third of stage
    1 when query files outweighed click files."""
    groups: list[list[int]] = [[] for _ in range(max(1, min(n, len(sizes))))]
    load = [0] * len(groups)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        g = load.index(min(load))
        groups[g].append(i)
        load[g] += sizes[i] + 1
    return [sorted(g) for g in groups if g]


def batch_tag(batch: int, epoch: int) -> str:
    """The name a batch's staged files start with: its number and the epoch of the lease that ran it."""
    return f"b{batch:010d}-e{epoch}"


def publish_files(root: Path, tag: str) -> None:
    """Move a committed batch's staged files (``<root>/_staging/<tag>``) into place under their staged names.
    Idempotent, and safe beside another process publishing the same batch (a lease start, the verifier rolling a
    dead pipeline's batch forward): each file is renamed whole, once; whoever comes second finds it gone."""
    stage = root / "_staging" / tag
    moves = [(stage / "eventstore", root / "_state" / "eventstore")]
    moves += [(stage / kind, root / kind) for kind in (JOINED, UNJOINABLE, QUARANTINE)]
    for src, dst in moves:
        make_dirs(dst)
        if not src.is_dir():
            continue
        touched: set[Path] = set()
        for part in sorted(p for p in src.rglob("*") if p.suffix in (".parquet", ".arrow")):
            target = dst / part.relative_to(src)
            make_dirs(target.parent)
            with contextlib.suppress(FileNotFoundError):
                os.replace(part, target)
            touched.add(target.parent)
        for folder in sorted(touched):  # the renames are durable before the batch is marked published
            fsync_dir(folder)
    shutil.rmtree(stage, ignore_errors=True)


def first_event_us(path: Path, peek_bytes: int = 1 << 16) -> int:
    """The timestamp of a log file's first well-formed line within its first ``peek_bytes`` (a closed file never
    changes, so this is asked once per file); the file's modification time where none parses there."""
    with open(path, "rb") as fh:
        head = fh.read(peek_bytes)
    for line in head.split(b"\n")[:-1] if len(head) == peek_bytes else head.split(b"\n"):
        try:
            ts = json.loads(line).get("ts_us")
        except (ValueError, AttributeError):
            continue
        if isinstance(ts, int) and not isinstance(ts, bool):
            return ts
    return int(path.stat().st_mtime * US)


def _parquet_rows(folder: Path) -> int:
    """Rows written under a folder, from the Parquet footers: no Spark job needed to count what was written."""
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(p).metadata.num_rows for p in folder.rglob("*.parquet")) if folder.is_dir() else 0
