"""One micro-batch after another, on the driver: build the batch's tasks, run its one Spark job, commit it with the
files it consumed and its metrics, publish it. Also the standby's warm-up batch, which runs the same job on made-up
files before a take-over."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from photon.durable import check_parquet
from photon.joiner.common import (
    JOIN_COUNTS,
    RECOVER_RETRIES,
    US,
    BatchResult,
    JoinSettings,
    _maybe_crash,
    batch_tag,
    code_fingerprint,
)
from photon.joiner.discovery import Discovery, _marks_before
from photon.joiner.publish import STAGING, STATE, publish_files, stage_key
from photon.joiner.state import Lease, PipelineState
from photon.joiner.tasks import (
    JOIN_TASK,
    SHUFFLED,
    WANTED,
    Wanted,
    _join_task,
    _quarantine,
    _source_task,
    _Task,
    _wanted_task,
    read_markers,
)
from photon.logs.parse import BAD_FIELDS
from photon.logs.schemas import JOINED, QUARANTINE, UNJOINABLE
from photon.logs.tables import stage_rows
from photon.pg import failover_s as default_failover_s
from photon.pg import replication_mode
from photon.registry.clock import ServerClock
from photon.settings import load_settings
from photon.spark_session import is_remote
from photon.storage import Entry, StorageError, Store, again

log = logging.getLogger(__name__)


class BatchRunner:
    def __init__(
        self,
        *,
        dc: str,
        pipeline: str,
        logs: Store,
        root: Store,
        servers: Mapping[str, str],
        spark: Any,
        settings: JoinSettings,
        clock: ServerClock,
        state: PipelineState,
        discovery: Discovery,
        parallelism: int,
    ):
        """Batches of pipeline ``pipeline`` over ``<logs>/<dc>`` into ``root`` (``<out>/<pipeline>``), taking the files
        ``discovery`` lists, ``parallelism`` tasks per stage."""
        self.dc, self.pipeline, self.logs, self.servers, self.spark = dc, pipeline, logs, dict(servers), spark
        self.s, self.clock, self.state, self.discovery = settings, clock, state, discovery
        self.parallelism = parallelism
        self._sizes: dict[str, int] = {}
        self.root = root  # <out>/<pipeline>: a folder or a prefix of a bucket
        self.state_store = root.child(STATE)
        self.last_batch = 0  # last batch committed (by this lease or before it)
        self.retry_key: str | None = None  # the last committed batch's retry set: a folder of ``self.state``
        self.retry_rows: int | None = None  # the rows its tasks wrote to it (the batch's committed "retried")
        # Its files and their due times, read once (a retry set never changes)
        self._retry_set: tuple[str, list[Entry], np.ndarray] | None = None
        self.horizon_us: int | None = None  # the registry's horizon at the lease's start (query_index.py)
        self.shared_index: Store | None = None  # a backfill's: the data center's shared query index
        self.ship_queries_from = int(load_settings().ship_queries_from_mib * (1 << 20))  # bytes (``_wanted``)

    def warm_up(self) -> None:
        """Run a batch's own job once before the take-over, so the first batch after it costs what any batch costs (a
        fresh session's first job pays for the JVM's shuffle and Arrow paths, the Python workers' imports, parser,
        registry connections and the EventStore's recent buckets). The job reads a made-up query file and a made-up
        click file: clicks older than the maximum join delay whose queries are nowhere (their ids name the recent
        buckets, which the workers' EventStore caches load looking for them), decided unjoinable into a throwaway
        stage folder. It reads the registry and the pipeline's store and writes nothing but its own folder, removed
        after. A failure here costs only the warm-up."""
        folder = f"{STAGING}/warm-up-{os.uname().nodename}-{os.getpid()}"
        try:
            self._dry_batch(self.root.child(folder))
        except Exception as exc:  # an optimisation: the lease works without it
            log.warning("%s: warm-up batch failed (the first batch will be slower): %r", self.pipeline, exc)
        finally:
            try:
                self.root.remove_all(folder)
            except OSError as exc:
                log.warning("%s: warm-up folder %s left: %s", self.pipeline, folder, exc)

    def _dry_batch(self, folder: Store) -> None:
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
            folder.put(f"{kind}/warm-up-{kind}.jsonl", b"".join(json.dumps(x).encode() + b"\n" for x in lines))
            sources.append((kind, "", f"warm-up-{kind}.jsonl"))
        # No click registered (token 0); its made-up logs and output stay in its own folder.
        t = self._task("warm-up", now, "stage", 0, 0, root=folder.url, source_root=folder.url)
        rows = self._job(t, sources)
        decided = sum(int(r["unjoinable"]) for r in rows)
        if decided != len(clicks) or any(int(r["joined"]) or int(r["retried"]) for r in rows):
            raise AssertionError(f"warm-up batch: {len(clicks)} made-up clicks, got {[r.asDict() for r in rows]}")

    def retry_counts(self) -> tuple[int, int]:
        """(waiting, due) retries. Asked on every trigger, so it reads the small retry set with Arrow rather than
        starting a Spark job while the joiner is idle."""
        due_us = self._read_retry_set()[1]
        return len(due_us), int(np.count_nonzero(due_us <= self.clock.now_us()))

    def retry_files(self) -> list[Entry]:
        """The files of the last committed batch's retry set, in the pipeline's state."""
        return self._read_retry_set()[0]

    def _read_retry_set(self) -> tuple[list[Entry], np.ndarray]:
        """The retry set's files and due times. Listed again while they hold fewer rows than its batch's tasks wrote
        (``retry_rows``; a store's listing may miss an object just put), within the storage retry budget, then
        ``RetrySetShortError``: a file missed would have its clicks never looked at again."""
        import pyarrow.parquet as pq

        key, want = self.retry_key, self.retry_rows
        if key is None:
            return [], np.zeros(0, np.int64)
        if self._retry_set is None or self._retry_set[0] != key:

            def listed() -> tuple[list[Entry], np.ndarray]:
                every = self.state_store.files(key)
                files = [e for e in every if e.key.endswith(".parquet")]
                due = [np.zeros(0, np.int64)]
                for e in files:
                    data = self.state_store.get(e.key)
                    check_parquet(data, self.state_store.location(e.key), RECOVER_RETRIES)  # damaged: named, one line
                    due.append(pq.read_table(pa.BufferReader(data), columns=["due_us"])["due_us"].to_numpy())
                found = np.concatenate(due)
                # A file moved aside (RECOVER_RETRIES: ``mv FILE FILE.corrupt``): its clicks given up by a person
                aside = len(every) > len(files)
                if want is not None and len(found) < want and not aside:
                    raise RetrySetShortError(
                        f"{self.state_store.location(key)}: the retry set lists {len(found)} clicks of the {want} its"
                        " batch's tasks wrote (the store's listing is missing some, or a file of it is gone): no batch"
                        " reads it so. A file lost for good: put any file not ending in .parquet in that folder (such"
                        " as lost.txt) and the pipeline goes on without its clicks (`photon audit` lists them)"
                    )
                return files, found

            self._retry_set = (key, *again(listed, lambda exc: isinstance(exc, RetrySetShortError)))
        return self._retry_set[1], self._retry_set[2]

    def _task(
        self, tag: str, now: int, stage: str, token: int, batch: int, root: str = "", source_root: str = ""
    ) -> _Task:
        return _Task(
            dc=self.pipeline,
            tag=tag,
            batch=batch,
            root=root or self.root.url,  # the warm-up's made-up output stays in its own folder
            now=now,
            stage=stage,
            state=self.state_store.url,  # the workers' EventStore caches are keyed by it
            logs=self.logs.child(f"{self.dc}/queries").url,
            source_root=source_root or self.logs.child(self.dc).url,
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
            failover_s=default_failover_s(),
            max_clock_skew_us=int(self.s.max_clock_skew_s * US),
            clock_offset_us=self.clock.offset.offset_us,
            settle_s=self.s.settle_s,
            horizon_us=self.horizon_us,
            shared_index=self.shared_index.url if self.shared_index is not None else None,
            settled={f"{k}/{n}": [size, tag] for (k, n), (size, tag) in self.discovery.settled_as.items()},
            replication=replication_mode(),
            # Checked on a Spark Connect server only: its workers outlive any one joiner, so they may hold older code.
            code=code_fingerprint(self.s.adapter) if is_remote(self.spark) else "",
        )

    def _job(self, t: _Task, sources: list[tuple[str, str, str]]) -> list[Any]:
        """A batch's Spark job: parse every source (queries stored first: the shuffle is a barrier), then steps 2-6
        per partition of click ids; one row of counts per task. On an object store, a first job finds the clicks'
        query ids (``Wanted``) when the batch has query files too."""
        from pyspark.sql.pandas.types import from_arrow_schema

        # A log file's size as listed (its path is the task's to open); a retry set's file's as listed
        sizes = [self.discovery.sizes.get((k, rel), 0) if not p else self._sizes.get(p, 0) for k, p, rel in sources]
        groups = balanced_groups(sizes, self.parallelism)
        try:
            wanted = self._wanted(t, sources, sizes)
            return (
                self._tasks(len(groups))
                .mapInArrow(_source_task(t, sources, groups, wanted), from_arrow_schema(SHUFFLED))
                .repartition(self.parallelism, "click_id")
                .mapInArrow(_join_task(t), from_arrow_schema(JOIN_TASK))
                .collect()
            )
        except Exception as exc:
            # An object store that failed in a task: the batch fails (nothing committed) with the store's one line,
            # not Spark's page of both stacks (Spark hands a worker's exception over as its text).
            found = _STORE_FAILED.search(str(exc))
            if found:
                raise StorageError(found.group(1).strip()) from None
            raise

    def _wanted(self, t: _Task, sources: list[tuple[str, str, str]], sizes: list[int]) -> Wanted | None:
        """The batch's ``Wanted``, where it pays: logs on an object store, where a lookup of a batch's own query
        reads back whole the objects another worker parsed (a folder's lines come out of the page cache), and a batch
        with clicks and at least ``PHOTON_SHIP_QUERIES_FROM_MIB`` of query files (below it, as in a live batch, the
        first job costs more than it saves: make bench-object-store measured it saving 1.5 s of a 320 MB batch's 7.6
        s, and costing 0.3 s of a 67 MB batch's 3.0 s, which reads its click files twice). None past ``WANTED_MAX``
        pairs: they ride in every stage-1 task."""
        from pyspark.sql import functions as F
        from pyspark.sql.pandas.types import from_arrow_schema

        queries = [i for i, (kind, _, _) in enumerate(sources) if kind == "queries"]
        others = [i for i, (kind, _, _) in enumerate(sources) if kind != "queries"]
        if not self.logs.atomic or not queries or not others:
            return None
        if sum(sizes[i] for i in queries) < self.ship_queries_from:
            return None
        groups = [[others[i] for i in g] for g in balanced_groups([sizes[i] for i in others], self.parallelism)]
        found = (
            self._tasks(len(groups))
            .mapInArrow(_wanted_task(t, sources, groups), from_arrow_schema(WANTED))
            # Each click's partition in the batch's shuffle, as repartition(parallelism, "click_id") places it
            .withColumn("part", F.pmod(F.hash("click_id"), F.lit(self.parallelism)))
            .toArrow()
        )
        if found.num_rows > WANTED_MAX:
            return None
        return Wanted.of(found)

    def _tasks(self, n: int) -> Any:
        """A DataFrame of task indices 0..n-1 spread over the executors: each task reads its own files."""
        return self.spark.range(0, n, 1, max(1, min(n, self.parallelism)))

    def run_batch(self, lease: Lease, k: int, q_files: list[str], c_files: list[str]) -> BatchResult:
        """One micro-batch, one Spark job of two stages: parse (and store the new queries), shuffle by click id,
        steps 2-6 in each partition, under ``lease``. Only counts and latencies come back to the driver."""
        t_start = time.time()
        now = self.clock.now_us()
        tag = batch_tag(k, lease.epoch)
        stage = stage_key(k, lease.epoch)
        t = self._task(tag, now, stage, lease.token(k).value, k)
        metrics: dict[str, Any] = {"started_at_us": now, "query_files": len(q_files), "click_files": len(c_files)}

        sources = [("queries", "", n) for n in q_files] + [("clicks", "", n) for n in c_files]  # in t.source_root
        retry_files = self.retry_files()
        self._sizes = {e.key: e.size for e in retry_files}
        sources += [("retries", e.key, e.key.rpartition("/")[2]) for e in retry_files]  # keys in the state
        counts = dict.fromkeys(JOIN_COUNTS, 0)
        latencies: list[float] = []
        shipped = 0
        if sources:
            for r in self._job(t, sources):
                for name in JOIN_COUNTS:
                    counts[name] += int(r[name])
                shipped += int(r["shipped"])
                latencies.extend(r["latencies_s"] or [])
        t_job = time.time()
        logs = [("queries", n) for n in q_files] + [("clicks", n) for n in c_files]
        markers = read_markers(self.root, stage, logs)  # every log file accounted for, read or left for later
        skipped = markers.skipped
        changed = self._quarantine_changed(stage, tag, now, k)
        _maybe_crash("after_register", k, k - lease.last_batch)
        metrics.update(counts)
        metrics["queries"] = markers.indexed
        metrics["quarantined"] = markers.quarantined + changed  # as staged, counted by the tasks, not a listing
        q = np.quantile(np.asarray(latencies), [0.5, 0.9, 0.99]).tolist() if latencies else [None] * 3
        metrics.update({"latency_p50_s": q[0], "latency_p90_s": q[1], "latency_p99_s": q[2]})
        metrics["duration_s"] = time.time() - t_start

        # 7. commit (fenced, in order, with the consumed files and the metrics), then publish.
        files = [f for f in logs if f not in skipped]  # still being written: listed and read again later
        _maybe_crash("before_commit", k, k - lease.last_batch)
        # The commit also acknowledges the newest shard configuration, planned ones included: a reshard waits for it.
        # (The executors' registries follow a new layout when a shard's server refuses their old one.)
        marks = _marks_before(dict(self.discovery.next_marks), skipped)
        if skipped:
            log.info("%s batch %d: %d file(s) still being written, left for later", self.pipeline, k, len(skipped))
        self.state.commit(lease, k, files, metrics, marks=marks)
        _maybe_crash("after_commit", k, k - lease.last_batch)
        # Never fewer rows than the tasks staged (a store's listing may miss some just after it restarted)
        expect = {JOINED: counts["joined"], UNJOINABLE: counts["unjoinable"], QUARANTINE: metrics["quarantined"]}
        self.publish(k, lease.epoch, k - lease.last_batch, expect, markers.index)
        self.discovery.committed(files, markers.read, changed, marks)  # consumed; behind the marks: forgotten
        self.retry_key, self.retry_rows = f"retries/{t.tag}", counts["retried"]
        self.last_batch = k
        took = (t_job - t_start, time.time() - t_job)
        log.info("%s batch %d: job %.2fs, commit %.2fs: %s", self.pipeline, k, *took, metrics)
        # Said with the batch, not kept by the registry: clicks that took a query shipped with them (tasks.Wanted)
        return BatchResult(k, {**metrics, "shipped": shipped} if shipped else metrics)

    def _quarantine_changed(self, stage: str, tag: str, now: int, batch: int) -> int:
        """Stage the quarantine records of consumed files found changed (``_check_consumed``); how many."""
        changed = self.discovery.changed
        n = len(changed)
        for kind in ("queries", "clicks"):
            rows = [{k: v for k, v in r.items() if k != "kind"} for r in changed[:n] if r["kind"] == kind]
            if rows:
                bad = pa.Table.from_pylist(rows, schema=BAD_FIELDS)
                records = _quarantine(bad, self.pipeline, kind, now)
                stage_rows(self.root, QUARANTINE, stage, f"{tag}-changed-{kind}", records, batch)
        return n

    def publish(
        self,
        k: int,
        epoch: int,
        lease_batch: int = 0,
        expect: dict[str, int] | None = None,
        index: list[str] | None = None,
        indexed: int | None = None,
    ) -> None:
        """Batch ``k`` of lease ``epoch``, committed: its files committed to the tables, then marked published
        (``publish_files``: ``expect``, ``index`` and ``indexed`` are what its tasks reported)."""

        def crash_point(kind: str) -> None:  # the joined table holds the batch, the others not yet
            if kind == JOINED:
                _maybe_crash("after_table_commit", k, lease_batch)

        publish_files(self.root, self.pipeline, k, epoch, crash_point, expect, index, indexed)
        self.state.mark_published(k)


class RetrySetShortError(StorageError):
    """A retry set that lists fewer clicks than its batch's tasks wrote to it: never read so."""


WANTED_MAX = 500_000  # (click, query) pairs, about 60 bytes each
_STORE_FAILED = re.compile(r"photon\.storage\.(?:StorageError|NotFoundError): ([^\n]+)")


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
