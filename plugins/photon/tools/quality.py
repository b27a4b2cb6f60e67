"""Data-quality checks over the output of every pipeline for one interval, as a Great Expectations (1.x) checkpoint.

Two batches are validated per interval ``[start, end)``:
- ``joined``: the joined rows, of all pipelines together, whose click is stamped in the interval. Click ids unique
  across pipelines, required fields present, the click after its query (within the maximum clock skew), and the
  live pipelines' end-to-end latency within the SLO for most clicks.
- ``rates``: one row. Unjoinable clicks per decided click of the interval; quarantined lines of the interval's input
  per decided click; the interval's click files (expected input: at least ``min_click_files``, unless
  ``allow_empty``). A rate is judged only over ``min_rate_denominator`` decided clicks (lines, for quarantine): over
  fewer it is null (GX leaves nulls out) and reported in the result.
- ``completeness``: one row per input click (``completeness_frame``).

Each check means the same on a live hour and on one backfilled a week later:

- **Latency is the live pipelines' own.** End-to-end latency is ``joined_at_us - click_ts_us`` (docs/EVENTS.md). The
  output records no arrival time, and none would help: a backfill joins, on purpose, files that arrived hours or days
  before it ran, so any latency of its rows measures the age of the history it was asked to join. Rows of backfill
  pipelines (``backfill-...``, as ``photon_backfill`` names them) therefore get no latency (null, which GX leaves out
  of ``mostly``) and are judged by every other expectation. So do a live pipeline's rows of history (``_history``):
  clicks whose file arrived more than the SLO before that pipeline's first output (a pipeline started at the beginning
  of the logs joins days of them). Every other row is held to the SLO. A live pipeline that fell behind (its replica
  stalled, its joiner was down) fails the hours it joined late, as it should: that output reached its readers late.
- **Quarantine by the interval's input.** A quarantine record names its log file and line, not a time, and neither
  its decision time (when some pipeline read the line: a backfill reads history today) nor the line's own timestamp
  (the line is malformed) says which hour it belongs to. So a quarantined line belongs to the interval of its log
  file, by the rule ``photon_backfill`` uses to pick an interval's click files: the timestamp of the file's first
  well-formed event (``first_event_us``, read from ``<logs>/<dc>/<kind>/<file>``; the data center is the pipeline's,
  from its ``_pipeline.json``). A line counts once however many pipelines and replicas quarantined it; the verifier's
  ``recovered-*`` files are copies and never count. Only records decided after the interval began (less twice the
  clock skew) can belong to it, so the check reads the first bytes of a few files, not the history. A file no longer
  in the logs is reported (``quarantine_unattributed``), not counted. The rate is per ``max(decided, 1)``, judged
  from ``min_rate_denominator`` lines (decided clicks plus quarantined lines) on: many bad lines and no click fail.

The GX project lives in ``<out>/_quality/gx`` and the Data Docs site (HTML) in ``<out>/_quality/data_docs``; both
folders start with ``_`` so no reader of the output takes them for a pipeline. A run validates in an in-memory GX
context of its own and then, one run at a time (``_project``), stores its results in the project and builds
their pages and the index: runs at once (Airflow's, one per hour) share no GX state while they validate. On an
object store the output and the logs are read through it and the project is published through a temporary folder
under a lock in the bucket (``_project``); the site's pages are then objects under ``<out>/_quality/data_docs/``. GX's
logging is kept to warnings and its progress bars are off; the check logs one line per failed expectation
(``photon.tools.quality``).

**Data Docs offline.** GX's pages load Bootstrap, bootstrap-table (which draws every list, the validation results
included), jQuery and the rest from CDNs, so without internet they render blank. ``make setup`` installs the npm
packages those CDN links serve, at the versions the pages name
(``plugins/photon/tools/data_docs/package-lock.json``), beside the venv; after each run the check copies the few files
a page loads into ``<site>/static/vendor/`` and points the pages there (the two files GX pins by SRI hash are
byte-identical: a test checks the hashes). The Vega scripts are
dropped: only distribution expectations (KL divergence) draw charts, and this checkpoint has none. Without the
assets installed the pages keep their CDN links and a warning says so.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import sys
import time
import urllib.parse
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from photon.joiner.common import RECOVERED_PREFIX
from photon.joiner.discovery import first_event_us
from photon.logs import tables
from photon.logs.layout import MINUTE_US, data_center_of, partition_of, partition_start_us
from photon.logs.parse import parse_file_located
from photon.logs.schemas import JOINED, QUARANTINE, UNJOINABLE
from photon.settings import time_bound_s
from photon.storage import LocalStore, Store, as_store

log = logging.getLogger(__name__)

US = 1_000_000
QUALITY_DIR = "_quality"
REQUIRED = ["click_id", "query_id", "ad_id", "click_ts_us", "query_ts_us", "joined_at_us", "pipeline"]
BACKFILL_PREFIX = "backfill-"  # photon_backfill's pipelines: backfill-<dc>-<interval start>


@dataclass(frozen=True)
class QualitySettings:
    max_clock_skew_s: float = 10.0  # a click may carry a timestamp up to this much before its query's
    latency_slo_s: float = 60.0  # live pipelines, end-to-end: joined_at minus the click's timestamp
    latency_mostly: float = 0.99  # share of live pipelines' clicks that must meet the SLO
    max_unjoinable_rate: float = 0.05  # unjoinable clicks per decided click
    max_quarantine_rate: float = 0.05  # quarantined lines (queries' and clicks') of the interval per decided click
    # A rate over a handful of clicks says nothing (3 bad lines beside 4 clicks is 0.75): the unjoinable rate is judged
    # from this many decided clicks on, the quarantine rate from this many lines (decided clicks plus quarantined
    # lines); below, each is reported (QualityResult) and not judged.
    min_rate_denominator: int = 100
    # Expected input: an interval whose click files (every replica's copy counted) are fewer than this fails, unless
    # ``allow_empty`` accepts it (an hour nobody clicked, on purpose): 0 files is what stopped log shipping looks like.
    min_click_files: int = 1
    allow_empty: bool = False
    # Completeness: an interval is settled, and judged, once its arrival partitions are sealed (``seal_s``: follows
    # max_clock_skew_s as the joiners' seal does) and the clicks of its last files have had the joiners' maximum join
    # delay plus this margin (batch time, retry backoff, publication) to be decided.
    max_join_delay_s: float = 120.0  # the joiners' JoinSettings.max_join_delay_s
    settle_margin_s: float = 120.0
    # The Data Docs index reads every validation result it lists (about 5 ms each), so it would grow with the
    # history: it lists the newest this many (a week of hourly checks, three results each); older results keep
    # their pages, unlisted.
    index_results: int = 3 * 24 * 7

    def settled_at_us(self, end_us: int) -> int:
        """When the interval ending at ``end_us`` has settled: no click file can land in it any more, and every click
        of its files that a live pipeline consumed has had its deadline."""
        return end_us + int((self.seal_s + self.max_join_delay_s + self.settle_margin_s) * US)

    @property
    def seal_s(self) -> float:
        """A log partition is sealed this long after its end (settings.time_bound_s of this skew, as the joiners')."""
        return time_bound_s(self.max_clock_skew_s)


class NotSettled(RuntimeError):
    """The interval is not settled yet: its completeness cannot be judged (neither pass nor fail). Ask again later."""


@dataclass
class QualityResult:
    success: bool
    start_us: int
    end_us: int
    joined: int
    unjoinable: int
    quarantined: int  # distinct lines of the interval's input files
    backfilled: int = 0  # joined rows of backfill pipelines: no latency judged
    history: int = 0  # joined rows of live pipelines whose click file arrived before the pipeline began: not judged
    quarantine_unattributed: int = 0  # quarantine records whose log file is gone: not counted
    input_clicks: int = 0  # distinct well-formed clicks in the interval's click files (all replicas)
    input_files: int = 0  # click files of the interval, every replica's copy counted
    unjoinable_rate: float = 0.0  # as computed, judged or not (QualitySettings.min_rate_denominator)
    quarantine_rate: float = 0.0
    rates_not_judged: list[str] = field(default_factory=list)  # the rates whose denominator was too small
    no_outcome: int = 0  # input clicks neither joined nor unjoinable anywhere
    joined_more_than_once: int = 0  # input clicks in the joined tables more than once across all pipelines
    samples: dict[str, list[str]] = field(default_factory=dict)  # a few click ids of each failure
    output_files_read: int = 0  # joined and unjoinable data files the completeness check opened
    output_files: int = 0  # of how many in the tables' snapshots
    quarantine_files_read: int = 0  # quarantine data files opened: those holding lines decided since the interval began
    quarantine_files: int = 0  # of how many in the tables' snapshots
    input_seconds: float = 0.0  # listing and parsing the interval's click files
    output_seconds: float = 0.0  # loading the output tables' snapshots and reading the outcomes
    # Seconds per phase: input, output (as above), frames, gx_setup, validation, data_docs, localize (bench/quality.py)
    phases: dict[str, float] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)  # "batch: expectation(column)" of every failed expectation
    details: list[str] = field(default_factory=list)  # the same, with what was observed
    statistics: dict[str, Any] = field(default_factory=dict)
    docs_index: str = ""

    def summary(self) -> dict[str, Any]:
        """JSON-safe; what the DAG pushes to XCom."""
        return asdict(self)


# What _joined needs of each kind of output, read once by ``outcomes`` together with the click ids it counts.
JOINED_COLUMNS = [*REQUIRED, "user_id", "country", "advertiser_id", "bid_micros"]
OUTPUT_COLUMNS = {JOINED: JOINED_COLUMNS, UNJOINABLE: ["click_id", "click_ts_us"]}


def _with_folder(t: pa.Table, pipeline: str) -> pa.Table:
    """As ``tables.read(with_pipeline_folder=True)`` gives it: each row with the pipeline folder it was read from."""
    return t.append_column("folder", pa.array([pipeline] * t.num_rows, pa.string()))


def _joined(
    out: Path | Store, start_us: int, end_us: int, rows: dict[tuple[str, str], pa.Table] | None = None
) -> tuple[pa.Table, int]:
    """The joined rows of the interval, and the clicks of the interval given up by every pipeline that decided them.
    A joined row without its click time is placed by the time its click id carries (EVENTS.md: ``<ip>-<pid>-<ts>``),
    else by when it was joined: so that a missing ``click_ts_us`` fails the interval it belongs to. ``rows``: what
    ``outcomes`` read for the interval (``Outcomes.rows``), instead of reading the output again."""

    def read(kind: str, columns: list[str], where: ds.Expression) -> pa.Table:
        if rows is None:
            return tables.read(out, kind, columns, where, with_pipeline_folder=True)
        found = [_with_folder(t.filter(where).select(columns), p) for (p, k), t in sorted(rows.items()) if k == kind]
        if not found:
            schema = tables.table_schema(kind)
            return pa.schema([schema.field(c) for c in columns] + [pa.field("folder", pa.string())]).empty_table()
        return pa.concat_tables(found)

    in_range = (ds.field("click_ts_us") >= start_us) & (ds.field("click_ts_us") < end_us)
    joined = read(JOINED, JOINED_COLUMNS, in_range | ds.field("click_ts_us").is_null())
    id_ts = pc.struct_field(pc.extract_regex(joined["click_id"], r"-(?P<ts>\d{1,18})$"), "ts")
    when = pc.coalesce(joined["click_ts_us"], pc.cast(id_ts, pa.int64()), joined["joined_at_us"])
    joined = joined.filter(pc.fill_null(pc.and_(pc.greater_equal(when, start_us), pc.less(when, end_us)), False))
    unjoinable = read(UNJOINABLE, ["click_id"], in_range)
    # A click given up by one pipeline may be joined by the other: count clicks, not rows.
    gave_up = pc.unique(unjoinable.column("click_id"))
    gave_up = pc.filter(gave_up, pc.invert(pc.is_in(gave_up, value_set=pc.unique(joined.column("click_id")))))
    return joined, len(gave_up)


def _quarantined(
    out: Path | Store, logs: Path | Store, start_us: int, end_us: int, skew_us: int
) -> tuple[int, int, int, int]:
    """(distinct quarantined lines whose log file belongs to ``[start_us, end_us)``, records whose file is gone,
    quarantine data files read, in the tables' snapshots). Only the records decided since ``since`` are read: the
    hour partitions from its hour on, and of those the files whose ``decided_at_us`` statistics reach it; a pipeline
    commits a file per batch with bad lines, a month of them in its history."""
    # A file whose first event is stamped at or after start closed after start - skew; no pipeline decided its lines
    # before that (2x: the deciding machine's clock may be skewed too).
    since_us = start_us - 2 * skew_us
    columns = ["kind", "file", "line"]
    since_hour = tables.hour_of(since_us)
    files_where = f"{tables.PARTITION} >= '{since_hour}' AND decided_at_us >= {int(since_us)}"
    found = []
    read = listed = 0
    for table in tables.tables(out, QUARANTINE):
        snapshot = _Snapshot.of(table)
        listed += snapshot.files
        t, n = snapshot.scan(files_where, columns, lambda decided: pc.greater_equal(decided, since_us))
        read += n
        found.append(_with_folder(t, table.pipeline))
    empty = tables.table_schema(QUARANTINE).empty_table().select(columns)
    q = pa.concat_tables(found) if found else _with_folder(empty, "")
    q = q.filter(pc.invert(pc.starts_with(q["file"], RECOVERED_PREFIX)))
    if q.num_rows == 0:
        return 0, 0, read, listed
    first: dict[tuple[str, str], int | None] = {}
    dcs = {p: data_center_of(out, p) for p in pc.unique(q["folder"]).to_pylist()}
    for row in q.group_by(["folder", "kind", "file"]).aggregate([]).to_pylist():
        key = (row["kind"], row["file"])
        if first.get(key) is None:  # replicas hold the same file: one readable copy is enough
            try:
                first[key] = first_event_us(logs, f"{dcs[row['folder']]}/{row['kind']}/{row['file']}")
            except OSError:
                first[key] = None
    key_col = pc.binary_join_element_wise(q["kind"], q["file"], "/")
    mine = [f"{k}/{f}" for (k, f), t in first.items() if t is not None and start_us <= t < end_us]
    gone = [f"{k}/{f}" for (k, f), t in first.items() if t is None]
    lines = q.filter(pc.is_in(key_col, value_set=pa.array(mine, pa.string())))
    unattributed = int(pc.sum(pc.is_in(key_col, value_set=pa.array(gone, pa.string())).cast(pa.int64())).as_py() or 0)
    if unattributed:
        where = as_store(logs).url
        log.warning("%d quarantine record(s) name log files no longer under %s: not counted", unattributed, where)
    return lines.group_by(["kind", "file", "line"]).aggregate([]).num_rows, unattributed, read, listed


# Which rows of a scan to keep, by the kind's time column (``_Snapshot.scan``): a boolean mask, null dropping a row.
Keep = Callable[[pa.ChunkedArray], pa.ChunkedArray]


class QualityInputError(RuntimeError):
    """An output table the check must read is unreadable (a committed data file gone or corrupt): the check cannot
    judge the interval."""


@dataclass
class _Snapshot:
    """One pipeline's table of one kind, at the version loaded: only the data files its commits name are ever read
    (a crashed batch's files, not committed, and files compaction replaced are not)."""

    table: tables.OutputTable
    delta: Any  # deltalake.DeltaTable
    files: int  # data files in the snapshot

    @classmethod
    def of(cls, table: tables.OutputTable) -> _Snapshot:
        delta = table.table()
        return cls(table, delta, delta.get_add_actions(flatten=False).num_rows)

    def adds(self) -> pa.Table:
        """The snapshot's add actions with their statistics (``min.<column>``, ``null_count.<column>``): the log's,
        no data file opened."""
        return pa.table(self.delta.get_add_actions(flatten=True))

    def scan(self, files_where: str, columns: list[str], keep: Keep) -> tuple[pa.Table, int]:
        """``columns`` of the rows ``keep`` keeps (by the kind's time column) in the files ``files_where`` keeps (a
        Delta predicate: partitions select exactly, file statistics prune), and how many files were read.
        Both say the same, so which rows are read does not depend on how they are laid out in files. The files are
        the snapshot's (its log's add actions, ``file_uris``), read in one multi-threaded scan: an hour of 1-s
        batches is thousands of small files, and ``to_pyarrow_dataset`` builds a statistics expression for each,
        which costs as much as reading them (bench/quality.py)."""
        protocol = self.delta.protocol()
        if protocol.min_reader_version > 1:  # deletion vectors, column mapping: a file's rows are not all its rows
            raise QualityInputError(
                f"output table {self.table.uri} needs Delta reader version {protocol.min_reader_version}"
                f" ({', '.join(protocol.reader_features or [])}): this check reads version 1 tables"
            )
        try:
            paths = self.delta.file_uris(file_pruning_predicate=files_where)
            filesystem = None
            if not isinstance(self.table.store, LocalStore):
                # An object store's files through deltalake's own client for it (its options and credentials): the
                # scan stays one multi-threaded read, and no second S3 client is configured.
                from deltalake.fs import DeltaStorageHandler
                from pyarrow.fs import PyFileSystem

                uri, options = self.table.store.delta_location(self.table.key)
                filesystem = PyFileSystem(DeltaStorageHandler(uri, options))
                # The log's URIs are percent-encoded (a prefix "a b" is "a%20b"), the handler takes keys as they are.
                base = uri.rstrip("/") + "/"
                keys = [urllib.parse.unquote(p) for p in paths]
                if any(not k.startswith(base) for k in keys):
                    raise QualityInputError(f"output table {self.table.uri} names data files outside it: {paths[:3]}")
                paths = [k.removeprefix(base) for k in keys]
            schema = tables.table_schema(self.table.kind)
            schema = schema.remove(schema.get_field_index(tables.PARTITION))  # in the path, not in the files
            # The rows are filtered once read, all together, by a mask: a filter expression (in the scan or on the
            # table) is evaluated chunk by chunk, and an hour of 1-s batches is thousands of one-file chunks.
            when = tables.TIME_COLUMN[self.table.kind]
            read = ds.dataset(paths, schema=schema, format="parquet", filesystem=filesystem).to_table(
                columns=list({*columns, when})
            )
            return read.filter(keep(read[when])).select(columns), len(paths)
        except (pa.ArrowInvalid, OSError) as exc:
            raise QualityInputError(f"output table {self.table.uri} is unreadable: {exc}") from exc


# -- Completeness: every click of the interval's input has exactly one outcome ------------------------------------

_TS_LO = -(2**63)
SAMPLE_IDS = 5
PARSE_GROUP_BYTES = 8 << 20  # click files parsed in one call (interval_clicks)


@dataclass(frozen=True)
class ClickFile:
    """A click file of an interval: ``key`` in the logs (``<dc>/clicks/<YYYYmmdd>/<HHMM>/<name>``, or
    ``<dc>/clicks/<name>`` for a flat one), on a folder or an object store alike."""

    store: Store
    key: str

    def read_bytes(self) -> bytes:
        return self.store.get(self.key)

    @property
    def partition(self) -> str:
        """``<dc>/clicks/<YYYYmmdd>/<HHMM>`` (or ``<dc>/clicks`` for a flat file): files of one share it."""
        return self.key.rpartition("/")[0]

    @property
    def arrival_us(self) -> int | None:
        """The start of its arrival partition; None for a flat file."""
        parts = self.key.split("/")
        day, minute = (parts[-3], parts[-2]) if len(parts) >= 5 else ("", "")
        if len(day) == 8 and len(minute) == 4 and day.isdigit() and minute.isdigit():
            return partition_start_us(f"{day}/{minute}")
        return None


def interval_click_files(
    logs: Path | Store | str, start_us: int, end_us: int, dcs: Sequence[str] | None = None
) -> list[ClickFile]:
    """The click files of ``[start_us, end_us)``, of every data center's replica (``logs``: a folder or an object
    store): the closed files of the arrival partitions that start in the interval (EVENTS.md), and the flat files
    directly in ``clicks/`` (the layout before partitions) whose first event is stamped in it, as ``photon_backfill``
    picks them. A file lies in exactly one partition, so every click file of a replica belongs to exactly one
    interval; once the partitions are sealed no file can join the interval, so the set is final. The verifier's
    ``recovered-*`` files are copies and never count. Lists the interval's minute folders only (60 listings per
    replica for an hour), never the history. ``dcs``: only these replicas."""
    store = as_store(logs)
    files: list[ClickFile] = []
    if dcs is None:
        dcs = [name for name in store.folders() if not name.startswith(("_", "."))]

    def closed(key: str) -> bool:
        name = key.rpartition("/")[2]
        return name.endswith(".jsonl") and not name.startswith((".", RECOVERED_PREFIX))

    first_minute = -(-start_us // MINUTE_US) * MINUTE_US  # the first partition starting at or after start
    for dc in dcs:
        folder = f"{dc}/clicks"
        files += [
            ClickFile(store, e.key)
            for e in store.files(folder)
            if closed(e.key) and start_us <= first_event_us(store, e.key) < end_us
        ]
        for minute in range(first_minute, end_us, MINUTE_US):
            files += [ClickFile(store, e.key) for e in store.files(f"{folder}/{partition_of(minute)}") if closed(e.key)]
    return files


def interval_clicks(files: Sequence[ClickFile]) -> pa.Table:
    """Distinct well-formed clicks (``click_id``, ``ts_us``, ``arrival_us``) of the files, by the joiner's own parser:
    a line it quarantines is no click here either (quarantine is checked by its own rate). ``arrival_us``: the start
    of the earliest arrival partition holding the click, in any replica (null where only flat files hold it).

    The files are parsed together, a few MB at a time: Arrow's JSON reader costs about 1 ms a call however short the
    input, and an hour holds thousands of one-second files per replica (20 s for 14,570 files, 0.5 s together); each
    event's byte offset tells its file, and so its arrival. A file whose last line is torn (no final newline) gets
    one, so that line stays a line of its own, as when the file is parsed alone: parsing is line by line, so the
    events are the same."""
    tables: list[pa.Table] = []
    group: list[bytes] = []
    arrivals: list[int] = []  # of each file of the group; -1: unknown (a flat file)
    size = 0

    def parse_group() -> None:
        nonlocal size
        if group:
            good, _, offsets, _ = parse_file_located("interval", b"".join(group), "clicks")
            starts = np.cumsum([0] + [len(g) for g in group[:-1]])
            arrival = np.asarray(arrivals, np.int64)[np.searchsorted(starts, offsets, side="right") - 1]
            column = pa.array(arrival, pa.int64(), mask=arrival < 0)
            tables.append(good.select(["click_id", "ts_us"]).append_column("arrival_us", column))
        group.clear()
        arrivals.clear()
        size = 0

    for f in files:
        data = f.read_bytes()
        if not data:
            continue
        group.append(data if data.endswith(b"\n") else data + b"\n")
        arrival = f.arrival_us
        arrivals.append(-1 if arrival is None else arrival)
        size += len(data)
        if size >= PARSE_GROUP_BYTES:
            parse_group()
    parse_group()
    if not tables:
        return pa.table(
            {
                "click_id": pa.array([], pa.string()),
                "ts_us": pa.array([], pa.int64()),
                "arrival_us": pa.array([], pa.int64()),
            }
        )
    t = pa.concat_tables(tables)
    # The same event may be in two files (a re-send) and is in every replica: one click, one outcome.
    return (
        t.group_by("click_id", use_threads=False)
        .aggregate([("ts_us", "min"), ("arrival_us", "min")])
        .rename_columns(["click_id", "ts_us", "arrival_us"])
    )


@dataclass
class Outcomes:
    clicks: pa.Table  # click_id, ts_us, joined (rows in the joined tables), unjoinable (in the unjoinable tables)
    files_read: int
    files: int
    # (pipeline, kind): the OUTPUT_COLUMNS of the rows of the interval's hours (``outcomes(interval=)``)
    rows: dict[tuple[str, str], pa.Table] = field(default_factory=dict)
    # pipeline -> its earliest joined_at_us in its whole joined table (its files' statistics): when it began
    first_at: dict[str, int] = field(default_factory=dict)


def outcomes(out: Path | Store, clicks: pa.Table, interval: tuple[int, int] | None = None) -> Outcomes:
    """For each input click, how many rows every pipeline's ``joined`` and ``unjoinable`` tables hold for it. Only
    the hour partitions of the input clicks' times are read, of those the files whose click-time statistics meet
    those times, and of those only the ``click_id`` column. With an ``interval``, also its hours' rows, with the
    columns ``_joined`` needs (``OUTPUT_COLUMNS``), kept in ``Outcomes.rows``: thousands of small batch files are
    opened once, not twice (about 1 ms a file). Rows without a click time are always read."""
    out = as_store(out)
    if isinstance(out, LocalStore) and not out.root.is_dir():
        raise FileNotFoundError(f"output folder {out.root} does not exist")
    ids = clicks["click_id"].combine_chunks() if clicks.num_rows else pa.array([], pa.string())
    ts = clicks["ts_us"].to_numpy() if clicks.num_rows else np.zeros(0, np.int64)
    files_where, keep = _click_hours(ts, interval)
    counts = {}
    rows: dict[tuple[str, str], pa.Table] = {}
    first_at: dict[str, int] = {}
    read = listed = 0
    for kind in (JOINED, UNJOINABLE):
        found: list[pa.Array] = []
        columns = OUTPUT_COLUMNS[kind] if interval is not None else ["click_id"]
        for table in tables.tables(out, kind):
            snapshot = _Snapshot.of(table)
            listed += snapshot.files
            if kind == JOINED and snapshot.files:
                first_at[table.pipeline] = _first_at(snapshot.adds())
            t, n = snapshot.scan(files_where, columns, keep)
            read += n
            found += t["click_id"].chunks
            if interval is not None:
                rows[(table.pipeline, kind)] = t
        every = pa.concat_arrays(found) if found else pa.array([], pa.string())
        every = every.filter(pc.is_in(every, value_set=ids))  # one hash set of the input ids, not one per file
        if len(every):
            vc = pc.value_counts(every)
            n = pc.index_in(ids, value_set=vc.field("values"))
            counts[kind] = pc.fill_null(pc.take(vc.field("counts"), n), 0).cast(pa.int64())
        else:
            counts[kind] = pa.array(np.zeros(len(ids), np.int64))
    table = pa.table({"click_id": ids, "ts_us": clicks["ts_us"] if clicks.num_rows else pa.array([], pa.int64())})
    table = table.append_column("joined", counts[JOINED]).append_column("unjoinable", counts[UNJOINABLE])
    return Outcomes(table, read, listed, rows, first_at)


def _click_hours(ts: np.ndarray, interval: tuple[int, int] | None) -> tuple[str, Keep]:
    """Where the outcomes of clicks stamped ``ts`` (and, with ``interval``, every row of its hours) lie in a
    ``joined`` or ``unjoinable`` table, as a Delta predicate (files) and a row filter saying the same: per hour
    partition, the range of those times in it; and the partition of rows without a click time (``hour`` null), which
    may hold any click."""
    hour_us = 3_600 * US
    lo: dict[int, int] = {}
    hi: dict[int, int] = {}
    if len(ts):
        hours = ts // hour_us
        for h in np.unique(hours):
            mine = ts[hours == h]
            lo[int(h)], hi[int(h)] = int(mine.min()), int(mine.max())
    if interval is not None and interval[1] > interval[0]:
        for h in range(interval[0] // hour_us, (interval[1] - 1) // hour_us + 1):
            a, b = max(interval[0], h * hour_us), min(interval[1] - 1, (h + 1) * hour_us - 1)
            lo[h], hi[h] = min(lo.get(h, a), a), max(hi.get(h, b), b)
    sql = [f"{tables.PARTITION} IS NULL"]
    for h in sorted(lo):
        name = tables.hour_of(h * hour_us)
        sql.append(f"({tables.PARTITION} = '{name}' AND click_ts_us >= {lo[h]} AND click_ts_us <= {hi[h]})")

    def keep(click_ts: pa.ChunkedArray) -> pa.ChunkedArray:
        """The rows say it by their time: an hour's rows are those whose time is in it, the null hour's those
        without."""
        mask = pc.is_null(click_ts)
        for h in lo:
            mask = pc.or_kleene(mask, pc.and_(pc.greater_equal(click_ts, lo[h]), pc.less_equal(click_ts, hi[h])))
        return mask

    return " OR ".join(sql), keep


def _first_at(adds: pa.Table) -> int:
    """The earliest ``joined_at_us`` of a ``joined`` table, from its files' statistics; INT64 min where they cannot
    bound it (a file without them, or with a null time)."""
    if "min.joined_at_us" not in adds.column_names or "null_count.joined_at_us" not in adds.column_names:
        return _TS_LO
    mins, nulls = adds["min.joined_at_us"], adds["null_count.joined_at_us"]
    if mins.null_count or nulls.null_count or pc.max(nulls).as_py():
        return _TS_LO
    return int(pc.min(mins).as_py())


def completeness_frame(o: Outcomes) -> Any:
    """One row per input click: ``no_outcome`` holds its id when no pipeline joined it or gave it up, and
    ``joined_more_than_once`` when the joined tables hold it more than once; both null otherwise. GX's unexpected values
    of a null expectation are then the failing click ids themselves (in the result, the log line and Data Docs)."""
    t = o.clicks
    ids = t["click_id"]
    none = pc.and_(pc.equal(t["joined"], 0), pc.equal(t["unjoinable"], 0))
    twice = pc.greater(t["joined"], 1)
    null = pa.nulls(t.num_rows, pa.string())
    return pa.table(
        {
            "click_id": ids,
            "no_outcome": pc.if_else(none, ids, null),
            "joined_more_than_once": pc.if_else(twice, ids, null),
        }
    ).to_pandas()


def _history(
    frame: Any, clicks: pa.Table, first_at: dict[str, int], s: QualitySettings, later: Callable[[], pa.Table]
) -> Any:
    """Which joined rows are history to the live pipeline that joined them: the click's file arrived (its earliest
    arrival partition, ``interval_clicks``) more than the latency SLO before that pipeline's first output
    (``Outcomes.first_at``), so no batch of it could have met the SLO: a pipeline started at the beginning of the logs
    joining what came before it. A click file that arrived after the pipeline began is live however late it was
    joined (a pipeline that fell behind is judged); one of unknown arrival (a flat file) is live too.
    A click stamped in the interval's last seconds whose file landed in a later partition is that interval's input,
    not this one's: its arrival comes from ``later()``, the clicks of the partitions that land before this interval
    settles, read only when such rows exist."""
    arrived = frame["click_id"].map(_series(clicks, "click_id", "arrival_us"))
    began = frame["folder"].map(first_at)
    if (arrived.isna() & began.notna()).any():
        arrived = arrived.fillna(frame["click_id"].map(_series(later(), "click_id", "arrival_us")))
    return (arrived.notna() & began.notna() & (arrived + MINUTE_US <= began - s.latency_slo_s * US)).astype(bool)


def _series(t: pa.Table, key: str, value: str) -> Any:
    """``t[value]`` indexed by ``t[key]``, as a pandas Series."""
    return t.select([key, value]).to_pandas().set_index(key)[value]


def _quiet_gx() -> None:
    """GX logs INFO at import (its docs decorators) and per metric; keep its warnings only. Analytics off: a
    data-quality task makes no network call."""
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    logging.getLogger("great_expectations").setLevel(logging.WARNING)
    # Its own code's deprecations (sre_parse at import, ...): nothing a reader of the task log can act on.
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"great_expectations(\.|$)")


def _context(root: Path, index_results: int) -> Any:
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="file", project_root_dir=str(root))
    bars = context.variables.progress_bars  # None, or as loaded from great_expectations.yml: a dict
    if not bars or any(dict(bars.items() if isinstance(bars, dict) else vars(bars).items()).values()):
        context.variables.progress_bars = ProgressBarsConfig(globally=False, metric_calculations=False)
        context.variables.save()
    site = str(root / "data_docs")
    config: Any = {
        "class_name": "SiteBuilder",
        "store_backend": {"class_name": "TupleFilesystemStoreBackend", "base_directory": site},
        "site_index_builder": {"class_name": "DefaultSiteIndexBuilder", "validation_results_limit": index_results},
    }
    sites = context.variables.data_docs_sites or {}
    if "photon" not in sites:
        context.add_data_docs_site(site_name="photon", site_config=config)
    elif any(dict(sites["photon"].get(k) or {}) != config[k] for k in ("site_index_builder", "store_backend")):
        # A site made before the limit, or a project copied from an object store: its folder was another run's.
        context.update_data_docs_site(site_name="photon", site_config=config)
    return context


PUBLISH_LOCK = ".publish.lock"  # <out>/_quality/.publish.lock: held while a run writes its results and the site
PUBLISH_LOCK_DIR = "_lock"  # <out>/_quality/_lock/lock-<n>.json on an object store
PUBLISH_LEASE_S = 300.0  # the publishing lock's lease on an object store: a publish takes seconds


def _publish(
    out: Store, s: QualitySettings, suites: dict[str, Any], results: dict[Any, Any], suite_id: Any
) -> tuple[float, str]:
    """Store this run's validation results in the GX project (each under its own key: interval, suite, batch) and
    build their pages, the suites' and the index, which lists the newest results of every run; then serve the pages'
    assets offline. One run at a time (``_project``). Returns when the site was built (monotonic) and where its
    index is."""
    with _project(out, s) as root:
        context = _context(root, s.index_results)
        built: list[Any] = list(results)
        for suite in suites.values():
            context.suites.add_or_update(suite)
            built.append(suite_id(name=suite.name))
        for key, result in results.items():
            context.validation_results_store.set(key, result)
        context.build_data_docs(site_names=["photon"], resource_identifiers=built)
        t_localize = time.monotonic()
        localize_data_docs(root / "data_docs")
    return t_localize, out.location(f"{QUALITY_DIR}/data_docs/index.html")


SITE_ASSETS = "data_docs/static/"  # the same files for every run: uploaded once


@contextlib.contextmanager
def _project(out: Store, s: QualitySettings) -> Iterator[Path]:
    """The GX project and the Data Docs site as a folder, held by this run alone while it publishes (GX's file stores
    rewrite their files in place, so a reader beside a writer reads half a file; validating needs no lock, only this
    step waits, and says so): ``<out>/_quality`` itself for an output folder, under ``flock`` on ``.publish.lock``.
    GX's stores and site builder write files only, so on an object store the run takes ``_quality``'s lock (a
    ``StoreLock``), copies the project into a temporary folder (the results the index lists, not the whole history:
    ``_download_project``), publishes there, and puts back what it wrote or changed; the site's pages are read from
    ``<out>/_quality/data_docs/`` in the bucket."""
    import hashlib
    import tempfile

    from photon.tools.maintenance import MaintenanceLockLost, pipeline_lock

    remote = out.child(QUALITY_DIR)
    if isinstance(remote, LocalStore):
        remote.root.mkdir(parents=True, exist_ok=True)
    lock = pipeline_lock(remote, PUBLISH_LEASE_S, file=PUBLISH_LOCK, folder=PUBLISH_LOCK_DIR, purpose="data quality")
    with lock as still_held:
        if isinstance(remote, LocalStore):
            yield remote.root
            return
        with tempfile.TemporaryDirectory(prefix="photon-quality-") as tmp:
            root = Path(tmp)
            _download_project(remote, root, s.index_results)
            digest = {p: hashlib.sha256(p.read_bytes()).digest() for p in root.rglob("*") if p.is_file()}
            yield root
            assets = {e.key: e.size for e in remote.listing(SITE_ASSETS)}
            try:
                still_held()  # half the lease left at least: the puts below end before a successor may start
            except MaintenanceLockLost as exc:
                raise RuntimeError(
                    f"data quality: this run's results were not published ({exc}); run the check again"
                ) from None
            # The index last: it never lists a page that is not there yet.
            index = root / "data_docs" / "index.html"
            for path in sorted((p for p in root.rglob("*") if p.is_file()), key=lambda p: (p == index, str(p))):
                key = path.relative_to(root).as_posix()
                data = path.read_bytes()
                if digest.get(path) == hashlib.sha256(data).digest() or assets.get(key) == len(data):
                    continue  # unchanged since downloaded, or an asset already there
                remote.put(key, data)


VALIDATIONS = "gx/uncommitted/validations/"  # <suite>/<run name>/<run time>/<batch>.json (GX's file layout)


def _download_project(remote: Store, root: Path, index_results: int) -> None:
    """The GX project under ``remote`` (``<out>/_quality``) into the folder ``root``: its configuration and suites,
    and of its validation results the newest ``index_results`` by run time (as GX's index picks them): the index
    built here lists what it would list over the whole history, and a run downloads a week of results, not a year."""
    entries = [e for e in remote.listing("gx") if not e.key.endswith("/")]
    results = {e.key for e in entries if e.key.startswith(VALIDATIONS) and e.key.count("/") >= 6}
    # <run time>: 20251121T060000.000000Z, which sorts as the time
    newest = sorted(results, key=lambda key: key.split("/")[-2], reverse=True)
    keep = set(newest[:index_results] if index_results > 0 else newest)  # GX: 0 is no limit
    for e in entries:
        if e.key in results and e.key not in keep:
            continue
        path = root / e.key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(remote.get(e.key))
    # GX's index lists the results whose page the site holds: each kept result's page, as an empty stand-in that is
    # never put back (unchanged). A run puts its pages before its results (key order), so the pages exist.
    for key in keep:
        page = root / "data_docs" / "validations" / key.removeprefix(VALIDATIONS).removesuffix(".json")
        page = page.with_name(page.name + ".html")
        page.parent.mkdir(parents=True, exist_ok=True)
        page.touch()


def _ephemeral_config() -> Any:
    """An in-memory GX project: no store on disk, no temporary docs site, no progress bars."""
    from great_expectations.data_context.types.base import (
        DataContextConfig,
        InMemoryStoreBackendDefaults,
        ProgressBarsConfig,
    )

    return DataContextConfig(
        store_backend_defaults=InMemoryStoreBackendDefaults(init_temp_docs_sites=False),
        progress_bars=ProgressBarsConfig(globally=False, metric_calculations=False),
    )


def _suites(gx: Any, s: QualitySettings) -> dict[str, Any]:
    e = gx.expectations
    joined = gx.ExpectationSuite(name="photon_joined")
    joined.add_expectation(e.ExpectColumnValuesToBeUnique(column="click_id"))
    for column in REQUIRED:
        joined.add_expectation(e.ExpectColumnValuesToNotBeNull(column=column))
    joined.add_expectation(e.ExpectColumnValuesToBeBetween(column="click_after_query_s", min_value=-s.max_clock_skew_s))
    joined.add_expectation(
        e.ExpectColumnValuesToBeBetween(column="live_latency_s", max_value=s.latency_slo_s, mostly=s.latency_mostly)
    )
    rates = gx.ExpectationSuite(name="photon_rates")
    rates.add_expectation(
        e.ExpectColumnValuesToBeBetween(column="unjoinable_rate", min_value=0, max_value=s.max_unjoinable_rate)
    )
    rates.add_expectation(
        e.ExpectColumnValuesToBeBetween(column="quarantine_rate", min_value=0, max_value=s.max_quarantine_rate)
    )
    rates.add_expectation(
        e.ExpectColumnValuesToBeBetween(column="input_click_files", min_value=0 if s.allow_empty else s.min_click_files)
    )
    completeness = gx.ExpectationSuite(name="photon_completeness")
    completeness.add_expectation(e.ExpectColumnValuesToBeNull(column="no_outcome"))
    completeness.add_expectation(e.ExpectColumnValuesToBeNull(column="joined_more_than_once"))
    return {"joined": joined, "rates": rates, "completeness": completeness}


def check_quality(
    out: Path | Store | str,
    logs: Path | Store | str,
    start_us: int,
    end_us: int,
    settings: QualitySettings | None = None,
    now_us: int | None = None,
) -> QualityResult:
    """Run the checkpoint for the interval ``[start_us, end_us)`` and update the Data Docs site. ``logs`` is the logs
    root the pipelines read (``<logs>/<dc>/{queries,clicks}``): quarantined lines are attributed by their file, and
    the interval's click files are the input whose every click must have one outcome. ``out`` and ``logs``: folders,
    or object stores (``s3://bucket/prefix``, or a ``Store`` opened with a connection's options). Raises
    ``NotSettled`` before ``settings.settled_at_us(end_us)`` (by ``now_us``, default this host's clock): an unsettled
    interval neither passes nor fails."""
    s = settings or QualitySettings()
    now = now_us if now_us is not None else int(time.time() * US)
    if now < s.settled_at_us(end_us):
        raise NotSettled(
            f"interval [{_iso(start_us)}, {_iso(end_us)}) settles at {_iso(s.settled_at_us(end_us))}: its partitions"
            f" seal {s.seal_s:.0f} s after it ends, its last clicks have {s.max_join_delay_s:.0f} s to join and"
            f" {s.settle_margin_s:.0f} s margin"
        )
    _quiet_gx()
    import great_expectations as gx
    import pandas as pd
    from great_expectations.data_context.types.resource_identifiers import ExpectationSuiteIdentifier

    out, logs = as_store(out), as_store(logs)  # a folder, or an object store (s3://...)
    t_input = time.monotonic()
    click_files = interval_click_files(logs, start_us, end_us)
    clicks = interval_clicks(click_files)
    t_output = time.monotonic()
    found = outcomes(out, clicks, (start_us, end_us))
    t_done = time.monotonic()
    phases = {"input": t_output - t_input, "output": t_done - t_output}
    complete = completeness_frame(found)
    joined, unjoinable = _joined(out, start_us, end_us, found.rows)
    quarantined, unattributed, q_read, q_listed = _quarantined(
        out, logs, start_us, end_us, int(s.max_clock_skew_s * US)
    )
    frame = joined.to_pandas()
    frame["click_after_query_s"] = (frame["click_ts_us"] - frame["query_ts_us"]) / US
    live = ~frame["pipeline"].fillna("").str.startswith(BACKFILL_PREFIX)
    history = _history(
        frame,
        clicks,
        found.first_at,
        s,
        later=lambda: interval_clicks(interval_click_files(logs, end_us, s.settled_at_us(end_us))),
    )
    frame["live_latency_s"] = ((frame["joined_at_us"] - frame["click_ts_us"]) / US).where(live & ~history)
    decided = joined.num_rows + unjoinable
    unjoinable_rate = unjoinable / max(decided, 1)
    quarantine_rate = quarantined / max(decided, 1)
    # Null: not judged (GX leaves nulls out), the denominator too small to mean anything.
    rates = pd.DataFrame(
        {
            "unjoinable_rate": [unjoinable_rate if decided >= s.min_rate_denominator else None],
            "quarantine_rate": [quarantine_rate if decided + quarantined >= s.min_rate_denominator else None],
            "input_click_files": [len(click_files)],
        },
        dtype="float64",
    )
    t_gx = time.monotonic()
    phases["frames"] = t_gx - t_done
    # The validation runs in a context of its own, in memory: no run reads a store another run rewrites (two runs at
    # once crashed in GX's shared expectation store). Only the results and the site are shared, written below.
    context: Any = gx.get_context(mode="ephemeral", project_config=_ephemeral_config())
    datasource = context.data_sources.add_pandas("photon_output")
    definitions = []
    for name, suite in _suites(gx, s).items():
        batch = datasource.add_dataframe_asset(name).add_batch_definition_whole_dataframe("interval")
        suite = context.suites.add(suite)
        definitions.append(
            context.validation_definitions.add(gx.ValidationDefinition(name=name, data=batch, suite=suite))
        )
    failed: list[str] = []
    details: list[str] = []
    statistics: dict[str, Any] = {}
    success = True
    results: dict[Any, Any] = {}  # this run's validation results, by identifier
    t_run = time.monotonic()
    phases["gx_setup"] = t_run - t_gx
    for definition, frame_ in zip(definitions, (frame, rates, complete), strict=True):
        checkpoint = context.checkpoints.add(
            gx.Checkpoint(
                name=f"photon_{definition.name}",
                validation_definitions=[definition],
                actions=[],  # the site is built once below, for all three
                result_format="SUMMARY",
            )
        )
        result = checkpoint.run(batch_parameters={"dataframe": frame_}, run_id=_run_id(start_us, end_us))
        success &= bool(result.success)
        results.update(result.run_results)
        for vr in result.run_results.values():
            statistics[definition.name] = dict(vr.statistics)
            for r in vr.results:
                if not r.success:
                    cfg = r.expectation_config
                    failed.append(f"{definition.name}: {cfg.type}({cfg.kwargs.get('column', '')})")
                    details.append(f"{failed[-1]}: {_observed(r.result)}{_HINTS.get(cfg.kwargs.get('column'), '')}")
    t_docs = time.monotonic()
    phases["validation"] = t_docs - t_run
    t_localize, docs_index = _publish(out, s, _suites(gx, s), results, ExpectationSuiteIdentifier)
    phases["data_docs"] = t_localize - t_docs
    phases["localize"] = time.monotonic() - t_localize
    window = f"[{_iso(start_us)}, {_iso(end_us)})"
    no_outcome = complete["no_outcome"].dropna().tolist()
    twice = complete["joined_more_than_once"].dropna().tolist()
    counts = (
        f"{joined.num_rows} joined, {unjoinable} unjoinable, {quarantined} quarantined lines;"
        f" {clicks.num_rows} input clicks in {len(click_files)} click files, {len(no_outcome)} without outcome,"
        f" {len(twice)} joined more than once"
    )
    small = [c for c in ("unjoinable_rate", "quarantine_rate") if pd.isna(rates[c].iloc[0])]
    if small:
        counts += f"; not judged over fewer than {s.min_rate_denominator}: {', '.join(small)}"
    log.info("data quality %s: %s (%s)", window, "PASS" if success else f"FAIL, {len(failed)} expectation(s)", counts)
    for line in details:
        log.warning("data quality %s: %s", window, line)
    return QualityResult(
        success=success,
        start_us=start_us,
        end_us=end_us,
        joined=joined.num_rows,
        unjoinable=unjoinable,
        quarantined=quarantined,
        backfilled=int((~live).sum()),
        history=int((live & history).sum()),
        quarantine_unattributed=unattributed,
        input_clicks=clicks.num_rows,
        input_files=len(click_files),
        unjoinable_rate=round(unjoinable_rate, 6),
        quarantine_rate=round(quarantine_rate, 6),
        rates_not_judged=small,
        no_outcome=len(no_outcome),
        joined_more_than_once=len(twice),
        samples={"no_outcome": sorted(no_outcome)[:SAMPLE_IDS], "joined_more_than_once": sorted(twice)[:SAMPLE_IDS]},
        output_files_read=found.files_read,
        output_files=found.files,
        quarantine_files_read=q_read,
        quarantine_files=q_listed,
        input_seconds=round(t_output - t_input, 3),
        output_seconds=round(t_done - t_output, 3),
        phases={k: round(v, 3) for k, v in phases.items()},
        failed=failed,
        details=details,
        statistics=statistics,
        docs_index=docs_index,
    )


_HINTS = {
    "input_click_files": (
        " click files in any replica, where input is expected (min_click_files): log shipping stopped, or the"
        " wrong logs folder; allow_empty accepts an interval without input"
    ),
}


def _observed(result: dict[str, Any]) -> str:
    """What a failed expectation saw, in a few words, saying what the share is of: 'unexpected 12 of 4,000 rows
    (0.30%), e.g. [75.1, 80.2]'. Where the column has nulls, GX judges (and gives its share of) the non-null values
    only: 'unexpected 8 of the 8 non-null values (100.00%; 65,014 of 65,022 rows null, not judged)', not '8 of
    65,022 (100.00%)'."""
    n = result.get("element_count") or 0
    bad = result.get("unexpected_count")
    sample = [round(v, 4) if isinstance(v, float) else v for v in (result.get("partial_unexpected_list") or [])[:3]]
    if n == 1 and sample:
        return f"observed {sample[0]}"
    if bad is None:
        return "failed"
    eg = f", e.g. {sample}" if sample else ""
    missing = result.get("missing_count") or 0
    if missing:
        pct = result.get("unexpected_percent_nonmissing") or 0.0
        judged = n - missing
        return (
            f"unexpected {bad:,} of the {judged:,} non-null values ({pct:.2f}%; {missing:,} of {n:,} rows null, not"
            f" judged){eg}"
        )
    pct = result.get("unexpected_percent_total", result.get("unexpected_percent")) or 0.0
    return f"unexpected {bad:,} of {n:,} rows ({pct:.2f}%){eg}"


def _iso(ts_us: int) -> str:
    from datetime import UTC, datetime

    return f"{datetime.fromtimestamp(ts_us / US, UTC):%Y-%m-%d %H:%M:%S}"


def _run_id(start_us: int, end_us: int) -> Any:
    from datetime import UTC, datetime

    from great_expectations.core.run_identifier import RunIdentifier

    start = datetime.fromtimestamp(start_us / US, UTC)
    return RunIdentifier(run_name=f"interval {start:%Y-%m-%dT%H:%M:%S}+{(end_us - start_us) // US}s", run_time=start)


# -- Data Docs offline ------------------------------------------------------------------------------------------

# Each CDN prefix in GX 1.24's page templates, and where the same file sits in the npm package (of the same name and
# version) that the CDN serves: plugins/photon/tools/data_docs/package.json pins exactly these.
CDN_TO_PACKAGE = (
    ("https://unpkg.com/bootstrap-table@1.19.1/", "bootstrap-table/"),
    ("https://unpkg.com/bootstrap-table@1.19.0/", "bootstrap-table/"),  # one 0.4 kB stylesheet; 1.19.1's copy
    ("https://maxcdn.bootstrapcdn.com/bootstrap/4.3.1/", "bootstrap/dist/"),
    ("https://stackpath.bootstrapcdn.com/bootstrap/4.3.1/", "bootstrap/dist/"),
    ("https://code.jquery.com/jquery-3.7.1.min.js", "jquery/dist/jquery.min.js"),
    ("https://cdnjs.cloudflare.com/ajax/libs/popper.js/1.12.9/", "popper.js/dist/"),
    ("https://cdnjs.cloudflare.com/ajax/libs/bootstrap-datepicker/1.9.0/", "bootstrap-datepicker/dist/"),
    ("https://cdnjs.cloudflare.com/ajax/libs/font-awesome/6.6.0/", "@fortawesome/fontawesome-free/"),
    ("https://cdn.jsdelivr.net/npm/@forevolve/bootstrap-dark@1.1.0/", "@forevolve/bootstrap-dark/"),
)
# Loaded by a stylesheet above (all.min.css: ../webfonts/*), so copied whole.
ASSET_DIRS = ("@fortawesome/fontawesome-free/webfonts/",)
# GX's logo (and a tracking query string) from its own web assets: its package ships the logo in static/images.
GX_WEB_ASSETS = "https://great-expectations-web-assets.s3.us-east-2.amazonaws.com/"
_VEGA = re.compile(r'<script src="https://cdn\.jsdelivr\.net/npm/vega[-a-z]*@\d+"></script>\s*')
_URL = re.compile(r"""(?P<q>["'])(?P<url>https://[^"'\s]+)(?P=q)""")
_SRI = re.compile(r"""\s+(?:integrity|crossorigin)=(["'])[^"']*\1""")  # file:// pages can't load CORS-mode scripts
_REMOTE_LOAD = re.compile(
    r"""<(?:script|link|img)\b[^>]*?\b(?:src|href)=["'](https?://[^"']+)|url\(["']?(https?://[^"')]+)"""
)
_STATIC = re.compile(r"""(["'(])(?:\./|(?:\.\./)+)?static/""")
_MARKER = ".localized"


def data_docs_assets_path() -> Path:
    """Where the npm packages (``node_modules``) are: ``PHOTON_DATA_DOCS_ASSETS``, else where ``make setup`` puts
    them, beside the venv."""
    configured = os.environ.get("PHOTON_DATA_DOCS_ASSETS")
    return Path(configured) if configured else Path(sys.prefix) / "share" / "photon-data-docs" / "node_modules"


def data_docs_assets() -> Path | None:
    """The installed npm packages, or None."""
    path = data_docs_assets_path()
    return path if (path / "bootstrap-table").is_dir() else None


def remote_loads(html: str) -> list[str]:
    """Every URL a page would fetch from the network (scripts, stylesheets, images, CSS url()); links don't count."""
    return [a or b for a, b in _REMOTE_LOAD.findall(html)]


def localize_data_docs(site: Path) -> list[str]:
    """Serve every asset of the site's pages from ``<site>/static/vendor``: copy the files from the installed npm
    packages, rewrite the pages GX wrote since the last call (all of them the first time; rewriting is idempotent).
    Returns the remote URLs still loaded by some page (logged as a warning: a GX upgrade that names new assets)."""
    assets = data_docs_assets()
    if assets is None:
        log.warning(
            "Data Docs assets are not installed in %s (`make setup` installs them with npm): the pages load their"
            " CSS and JavaScript from CDNs and render blank offline",
            data_docs_assets_path(),
        )
        return []
    vendor = site / "static" / "vendor"
    vendor.mkdir(parents=True, exist_ok=True)
    marker = vendor / _MARKER
    since = marker.stat().st_mtime_ns if marker.exists() else 0
    scanned = time.time_ns()  # a page written from now on (a concurrent run) is taken next time
    pages = [p for p in site.rglob("*.html") if p.stat().st_mtime_ns >= since]
    needed: set[str] = set()
    left: set[str] = set()
    for page in pages:
        html = page.read_text(encoding="utf-8")
        new = _localize_page(html, os.path.relpath(site / "static", page.parent), needed)
        left.update(remote_loads(new))
        if new != html:
            tmp = page.with_name(f".{page.name}.{os.getpid()}")
            tmp.write_text(new, encoding="utf-8")
            os.replace(tmp, page)
    for rel in sorted(needed) + [d + f.name for d in ASSET_DIRS for f in sorted((assets / d).glob("*"))]:
        src, dst = assets / rel, vendor / rel
        if not src.is_file():
            left.add(rel)
        elif not dst.is_file() or dst.stat().st_size != src.stat().st_size:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
    marker.touch()
    os.utime(marker, ns=(scanned, scanned))
    if left:
        log.warning("Data Docs still load these from the network or miss them: %s", ", ".join(sorted(left)))
    return sorted(left)


def _localize_page(html: str, static: str, needed: set[str]) -> str:
    html = _VEGA.sub("", html)

    def local(m: re.Match[str]) -> str:
        url = m["url"]
        if url.startswith(GX_WEB_ASSETS):
            return f"{m['q']}{static}/images/logo-long.png{m['q']}"
        for prefix, package in CDN_TO_PACKAGE:
            if url.startswith(prefix):
                rel = package + url[len(prefix) :]
                needed.add(rel)
                return f"{m['q']}{static}/vendor/{rel}{m['q']}"
        return m.group(0)

    html = _URL.sub(local, html)
    # GX's own relative links into static/ are one level short on validation pages (their favicon): point every one
    # at the site's static folder from this page.
    html = _STATIC.sub(lambda m: f"{m[1]}{static}/", html)
    return re.sub(r"<(?:script|link)\b[^>]*>", lambda m: _SRI.sub("", m.group(0)), html)
