"""Output table maintenance (``photon table maintain``, the DAG ``photon_table_maintenance``): per pipeline and kind,
compact each hour's small files, write a checkpoint, drop expired log files, and vacuum the data files no commit
names once they are older than the retention. Safe beside live pipelines and backfills appending to the same tables,
and beside another maintenance run.

Why it is safe:

- Compaction is a Delta rewrite with ``dataChange = false``: it commits the same rows in fewer files and carries no
  application transaction, so ``transaction_version("photon/<pipeline>")`` (the pipeline's last published batch) is
  unchanged, and readers find a batch's rows by their ``batch`` value wherever they now live. It races with the
  publishers' appends in Delta's conflict check: an append adds files and removes none, so both commit (delta-rs
  retries the loser against the winner); two compactions of one hour conflict, and the loser tries again or leaves
  the hour to the next run. Except that delta-rs (1.6.6) lets two compactions of the same files both commit,
  each adding its own copy of the rows (it lets concurrent removes of the same files pass when they change no
  data): so maintenance runs hold a lock per pipeline (``pipeline_lock``: ``flock`` on a folder, a lease of
  put-if-absent objects on an object store, ``StoreLock``), and after each compaction check that the hour still
  holds as many rows of the published batches as before (``TableInvariantError`` if not). Nothing else may compact
  these tables.
- A batch's data files exist before its commit (``photon.logs.tables``: written by its tasks before the registry
  commit, committed by ``publish_batch`` after). A file no commit names may therefore still be committed later, so
  vacuum never deletes one younger than the retention (at least ``MIN_RETENTION_HOURS``, far longer than any batch),
  nor, however old, one that a stage folder (``<out>/<pipeline>/_staging/*``) still names: a batch committed to the
  registry but not yet published (a pipeline that died before publishing, rolled forward days later).
- Files a compaction replaced stay on disk for the retention (a reader holding an older snapshot still reads them),
  as Delta's vacuum keeps unexpired tombstones.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import secrets
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from photon.joiner.publish import STAGING
from photon.logs import tables
from photon.logs.schemas import JOINED, QUARANTINE, UNJOINABLE
from photon.storage import LocalStore, Store, as_store

if TYPE_CHECKING:
    from deltalake import DeltaTable

KINDS = (JOINED, UNJOINABLE, QUARANTINE)
DEFAULT_RETENTION_HOURS = 168  # Delta's own default (delta.deletedFileRetentionDuration)
# Below this a data file a batch staged but has not committed yet could be vacuumed (a registry outage stalls a
# batch between its tasks' writes and its commit): refused unless forced.
MIN_RETENTION_HOURS = 24
TARGET_FILE_BYTES = 100 * 2**20  # Delta's default target for compaction (delta.targetFileSize)
COMPACT_ATTEMPTS = 5  # per hour, against another compaction of the same hour; then it waits for the next run
LOG = "_delta_log"
LOCK = ".maintenance.lock"  # <out>/<pipeline>/.maintenance.lock: held while a run maintains the pipeline's tables
# On an object store: <out>/<pipeline>/_maintenance/lock-<n>.json (StoreLock)
LOCK_DIR = "_maintenance"
LOCK_LEASE_S = 600.0  # how long an object-store lock holds without its holder; a killed run's blocks the next this long
log = logging.getLogger(__name__)


class MaintenanceError(ValueError):
    """Bad input to maintenance (no such pipeline, a retention below the minimum): one line, nothing changed."""


class MaintenanceLockLost(RuntimeError):
    """A run's lease on a pipeline's tables (an object store's ``StoreLock``) ran out or was taken over: it started no
    compaction since, and leaves the rest to the next run."""


class TableInvariantError(RuntimeError):
    """Maintenance found a table in a state it must never reach: a pipeline's published batch went back, or a
    compaction changed the rows of published batches."""


@dataclass
class TableFacts:
    """A table's size and history at one moment: what maintenance changes, before and after."""

    version: int  # the latest commit's version (commits = version + 1)
    files: int  # data files the snapshot names
    bytes: int  # their size
    rows: int
    files_on_disk: int  # data files in the folder: those named, plus replaced and never-committed ones
    bytes_on_disk: int
    log_files: int  # commit files in _delta_log
    commits_since_checkpoint: int  # commit files a reader opening the table reads after its checkpoint
    published_batch: int | None  # transaction_version("photon/<pipeline>")


@dataclass
class TableReport:
    pipeline: str
    kind: str
    before: TableFacts
    after: TableFacts
    hours_compacted: list[str] = field(default_factory=list)
    files_compacted: int = 0  # small files a compaction replaced
    files_written: int = 0
    hours_left: list[str] = field(default_factory=list)  # lost to another compaction COMPACT_ATTEMPTS times
    checkpoint: int | None = None
    vacuumed: list[str] = field(default_factory=list)  # paths relative to the table
    vacuumed_bytes: int = 0
    spared: int = 0  # old files no commit names that a stage folder still names (a batch not yet published)
    seconds: float = 0.0


@dataclass
class MaintenanceReport:
    out: str
    retention_hours: int
    dry_run: bool
    tables: list[TableReport]
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def totals(self) -> dict[str, int]:
        return {
            "tables": len(self.tables),
            "files_before": sum(t.before.files for t in self.tables),
            "files_after": sum(t.after.files for t in self.tables),
            "files_compacted": sum(t.files_compacted for t in self.tables),
            "vacuumed": sum(len(t.vacuumed) for t in self.tables),
            "vacuumed_bytes": sum(t.vacuumed_bytes for t in self.tables),
            "spared": sum(t.spared for t in self.tables),
        }


def check_retention(retention_hours: int, force: bool) -> None:
    if retention_hours < 0:
        raise MaintenanceError(f"--retention-hours {retention_hours}: a retention is 0 hours or more")
    if retention_hours < MIN_RETENTION_HOURS and not force:
        raise MaintenanceError(
            f"--retention-hours {retention_hours} is below the minimum of {MIN_RETENTION_HOURS} h: a batch writes its "
            "data files before its commit, and a shorter retention could vacuum them; nothing was changed (--force "
            "accepts it, only with no pipeline or backfill writing to these tables)"
        )


def maintain(
    out: Path | Store | str,
    pipelines: Iterable[str] | None = None,
    retention_hours: int = DEFAULT_RETENTION_HOURS,
    dry_run: bool = False,
    force: bool = False,
    target_bytes: int = TARGET_FILE_BYTES,
    lock_lease_s: float = LOCK_LEASE_S,
) -> MaintenanceReport:
    """Maintain every table of ``pipelines`` (default: every pipeline) under ``out`` (a folder or an object store;
    ``maintain_table``). With ``dry_run`` report what would be compacted and vacuumed and change nothing.
    ``lock_lease_s``: an object store's lock (``StoreLock``)."""
    check_retention(retention_hours, force)
    store = as_store(out)
    if isinstance(store, LocalStore) and not store.root.is_dir():
        raise MaintenanceError(f"--out {store.root} is not a folder")
    names = sorted(set(pipelines)) if pipelines else tables.pipelines(store)
    have = set(tables.pipelines(store))
    missing = [n for n in names if n not in have]
    if missing:
        raise MaintenanceError(
            f"no output table for pipeline {', '.join(missing)} under {store.url}; nothing was changed"
        )
    start = time.monotonic()
    reports = []
    for name in names:
        with pipeline_lock(store.child(name), lock_lease_s) as held:
            reports += [maintain_table(t, retention_hours, dry_run, target_bytes, held) for t in _kinds(store, name)]
    return MaintenanceReport(store.url, retention_hours, dry_run, reports, time.monotonic() - start)


def _kinds(out: Store, name: str) -> list[tables.OutputTable]:
    return [t for kind in KINDS for t in tables.tables(out, kind, [name])]


@contextlib.contextmanager
def pipeline_lock(
    root: Store,
    lease_s: float = LOCK_LEASE_S,
    *,
    file: str = LOCK,
    folder: str = LOCK_DIR,
    purpose: str = "table maintenance",
) -> Iterator[Callable[[], None]]:
    """Held while a run maintains the pipeline's tables at ``root``: a second run waits (two compactions of the same
    files would both commit in delta-rs, each with a copy of the rows). Publishers never take it. Yields a check to
    call before each compaction: it raises ``MaintenanceLockLost`` where the lock may no longer be this run's.

    A folder's is ``flock`` on ``file`` (``.maintenance.lock``; the kernel releases it when the process dies: never
    stale). An object store has no such lock: ``StoreLock`` in ``folder``. The data-quality check's publishing takes
    one of its own (``file``, ``folder`` and ``purpose`` its)."""
    if isinstance(root, LocalStore):
        with open(root.root / file, "a") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("%s: waiting for another run holding the lock of %s", purpose, root.root)
                t0 = time.monotonic()
                fcntl.flock(fh, fcntl.LOCK_EX)
                log.info("%s: waited %.1f s for the lock of %s", purpose, time.monotonic() - t0, root.root)
            try:
                yield lambda: None
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)
        return
    lock = StoreLock(root, lease_s, folder, purpose)
    lock.acquire()
    try:
        yield lock.check
    finally:
        lock.release()


def _clock() -> float:
    """Seconds that keep counting while the machine is suspended (Linux's boot time; else monotonic): a lease ages
    through a suspend, as its successor sees it by the store's clock."""
    return time.clock_gettime(time.CLOCK_BOOTTIME) if hasattr(time, "CLOCK_BOOTTIME") else time.monotonic()


class StoreLock:
    """Mutual exclusion between maintenance runs on an object store, from put-if-absent alone: a lease that no holder
    renews, taken by generation.

    1. The lock is ``<folder>/lock-<n>.json`` (``_maintenance`` for table maintenance, ``_lock`` in ``_quality`` for
       the data-quality check's publishing; ``n`` 12 ASCII digits; other names are ignored); its holder is
       whoever created generation ``n`` with a record no other run writes (a random token: put-if-absent counts a key
       holding one's very bytes as one's own). ``lock-<n>.released`` holding that token ends it.
    2. To take it: list the generations; if none, or the newest is released, create the next one. If the newest is
       held, wait until it is released, or until it is older than the lease plus ``MARGIN_S`` by the store's own
       clock (its modification time against that of an object written now): its holder is then past its lease (the
       holder's rule below) and the next generation may be created. A creation lost to another run: look again. A
       creation won on a stale listing (the generation was used and pruned while this run waited): a newer one
       exists, so this one is given up (released) and the run looks again.
    3. The holder starts no compaction (checked right before each attempt) once ``lease_s / 2`` has passed since
       before its creation (by this host's boot-time clock, which counts a suspend; the store stamped the object
       after that moment), nor once any newer generation exists. So every compaction it starts has at least half the
       lease to commit before a successor may exist; a run with more hours than that leaves them to the next run
       (``MaintenanceLockLost``, in the report).

    What a lease cannot promise: a holder paused (SIGSTOP, a suspended VM) inside one compaction, or one compaction
    that runs longer than half the lease, commits after its successor may have compacted the same hour; the row
    check after each compaction (``TableInvariantError``) names it, and each run first checks that the hour holds no
    click twice. A run killed
    while holding the lock blocks the next runs for the lease (``LOCK_LEASE_S``, 10 minutes), never longer."""

    MARGIN_S = 5.0  # S3 stamps objects to the second; clocks tick at nearly one rate
    POLL_S = 2.0
    NAME = re.compile(r"lock-([0-9]{12})\.(json|released)")

    def __init__(
        self, root: Store, lease_s: float = LOCK_LEASE_S, folder: str = LOCK_DIR, purpose: str = "table maintenance"
    ):
        self.root, self.lease_s = root, lease_s
        self.folder, self.purpose = folder, purpose  # the data-quality check's publishing takes one too
        self.generation: int | None = None
        self.token = ""
        self.since = 0.0  # monotonic, before the generation's object was created

    def _key(self, n: int, suffix: str = ".json") -> str:
        return f"{self.folder}/lock-{n:012d}{suffix}"

    def _generations(self) -> tuple[dict[int, int], set[int]]:
        """{generation: its object's modification time in microseconds}, and the released ones (of those)."""
        held: dict[int, int] = {}
        released: set[int] = set()
        for e in self.root.files(self.folder):
            m = self.NAME.fullmatch(e.key.rpartition("/")[2])
            if m is None:
                continue
            if m.group(2) == "json":
                held[int(m.group(1))] = e.modified_us
            else:
                released.add(int(m.group(1)))
        return held, released & set(held)

    def _released(self, n: int) -> bool:
        """Whether generation ``n`` was released by its holder: its marker names the generation's token (a marker
        left from before, of a generation pruned and created again since, ends nothing)."""
        try:
            token = json.loads(self.root.get(self._key(n)))["token"]
            return self.root.get(self._key(n, ".released")).decode() == token
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return False

    def _store_now_us(self) -> int:
        probe = f"{self.folder}/now-{secrets.token_hex(8)}"
        self.root.put(probe, b"")
        try:
            entry = self.root.head(probe)
        finally:
            self.root.delete(probe)
        if entry is None:
            raise MaintenanceError(f"{self.root.location(probe)}: written, then not found: the store's clock unknown")
        return entry.modified_us

    def acquire(self) -> None:
        said = False
        refused = 0
        while True:
            held, released = self._generations()
            n = max(held, default=None)
            done = n is not None and n in released and self._released(n)
            stale = n is not None and not done and self._store_now_us() - held[n] > (self.lease_s + self.MARGIN_S) * 1e6
            if n is None or done or stale:
                nxt = 0 if n is None else n + 1
                self.since = _clock()
                self.token = secrets.token_hex(16)  # this run's bytes, and no other's
                record = {"host": socket.gethostname(), "pid": os.getpid(), "token": self.token}
                record["took_over"] = n if stale else None
                if not self.root.put(self._key(nxt), json.dumps(record).encode(), if_absent=True):
                    if max(self._generations()[0], default=-1) >= nxt:
                        refused = 0
                        continue  # another run created it first
                    refused += 1
                    if refused >= 3:
                        # Refused, yet not listed as a generation: the key is taken by something else (a folder
                        # of that name on some stores). Said, not retried for ever.
                        key = self.root.location(self._key(nxt))
                        raise MaintenanceError(
                            f"{key}: cannot be created, yet is no lock: delete the key {key} and everything under"
                            f" {key}/"
                        )
                    time.sleep(min(self.POLL_S, 0.05 * refused))
                    continue
                if max(self._generations()[0], default=nxt) > nxt:  # created on a stale listing: not the lock
                    self.root.put(self._key(nxt, ".released"), self.token.encode())
                    continue
                self.generation = nxt
                if stale:
                    log.warning(
                        "%s: took over the lock of %s from a run silent for over %.0f s (generation %d)",
                        self.purpose,
                        self.root.url, self.lease_s + self.MARGIN_S, n,
                    )  # fmt: skip
                return
            if not said:
                log.info("%s: waiting for another run holding the lock of %s", self.purpose, self.root.url)
                said = True
            time.sleep(self.POLL_S)

    def check(self) -> None:
        """Before a compaction: raises ``MaintenanceLockLost`` unless the lock is surely still this run's."""
        assert self.generation is not None
        if _clock() - self.since > self.lease_s / 2:
            raise MaintenanceLockLost(
                f"{self.root.url}: half of the {self.purpose} lock's lease ({self.lease_s:.0f} s) has passed: no "
                "step starts now; the next run takes the rest"
            )
        if max(self._generations()[0], default=self.generation) > self.generation:
            raise MaintenanceLockLost(f"{self.root.url}: another run took over the {self.purpose} lock")

    def release(self) -> None:
        if self.generation is None:
            return
        n, self.generation = self.generation, None
        held, _ = self._generations()
        if max(held, default=n) > n:
            return  # taken over: it is not ours to release
        self.root.put(self._key(n, ".released"), self.token.encode())  # replaces a marker left from before
        for e in self.root.files(self.folder):  # the generations before: nothing reads them again
            m = self.NAME.fullmatch(e.key.rpartition("/")[2])
            if m is not None and int(m.group(1)) < n:
                self.root.delete(e.key)


def maintain_table(
    t: tables.OutputTable,
    retention_hours: int,
    dry_run: bool = False,
    target_bytes: int = TARGET_FILE_BYTES,
    still_held: Callable[[], None] = lambda: None,
) -> TableReport:
    """Maintain one pipeline's table of one kind, in four steps, each safe beside publishers appending:

    1. Compact: each hour partition holding two or more files under ``target_bytes`` is rewritten into fewer files,
       one commit per hour (``dataChange = false``, no application transaction). delta-rs puts it after the
       appends that won the race to commit; a commit it cannot reconcile (``CommitFailedError``) is tried again on
       the newer snapshot, up to ``COMPACT_ATTEMPTS`` times, then the hour waits for the next run. After each, the
       hour must hold as many rows of the published batches as before (``TableInvariantError`` if not).
    2. Checkpoint at the newest version: a reader opening the table reads it and the few commits after it instead
       of every commit since the last automatic checkpoint.
    3. Drop log files older than the log retention (``delta.logRetentionDuration``, 30 days) that the checkpoint
       makes unnecessary.
    4. Vacuum (``vacuum_unreferenced``): data files no commit names, older than the retention, and not named by a
       stage folder; and files compactions replaced longer than the retention ago.

    Paranoid check: the pipeline's published batch (its txn version) after is the one before or later (a publisher
    may commit meanwhile), never earlier, never gone."""
    from deltalake.exceptions import CommitFailedError

    start = time.monotonic()
    dt = t.table()
    before = table_facts(t, dt)
    report = TableReport(t.pipeline, t.kind, before, before)
    # Step 1: compact, hour by hour.
    lost: MaintenanceLockLost | None = None
    for hour, (small_files, small_bytes) in _hours_to_compact(dt, target_bytes).items():
        if not dry_run and lost is None:
            try:
                still_held()
            except MaintenanceLockLost as exc:
                lost = exc
                log.warning("table maintenance: %s", exc)
        if lost is not None:
            report.hours_left.append(hour)
            continue
        if dry_run:  # what the compaction would replace, and (at least) the files it would write
            report.hours_compacted.append(hour)
            report.files_compacted += small_files
            report.files_written += max(1, -(-small_bytes // target_bytes))
            continue
        published = dt.transaction_version(tables.app_id(t.pipeline))
        rows_before = _published_rows(dt, hour, published)
        _check_once(t, dt, hour)
        for _ in range(COMPACT_ATTEMPTS):
            if not dry_run:
                try:
                    still_held()  # right before each attempt: the reads before it, or a failed one, may take long
                except MaintenanceLockLost as exc:
                    lost = exc
                    log.warning("table maintenance: %s", exc)
                    break
            try:
                metrics = dt.optimize.compact(
                    partition_filters=[(tables.PARTITION, "=", hour)],
                    target_size=target_bytes,
                    commit_properties=_props("compact"),
                )
            except CommitFailedError:  # lost to a concurrent commit delta-rs could not reconcile: try again
                dt.update_incremental()
                continue
            if metrics["numFilesRemoved"]:
                _check_rows(t, dt, hour, published, rows_before)
                report.hours_compacted.append(hour)
                report.files_compacted += int(metrics["numFilesRemoved"])
                report.files_written += int(metrics["numFilesAdded"])
            break
        else:
            report.hours_left.append(hour)
        if lost is not None and hour not in report.hours_compacted + report.hours_left:
            report.hours_left.append(hour)
    if not dry_run:
        # Steps 2 and 3: checkpoint the newest version, then drop the log files it made unnecessary.
        dt.update_incremental()
        dt.create_checkpoint()
        report.checkpoint = dt.version()
        dt.cleanup_metadata()
    # Step 4: vacuum.
    report.vacuumed, report.vacuumed_bytes, report.spared = vacuum_unreferenced(t, retention_hours, dry_run)
    report.after = table_facts(t, t.table())
    if dry_run:  # the files the table would hold (the facts as they stand, but for the compaction's files)
        report.after = replace(report.after, files=report.after.files - report.files_compacted + report.files_written)
    if before.published_batch is not None and (
        report.after.published_batch is None or report.after.published_batch < before.published_batch
    ):
        raise TableInvariantError(
            f"{t.uri}: the published batch of {t.pipeline} went from {before.published_batch} to "
            f"{report.after.published_batch} during maintenance"
        )
    report.seconds = time.monotonic() - start
    return report


def vacuum_unreferenced(
    t: tables.OutputTable, retention_hours: int, dry_run: bool = False
) -> tuple[list[str], int, int]:
    """Delete the table's data files that no commit names and that are older than ``retention_hours``, and the files
    compactions replaced longer ago than that; never one a stage folder of the pipeline still names. Returns the
    paths deleted (or, with ``dry_run``, to delete), their bytes, and how many old files were spared for a stage.

    delta-rs lists the candidates (a full vacuum's dry run); the deletion is done here, after two checks its own
    vacuum cannot make, in this order (the order is the argument):

    1. Candidates: files the snapshot loaded now does not name, older than the retention, or replaced longer ago.
    2. Spared: every path a stage folder names, and every file whose name starts with a stage folder's batch tag
       (``b<batch>-e<epoch>``, as a joiner's tasks name them): a listing of the stage's records may miss one. A batch
       committed to the registry but not yet published can be published later, however old its files; ``publish``
       removes a stage folder only after its Delta commit.
    3. Named now: the table's newest snapshot. A batch published since step 1 names its files there: its stage
       folder was either still there at step 2 or gone, and then its commit came before step 3.
    4. Delete the candidates that are neither spared nor named now."""
    table = t.table()
    # Step 1: candidates. Our own retention check ran before (check_retention); delta-rs' would refuse under 168 h.
    candidates = table.vacuum(
        retention_hours=retention_hours, dry_run=True, enforce_retention_duration=False, full=True
    )
    if not candidates:
        return [], 0, 0
    # Step 2: spared.
    folder = t.key.rpartition("/")[0]  # the pipeline's: "" where the table was opened at it (OutputTable.at)
    pipeline = t.store.child(folder) if folder else t.store
    staged = staged_paths(pipeline, t.kind)
    tags = set(pipeline.folders(STAGING))

    def kept(rel: str) -> bool:
        name = rel.rpartition("/")[2]
        return rel in staged or "-".join(name.split("-")[:2]) in tags

    # Step 3: named by the newest snapshot.
    table.update_incremental()
    named = set(_relative_paths(table))
    # Step 4: delete.
    doomed = sorted(p for p in candidates if not kept(p) and p not in named)
    spared = sum(1 for p in candidates if kept(p) and p not in named)
    size = 0
    for rel in doomed:
        entry = t.store.head(f"{t.key}/{rel}")
        if entry is None:
            continue  # another maintenance run took it first
        size += entry.size
        if not dry_run:
            t.store.delete(f"{t.key}/{rel}")
    return doomed, size, spared


def staged_paths(root: Path | Store, kind: str) -> set[str]:
    """Paths (relative to the ``kind`` table) of the data files every stage folder of the pipeline at ``root``
    names: batches not published yet, committed to the registry or not."""
    found: set[str] = set()
    for stage in as_store(root).folders(STAGING):
        # a stage published and removed meanwhile lists nothing: its files are in the snapshot then
        found.update(a["path"] for a in tables.staged_adds(root, f"{STAGING}/{stage}").get(kind, []))
    return found


def table_facts(t: tables.OutputTable, dt: DeltaTable | None = None) -> TableFacts:
    """The table's size and history now (``TableFacts``)."""
    dt = dt or t.table()
    adds = pa.table(dt.get_add_actions(flatten=True))
    # Through the store (a folder or a bucket): the data files, and the log's commits and checkpoints
    on_disk = [
        e
        for e in t.store.listing(t.key)
        if e.key.endswith(".parquet")
        and LOG not in e.key.removeprefix(t.key + "/").split("/")
        and not e.key.rpartition("/")[2].startswith(".")
    ]
    sizes = [e.size for e in on_disk]
    names = [e.key.rpartition("/")[2] for e in t.store.files(f"{t.key}/{LOG}")]
    commits = sorted(int(n.split(".")[0]) for n in names if n.endswith(".json") and n.split(".")[0].isdigit())
    checkpoint = max((int(n.split(".")[0]) for n in names if ".checkpoint" in n and n.endswith(".parquet")), default=-1)
    return TableFacts(
        version=dt.version(),
        files=adds.num_rows,
        bytes=int(pc.sum(adds["size_bytes"]).as_py() or 0),
        rows=int(pc.sum(adds["num_records"]).as_py() or 0),
        files_on_disk=len(on_disk),
        bytes_on_disk=sum(sizes),
        log_files=len(commits),
        commits_since_checkpoint=sum(1 for v in commits if v > checkpoint),
        published_batch=dt.transaction_version(tables.app_id(t.pipeline)),
    )


def _hours_to_compact(dt: DeltaTable, target_bytes: int) -> dict[str, tuple[int, int]]:
    """The hours with two or more data files under the target size, each with those files' count and bytes: what a
    compaction would rewrite."""
    adds = pa.table(dt.get_add_actions(flatten=True))
    small = adds.filter(pc.less(adds["size_bytes"], target_bytes))
    counts = small.group_by(f"partition.{tables.PARTITION}").aggregate([("path", "count"), ("size_bytes", "sum")])
    found = zip(
        counts[f"partition.{tables.PARTITION}"].to_pylist(),
        counts["path_count"].to_pylist(),
        counts["size_bytes_sum"].to_pylist(),
        strict=True,
    )
    return {h: (n, int(b or 0)) for h, n, b in sorted(found, key=lambda x: x[0] or "") if n >= 2 and h}


def _published_rows(dt: DeltaTable, hour: str, published: int | None) -> int:
    """Rows of ``hour`` from batches up to ``published``: a publisher only adds later batches, so a compaction must
    leave this count as it was."""
    import pyarrow.dataset as ds

    if published is None:
        return 0
    where = (ds.field(tables.PARTITION) == hour) & (ds.field(tables.BATCH) <= published)
    return int(dt.to_pyarrow_dataset().count_rows(filter=where))


def _check_once(t: tables.OutputTable, dt: DeltaTable, hour: str) -> None:
    """Before compacting an hour of a ``joined`` table: no click in it twice (a pipeline joins a click once; two
    compactions that both committed, one of them too late to see its own check fail, leave every row twice)."""
    import pyarrow.dataset as ds

    if t.kind != JOINED:
        return
    ids = dt.to_pyarrow_dataset().to_table(columns=["click_id"], filter=ds.field(tables.PARTITION) == hour)
    twice = ids.num_rows - len(pc.unique(ids["click_id"]))
    if twice:
        raise TableInvariantError(
            f"{t.uri}: hour {hour} holds {twice} click(s) twice (version"
            f" {dt.version()}); another process compacted this table? Stop it, restore the version before; nothing"
            " was compacted"
        )


def _check_rows(t: tables.OutputTable, dt: DeltaTable, hour: str, published: int | None, before: int) -> None:
    dt.update_incremental()
    after = _published_rows(dt, hour, published)
    if after != before:
        raise TableInvariantError(
            f"{t.uri}: compacting hour {hour} changed the rows of batches up to {published} from {before} to {after} "
            f"(version {dt.version()}); another process compacting this table? Stop it, restore the version before"
        )


def _relative_paths(dt: DeltaTable) -> list[str]:
    return pa.table(dt.get_add_actions(flatten=True))["path"].to_pylist()


def _props(action: str) -> Any:
    from deltalake import CommitProperties

    return CommitProperties(custom_metadata={"photon.maintenance": action})


def format_bytes(n: float) -> str:
    """A size a person reads: 1,234 B, 12.3 KB, 4.5 MB, 6.7 GB."""
    if n < 1000:
        return f"{n:,.0f} B"
    for unit in ("KB", "MB"):
        n /= 1000
        if n < 1000:
            return f"{n:,.1f} {unit}"
    return f"{n / 1000:,.1f} GB"
