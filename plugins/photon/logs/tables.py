"""The output as Delta tables (EVENTS.md, "Output"): per pipeline, ``<out>/<pipeline>/{joined,unjoinable,quarantine}``,
each a Delta table partitioned by ``hour`` (``YYYYmmddHH``, UTC: the click's hour, a quarantine record's decision's).

A batch's data files are written into the table's location by the tasks that produced them (``stage_rows``), before
the registry commit, and are invisible to every reader of the table until the batch is committed to it. After the
fenced registry commit, ``publish_batch`` commits them in one Delta commit per table carrying the application
transaction ``txn(photon/<pipeline>, batch)``: Delta's own idempotency key. A second publish of batch k (a lease
start, the verifier rolling a dead pipeline's batch forward, a zombie lease waking up) finds the table's version for
the pipeline at k or past it and commits nothing; two publishers racing lose to one another in Delta's conflict
check (same application id), and the loser then finds it done. Data files no commit names (a batch that crashed
before its registry commit) are never read; ``photon table maintain`` vacuums them.

Every row carries its ``batch``, so a batch's rows are found by value in the table after compaction rewrote its
files. A process that forks after using ``deltalake`` must not use it in the child (its runtime is not fork-safe):
the joiner's Spark tasks write Parquet only and never import it."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from photon.logs.schemas import (
    JOINED,
    JOINED_SCHEMA,
    QUARANTINE,
    QUARANTINE_SCHEMA,
    UNJOINABLE,
    UNJOINABLE_SCHEMA,
)
from photon.storage import LocalStore, StorageError, Store, again, as_store, broke_off, error_text

if TYPE_CHECKING:
    import pyarrow.dataset as ds
    from deltalake import DeltaTable

PARTITION = "hour"
# A table commit (deltalake 1.6) reads back every commit since the last checkpoint: on an object store, a GET each,
# so up to 100 per table and batch with Delta's default interval; every 10th commit writes one instead (measured on
# a bucket: 17-28 requests per append at any version against 26 at version 10 and 76 at version 60).
CHECKPOINT_EVERY = 10
BATCH = "batch"
# The rows as the tasks build them (EVENTS.md); a table's schema adds ``batch`` and the partition column.
ROW_SCHEMAS = {JOINED: JOINED_SCHEMA, UNJOINABLE: UNJOINABLE_SCHEMA, QUARANTINE: QUARANTINE_SCHEMA}
TIME_COLUMN = {JOINED: "click_ts_us", UNJOINABLE: "click_ts_us", QUARANTINE: "decided_at_us"}
ADDS = "_adds"  # under a batch's stage folder: per data file written, what its Delta add action needs
US = 1_000_000


def table_schema(kind: str) -> pa.Schema:
    """The Delta table's schema: the rows' columns, then ``batch`` and ``hour``."""
    return ROW_SCHEMAS[kind].append(pa.field(BATCH, pa.int64())).append(pa.field(PARTITION, pa.string()))


def app_id(pipeline: str) -> str:
    """The Delta application id a pipeline's batches commit under: its txn version is its last published batch."""
    return f"photon/{pipeline}"


def hour_of(ts_us: int) -> str:
    """The ``hour`` partition value of a time: ``YYYYmmddHH``, UTC (as the ``_final/`` markers name hours)."""
    return time.strftime("%Y%m%d%H", time.gmtime(ts_us // US))


class OutputTableError(ValueError):
    """``--out`` holds something that is not this project's output table (an old folder layout, another table):
    refused, never mixed into. The message is one line."""


# -- Writing: the tasks, before the registry commit ------------------------------------------------------------


def stage_rows(
    root: Path | Store, kind: str, stage: str, name: str, rows: pa.Table, batch: int, *, replace: bool = False
) -> int:
    """Write ``rows`` (``ROW_SCHEMAS[kind]``) of batch ``batch`` as data files of the pipeline's ``kind`` table in
    ``root`` (``<out>/<pipeline>``, a folder or a store), one file per hour, named ``<name>-<hour>-<call>.parquet``;
    record each file's add action in ``<stage>/_adds/<kind>-<name>.json`` (``stage``: a key under ``root``). Invisible
    to readers until ``publish_batch``. Returns the rows written.

    Each call writes data files of its own (``<call>``, random) and then the one record of ``name``, whole: of two
    attempts of a task running at once (Spark's speculative or orphaned ones), whose bytes may differ, the record
    that lands last names files its own call wrote whole. The other's files stay unnamed, for the vacuum.

    No rows: nothing is written, unless ``replace`` (a task's retry) says to put a record of no files, in place of
    one an earlier try of the task put: a retry may decide otherwise (its clicks joined before, given up now)."""
    return _rows_of(_stage(as_store(root), kind, stage, name, rows, batch, replace))


def _stage(
    store: Store, kind: str, stage: str, name: str, rows: pa.Table, batch: int, replace: bool = False
) -> list[dict[str, Any]]:
    """``stage_rows``: the add actions recorded."""
    if rows.num_rows == 0:
        if replace:
            store.put(adds_key(stage, kind, name), json.dumps({"kind": kind, "files": []}).encode())
        return []
    rows = rows.select(ROW_SCHEMAS[kind].names).cast(ROW_SCHEMAS[kind])
    rows = rows.append_column(BATCH, pa.array([batch] * rows.num_rows, pa.int64()))
    secs = pc.divide(rows.column(TIME_COLUMN[kind]), pa.scalar(US, pa.int64()))
    hours = pc.strftime(pc.cast(pc.multiply(secs, pa.scalar(US, pa.int64())), pa.timestamp("us", "UTC")), "%Y%m%d%H")
    adds = []
    call = uuid.uuid4().hex[:12]
    for hour in sorted(pc.unique(hours).to_pylist()):
        part = rows.filter(pc.equal(hours, hour))
        rel = f"{PARTITION}={hour}/{name}-{hour}-{call}.parquet"
        data = parquet_bytes(part)
        store.put(f"{kind}/{rel}", data)
        adds.append({"path": rel, "size": len(data), "hour": hour, "stats": _stats(part)})
    store.put(adds_key(stage, kind, name), json.dumps({"kind": kind, "files": adds}).encode())
    return adds


def adds_key(stage: str, kind: str, name: str) -> str:
    """Where ``stage_rows`` records the add actions of the ``kind`` files it wrote as ``name``."""
    return f"{stage}/{ADDS}/{kind}-{name}.json"


def parquet_bytes(table: pa.Table) -> bytes:
    """``table`` as one Parquet file's bytes (written whole by a store's put)."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def _stats(rows: pa.Table) -> str:
    """Delta file statistics: the row count, and min, max and null count of the integer columns and ``click_id``
    (what data skipping and a reader's count use; the text columns' bounds would only lengthen the log)."""
    lo: dict[str, Any] = {}
    hi: dict[str, Any] = {}
    nulls: dict[str, int] = {}
    for field in rows.schema:
        if pa.types.is_integer(field.type) or field.name == "click_id":
            col = rows.column(field.name)
            mm = pc.min_max(col)
            if mm["min"].is_valid:
                lo[field.name], hi[field.name] = mm["min"].as_py(), mm["max"].as_py()
            nulls[field.name] = col.null_count
    return json.dumps({"numRecords": rows.num_rows, "minValues": lo, "maxValues": hi, "nullCount": nulls})


def staged_adds(root: Path | Store, stage: str) -> dict[str, list[dict[str, Any]]]:
    """Per kind, the add actions a batch's tasks recorded under its stage (empty if none: nothing staged, or the
    stage already removed after its publish)."""
    store = as_store(root)
    found: dict[str, list[dict[str, Any]]] = {}
    for e in store.files(f"{stage}/{ADDS}"):
        if not e.key.endswith(".json"):
            continue
        try:
            entry = json.loads(store.get(e.key))
        except FileNotFoundError:
            continue  # removed since the listing: its batch was published by another process
        found.setdefault(entry["kind"], []).extend(entry["files"])
    return found


def staged_rows(root: Path | Store, stage: str, kind: str, at_least: int = 0) -> int:
    """Rows of ``kind`` a batch's tasks staged (from their records: no data file is read). Told how many there should
    be (``at_least``), the stage is listed again while it lists fewer, within the storage retry budget."""
    store = as_store(root)
    if not at_least:
        return _rows_of(staged_adds(store, stage).get(kind, []))
    try:
        return _rows_of(_staged(store, stage, {kind: at_least}).get(kind, []))
    except StageShortError:
        return _rows_of(staged_adds(store, stage).get(kind, []))


def _rows_of(adds: list[dict[str, Any]]) -> int:
    """Rows in the data files of these add records (their statistics')."""
    return sum(json.loads(a["stats"])["numRecords"] for a in adds)


# -- Publishing: the driver, after the fenced registry commit ---------------------------------------------------


@contextlib.contextmanager
def store_errors(store: Store, key: str) -> Iterator[None]:
    """deltalake's failures to reach the store (an ``OSError`` spanning many lines, in colour) as one
    ``StorageError`` line naming the table; its own verdicts (a lost commit race, no table) as they are."""
    from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError

    try:
        yield
    except (CommitFailedError, TableNotFoundError, StorageError):
        raise
    except OSError as exc:
        raise StorageError(f"{store.location(key)}: {error_text(exc)}") from None
    except DeltaError as exc:
        # A commit's own reads of the store fail as a DeltaError, not an OSError (CI: the store down past the budget
        # while a commit listed the log: a traceback and exit 1 instead of the lease's one line, exit 2).
        if "object store" not in str(exc):
            raise
        raise StorageError(f"{store.location(key)}: {error_text(exc)}") from None


def cut_off(exc: BaseException) -> bool:
    """A store's failure that says its answer broke off midway (a server that went away while it answered): deltalake
    tries again a request that got no answer, never a listing of `_delta_log` whose body broke off, nor a commit's
    put reset mid-way. Worth trying again where the request is idempotent (a read; a commit under the batch's txn)."""
    return isinstance(exc, StorageError) and broke_off(exc)


def _delta(store: Store, key: str) -> DeltaTable:
    """The Delta table at ``key`` of ``store`` (TableNotFoundError if there is none). Read again where its answer
    broke off: a lease's start and its first publish failed at once on one cut listing of the table's log."""
    from deltalake import DeltaTable

    uri, options = store.delta_location(key)

    def table() -> DeltaTable:
        with store_errors(store, key):
            return DeltaTable(uri, storage_options=options or None)

    return again(table, cut_off)


# A version of a table: a commit or a checkpoint (one file, or a part of several) in its `_delta_log/`.
_VERSION_FILE = re.compile(r"^\d{20}\.(json|checkpoint(\.\d+\.\d+)?\.parquet)$")


def is_table(store: Store, key: str) -> bool:
    """Whether ``key`` holds a Delta table: a version in its `_delta_log/`, listed with the store's own client, which
    rides an answer cut off midway (deltalake's ``is_deltatable`` waited out its 30 s timeout after one)."""
    return any(_VERSION_FILE.match(e.key.rpartition("/")[2]) for e in store.files(f"{key}/_delta_log"))


def open_table(root: Path | Store, kind: str) -> DeltaTable:
    """The pipeline's ``kind`` table, created if there is none yet; refused (``OutputTableError``) if its folder
    holds something else."""
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    store = as_store(root)
    uri, options = store.delta_location(kind)
    try:
        table = _delta(store, kind)
    except TableNotFoundError:
        _refuse_foreign(store, kind)

        def create() -> DeltaTable:  # "ignore": made again, it is the table another made (a racing creator, a retry)
            with store_errors(store, kind):
                return DeltaTable.create(
                    uri,
                    table_schema(kind),
                    partition_by=[PARTITION],
                    mode="ignore",
                    name=f"photon {kind}",
                    configuration={"delta.checkpointInterval": str(CHECKPOINT_EVERY)},
                    storage_options=options or None,
                )

        try:
            return again(create, cut_off)
        except Exception as exc:  # a racing creator: the table is there now, or the error is real
            try:
                table = _delta(store, kind)
            except TableNotFoundError:
                raise exc from None
    check_schema(table, kind, uri)
    return table


# The tables a process publishes to, kept open: a table opened anew replays its log from the last checkpoint at
# every batch (up to about 200 ms a batch once thousands of commits pile up); an open one reads only the commits
# since it last looked (``update_incremental`` before every decision).
_PUBLISHING: dict[tuple[str, int], DeltaTable] = {}


def _publisher_table(root: Store, kind: str) -> DeltaTable:
    key = (f"{root.url}/{kind}", os.getpid())  # never a table another process opened (deltalake is not fork-safe)
    table = _PUBLISHING.get(key)
    if table is None:
        table = _PUBLISHING[key] = open_table(root, kind)
    return table


def _refuse_foreign(store: Store, kind: str) -> None:
    """A table's folder that is not a Delta table may hold only a batch's data files not yet committed (``hour=*/``
    with Parquet inside): never an old layout's Parquet files beside."""
    if isinstance(store, LocalStore) and store.path(kind).exists() and not store.path(kind).is_dir():
        raise OutputTableError(f"{store.path(kind)} is a file, not an output table: choose another --out")
    strays = [e.key.rpartition("/")[2] for e in store.files(kind)]
    strays += [f for f in store.folders(kind) if not f.startswith(f"{PARTITION}=")]
    strays = [n for n in strays if not n.startswith(".")]
    if strays:
        raise OutputTableError(
            f"{store.location(kind)} is not a Delta table but holds {', '.join(sorted(strays)[:3])}"
            f"{' ...' if len(strays) > 3 else ''} (an output folder of an older version of this project?): "
            "refused, nothing written; use an empty --out"
        )


def check_schema(table: DeltaTable, kind: str, where: Path | str) -> None:
    """Refuse a Delta table that is not this project's ``kind`` table (its columns or partitioning differ)."""
    have = [f.name for f in table.schema().fields]
    if have != table_schema(kind).names or table.metadata().partition_columns != [PARTITION]:
        raise OutputTableError(
            f"{where} is a Delta table but not photon's {kind} table (columns {have}, partitioned by "
            f"{table.metadata().partition_columns}): refused, nothing written; use another --out"
        )


def ensure_tables(root: Path | Store) -> None:
    """Create the pipeline's three tables in ``root`` if missing; refuse (``OutputTableError``, one line) an
    ``--out`` whose pipeline folder holds anything else there: an old folder layout, another table."""
    for kind in (JOINED, UNJOINABLE, QUARANTINE):
        open_table(root, kind)


def published_batch(root: Path | Store, kind: str) -> int | None:
    """The pipeline's last batch committed to its ``kind`` table (its Delta txn version), None if none."""
    store = as_store(root)
    if not is_table(store, kind):
        return None
    return _delta(store, kind).transaction_version(app_id(store.url.rstrip("/").rpartition("/")[2]))


class StageShortError(StorageError):
    """A batch's stage lists fewer rows of a kind than its tasks reported staging: never published so."""


class StageExcessError(StorageError):
    """A batch's stage lists more rows of a kind than its tasks reported staging: never published so."""


def _staged(
    store: Store, stage: str, expect: Mapping[str, int], done: Callable[[], bool] = lambda: False
) -> dict[str, list[dict[str, Any]]]:
    """The stage's adds, listed until they hold at least the rows ``expect`` names per kind (within the storage retry
    budget; then ``StageShortError``, at once when ``done()`` says no one needs them any more). Found under a store
    SIGKILLed again and again: a stage listed empty just after its adds record was put (acknowledged), and the
    publish took it for "nothing staged" and lost the batch."""
    tries = 0

    def listed() -> dict[str, list[dict[str, Any]]]:
        nonlocal tries
        tries += 1
        adds = staged_adds(store, stage)
        for kind, want in expect.items():
            have = _rows_of(adds.get(kind, []))
            if have < want:
                if tries > 1 and done():
                    raise _NotNeeded
                raise StageShortError(
                    f"{store.location(stage)}: the stage lists {have} {kind} rows of the {want} its tasks staged (the"
                    " store's listing is missing some): not published; the batch is published again later"
                )
        return adds

    try:
        return again(listed, lambda exc: isinstance(exc, StageShortError) and not isinstance(exc, _NotNeeded))
    except _NotNeeded:
        raise StageShortError(f"{store.location(stage)}: published meanwhile by another") from None


class _NotNeeded(StageShortError):
    """A short stage that another publisher has published meanwhile."""


def publish_batch(
    root: Path | Store,
    pipeline: str,
    batch: int,
    stage: str,
    committed: Callable[[str], None] | None = None,
    expect: Mapping[str, int] | None = None,
    staged: Mapping[str, list[dict[str, Any]]] | None = None,
) -> dict[str, str]:
    """Commit batch ``batch``'s staged data files (their adds under ``stage``, a key of ``root``) to the pipeline's
    tables, one Delta commit per table carrying ``txn(photon/<pipeline>, batch)``. Idempotent and safe beside other
    publishers of the same batch. Per kind: "committed", "already" (the table holds the batch or a later one) or
    "none" (nothing staged). ``committed(kind)`` is called after each commit (the tests' crash points). ``expect``:
    the rows per kind the caller knows were staged (its tasks' counts): fewer listed is ``StageShortError``, never a
    publish of less, and more ``StageExcessError``, never a publish of rows the batch's counts do not know.
    ``staged``: the add actions per kind, from a caller that staged them itself (the stage is then not listed)."""
    from deltalake import CommitProperties, Transaction
    from deltalake.exceptions import CommitFailedError
    from deltalake.transaction import AddAction, RemoveAction

    store = as_store(root)
    adds = dict(staged) if staged is not None else staged_adds(store, stage)
    for kind, want in (expect or {}).items():  # before any commit: a batch refused is in none of its tables
        _check_excess(store, pipeline, batch, stage, kind, adds.get(kind, []), want)
    done: dict[str, str] = {}
    for kind in (JOINED, UNJOINABLE, QUARANTINE):
        table = _publisher_table(store, kind)  # every kind's table made at the first publish, with or without rows
        want = (expect or {}).get(kind, 0)
        if _rows_of(adds.get(kind, [])) < want:
            # Short: a stage already published and removed (a publisher that died before marking it published), or
            # a listing that missed some adds; only the table tells them apart.
            if _holds(store, kind, table, pipeline, batch):
                done[kind] = "already"
                continue
            try:
                # Published by another meanwhile (its stage removed): no use waiting out the budget for it
                adds = _staged(
                    store, stage, {kind: want}, functools.partial(_holds, store, kind, table, pipeline, batch)
                )
            except StageShortError:
                if not _holds(store, kind, table, pipeline, batch):
                    raise
                done[kind] = "already"
                continue
        files = adds.get(kind, [])
        if not files:
            done[kind] = "none"
            continue
        # Checked before the loop; again here, as a relisting above may have found more
        if (
            expect is not None
            and kind in expect
            and not _check_excess(store, pipeline, batch, stage, kind, files, expect[kind])
        ):
            done[kind] = "already"
            continue
        now_ms = int(time.time() * 1000)
        actions: list[AddAction | RemoveAction] = [
            AddAction(a["path"], a["size"], {PARTITION: a["hour"]}, now_ms, True, a["stats"]) for a in files
        ]
        props = CommitProperties(
            app_transactions=[Transaction(app_id(pipeline), batch)],
            custom_metadata={"photon.pipeline": pipeline, "photon.batch": batch},
        )

        def commit(
            kind: str = kind, actions: list[AddAction | RemoveAction] = actions, props: CommitProperties = props
        ) -> str:
            table = _publisher_table(store, kind)
            while True:
                with store_errors(store, kind):
                    table.update_incremental()
                have = table.transaction_version(app_id(pipeline))
                if have is not None and have >= batch:
                    return "already"
                try:
                    with store_errors(store, kind):
                        table.create_write_transaction(
                            actions, "append", table_schema(kind), [PARTITION], commit_properties=props
                        )
                    return "committed"
                except CommitFailedError:
                    continue  # another publisher committed first: read the table again and see what it holds

        # A request cut off by a store that went away (a commit's put reset mid-way is retried by no client): read the
        # table again and commit, or find the commit that landed; the store SIGKILLed under 3 publishers failed 3 of
        # 20 kills so, and the lease with them.
        done[kind] = again(commit, cut_off)
        if committed is not None and done[kind] == "committed":
            committed(kind)
    return done


def _check_excess(
    store: Store, pipeline: str, batch: int, stage: str, kind: str, files: list[dict[str, Any]], want: int
) -> bool:
    """Whether the stage's ``kind`` records may be published: not more rows than the batch's tasks reported
    (``StageExcessError``: records the batch's counts do not know, of a task's try Spark did not accept), unless the
    table holds the batch already (False)."""
    have = _rows_of(files)
    if have <= want:
        return True
    if _holds(store, kind, _publisher_table(store, kind), pipeline, batch):
        return False
    raise StageExcessError(
        f"{store.location(stage)}: the stage lists {have} {kind} rows, more than the {want} its tasks reported (a"
        " task's try other than the one Spark accepted left its records): not published"
    )


def _holds(store: Store, kind: str, table: DeltaTable, pipeline: str, batch: int) -> bool:
    """Whether the ``kind`` table holds batch ``batch`` of ``pipeline`` (or a later one) as the store has it now."""

    def read() -> bool:
        with store_errors(store, kind):
            table.update_incremental()
        have = table.transaction_version(app_id(pipeline))
        return have is not None and have >= batch

    return again(read, cut_off)


def append_rows(root: Path | Store, kind: str, rows: pa.Table, batch: int) -> None:
    """Commit ``rows`` to the pipeline's ``kind`` table as batch ``batch`` in one call, the way a batch reaches it
    (data files, then one commit under the batch's txn): for benchmarks and tools that make output without Spark."""
    store = as_store(root)
    stage = f"_staging/append-{new_name(kind)}"
    # What it staged, passed on rather than listed: a SeaweedFS SIGKILLed again and again has kept an acknowledged
    # adds record out of its folder's listing (a HEAD found it) until another object was put there.
    adds = _stage(store, kind, stage, f"b{batch:010d}-{kind}", rows, batch)
    publish_batch(store, store.url.rstrip("/").rpartition("/")[2], batch, stage, staged={kind: adds})
    store.remove_all(stage)


# -- Reading: every reader of the output ------------------------------------------------------------------------


@dataclass(frozen=True)
class OutputTable:
    """One pipeline's table of one kind: ``key`` (``<pipeline>/<kind>``) in the output's ``store``."""

    pipeline: str
    kind: str
    store: Store
    key: str

    @classmethod
    def at(cls, root: Path | Store, kind: str) -> OutputTable:
        """The ``kind`` table of the pipeline folder ``root`` (``<out>/<pipeline>``)."""
        store = as_store(root)
        name = store.url.rstrip("/").rpartition("/")[2]
        return cls(name, kind, store, kind)

    @property
    def uri(self) -> str:
        """Where the table is (a path or an s3:// URL), for messages."""
        return self.store.location(self.key)

    @property
    def path(self) -> Path:
        """A folder's table: its folder (the tools that rewrite files in place work on folders only)."""
        if not isinstance(self.store, LocalStore):
            raise OutputTableError(f"{self.uri}: this command works on an output folder, not an object store (yet)")
        return self.store.path(self.key)

    def table(self) -> DeltaTable:
        return _delta(self.store, self.key)

    def dataset(self) -> ds.Dataset:
        """The snapshot as an Arrow dataset: only committed files, partitions and file statistics pruned by filters."""
        return self.table().to_pyarrow_dataset()


def pipelines(out: Path | Store) -> list[str]:
    """The pipelines with output in ``out``: folders not starting with ``_`` or ``.`` that hold a table."""
    store = as_store(out)
    if isinstance(store, LocalStore) and not store.root.is_dir():
        return []
    return sorted(
        name
        for name in store.folders()
        if name[0] not in "_." and any(is_table(store, f"{name}/{kind}") for kind in (JOINED, UNJOINABLE, QUARANTINE))
    )


def tables(out: Path | Store, kind: str, only: Iterable[str] | None = None) -> Iterator[OutputTable]:
    """Every pipeline's ``kind`` table in ``out`` (or those of ``only``) that exists."""
    store = as_store(out)
    for name in only if only is not None else pipelines(store):
        if is_table(store, f"{name}/{kind}"):
            yield OutputTable(name, kind, store, f"{name}/{kind}")


def read(
    out: Path | Store,
    kind: str,
    columns: list[str] | None = None,
    where: ds.Expression | None = None,
    only: Iterable[str] | None = None,
    with_pipeline_folder: bool = False,
) -> pa.Table:
    """``columns`` of every pipeline's committed ``kind`` rows in ``out`` that match ``where``, one table (with a
    ``folder`` column naming the pipeline's folder if asked)."""
    cols = columns or table_schema(kind).names
    parts = []
    for t in tables(out, kind, only):
        part = t.dataset().to_table(columns=cols, filter=where)
        if with_pipeline_folder:
            part = part.append_column("folder", pa.array([t.pipeline] * part.num_rows, pa.string()))
        parts.append(part)
    if not parts:
        empty = pa.schema([table_schema(kind).field(c) for c in cols])
        if with_pipeline_folder:
            empty = empty.append(pa.field("folder", pa.string()))
        return empty.empty_table()
    return pa.concat_tables(parts, promote_options="permissive")


def hour_filter(kind: str, start_us: int, end_us: int) -> ds.Expression:
    """Rows of ``kind`` whose time is in ``[start_us, end_us)``, with the partition bound that prunes whole hours."""
    import pyarrow.dataset as ds

    col = TIME_COLUMN[kind]
    first, last = hour_of(start_us), hour_of(max(start_us, end_us - 1))
    return (
        (ds.field(PARTITION) >= first)
        & (ds.field(PARTITION) <= last)
        & (ds.field(col) >= start_us)
        & (ds.field(col) < end_us)
    )


def new_name(prefix: str) -> str:
    """A data file name no other writer uses (compaction and maintenance outputs)."""
    return f"{prefix}-{uuid.uuid4().hex}-{os.getpid()}"
