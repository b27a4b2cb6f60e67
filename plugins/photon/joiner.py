"""The micro-batch joiner (Photon's dispatcher + joiner) on Spark: one long-lived session, one batch per trigger.

Batch k of pipeline P, under a lease with epoch E:
1. Take the closed query files not consumed yet into the EventStore, and the new closed click files plus the
   retries that are due; parse them in executors; malformed lines go to quarantine with a reason.
2. Registry pre-filter: drop clicks another batch already registered (Photon's dispatcher lookup).
3. Look each click's query up in the EventStore: the cache of recent time buckets held in the session, then the
   stored buckets for older ones. Clicks without a query wait for a retry with exponential backoff, or go to
   unjoinable/ once older than the maximum join delay.
4. The adapter merges the query's fields into the click.
5. Register the joined click ids in executors, per partition and shard, under token (P, k).
6. Stage the rows we won, the unjoinable clicks, the quarantine records, the stored queries and the new retry set
   under ``b<k>-e<E>``; commit batch k (fenced by E, in order); move the staged output into place.
7. Record the batch's metrics with the commit.

A crash anywhere re-runs batch k from the last committed state; registrations of the dead attempt carry the same
token, come back WON_AGAIN and are written then. A zombie lease can register but never commit or publish.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from photon.adapter import ADAPTED_SCHEMA, load_adapter
from photon.parse import BAD_FIELDS, CLICK_FIELDS, QUERY_FIELDS, parse_file
from photon.pipeline_state import Lease, PipelineState
from photon.schemas import JOINED, QUARANTINE, UNJOINABLE

log = logging.getLogger(__name__)
US = 1_000_000

REASON_TOO_LATE = "query not found within the maximum join delay"
REASON_GC = "older than the registry's garbage-collection threshold"


@dataclass(frozen=True)
class JoinSettings:
    max_join_delay_s: float = 120.0
    trigger_interval_s: float = 1.0
    retry_base_s: float = 1.0  # first retry after this long, doubling up to retry_max_s
    retry_max_s: float = 16.0
    bucket_s: int = 60  # EventStore time bucket
    cache_buckets: int = 30  # buckets of queries kept in the session (the CacheEventStore)
    max_click_files: int = 2_000  # per batch; every new query file is always taken (the EventStore comes first)
    adapter: str = "photon.adapter:default_adapter"
    parallelism: int = 2  # partitions for parsing and registration


@dataclass
class BatchResult:
    batch_seq: int
    metrics: dict[str, Any] = field(default_factory=dict)


def _maybe_crash(point: str, batch_seq: int) -> None:
    """Fault injection for tests: PHOTON_CRASH_AT=<point>@<batch> kills this process with SIGKILL right there."""
    if os.environ.get("PHOTON_CRASH_AT") == f"{point}@{batch_seq}":
        os.kill(os.getpid(), signal.SIGKILL)


# -- executor-side functions (they run in Spark's Python workers) ----------------------------------------------

_REGISTRIES: dict[tuple[tuple[str, str], ...], Any] = {}


def _registry(servers: Mapping[str, str]) -> Any:
    """One IdRegistry per Python worker (workers are reused across tasks), keeping its shard connections."""
    from photon.registry import IdRegistry

    key = tuple(sorted(servers.items()))
    if key not in _REGISTRIES:
        _REGISTRIES[key] = IdRegistry(dict(servers))
    return _REGISTRIES[key]


def _parser(kind: str) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    schema = QUERY_FIELDS if kind == "queries" else CLICK_FIELDS
    out_schema = pa.schema([*schema, pa.field("bad", pa.struct(list(BAD_FIELDS)))])

    def parse(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        bad_type = pa.struct(list(BAD_FIELDS))
        for batch in batches:
            paths, contents = batch.column("path").to_pylist(), batch.column("content").to_pylist()
            for path, content in zip(paths, contents, strict=True):
                good, bad = parse_file(path.rsplit("/", 1)[-1], content, kind)
                if good.num_rows:
                    yield from good.append_column("bad", pa.nulls(good.num_rows, bad_type)).to_batches()
                if bad.num_rows:
                    struct = pa.StructArray.from_arrays(
                        [bad.column(i).combine_chunks() for i in range(bad.num_columns)], fields=list(BAD_FIELDS)
                    )
                    empty = [pa.nulls(bad.num_rows, f.type) for f in schema]
                    yield from pa.table([*empty, struct], schema=out_schema).to_batches()

    return parse


def _lookup_fn(servers: Mapping[str, str]) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    def lookup(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        reg = _registry(servers)
        for batch in batches:
            if batch.num_rows == 0:
                continue
            res = reg.lookup(batch.column("click_id"))
            yield batch.append_column("reg_token", pa.array(np.where(res.registered, res.tokens, -1))).append_column(
                "too_old", pa.array(res.too_old)
            )

    return lookup


def _register_fn(
    servers: Mapping[str, str], token_value: int, stats: Any
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    def register(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from photon.owners import Token

        reg = _registry(servers)
        token = Token.from_value(token_value)
        for batch in batches:
            if batch.num_rows == 0:
                continue
            res = reg.register(batch.column("click_id"), token)
            stats.add(np.array([len(res.shards), sum(s.rows for s in res.shards), res.retries], dtype=np.int64))
            yield batch.append_column("outcome", pa.array(res.outcomes, pa.int8()))

    return register


def _adapter_fn(path: str) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    def adapt(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        fn = load_adapter(path)
        for batch in batches:
            if batch.num_rows:
                yield fn(batch)

    return adapt


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
    ):
        self.dc, self.logs, self.out = dc, logs, out
        self.servers = dict(servers)
        self.spark = spark
        self.s = settings or JoinSettings()
        self.state = PipelineState(self.servers["main"], dc)
        self.root = out / dc
        self.state_dir = self.root / "_state"
        self.staging = self.root / "_staging"
        self.lease: Lease | None = None
        self.last_batch = 0  # last batch committed (by this lease or before it)
        self.consumed: set[tuple[str, str]] = set()
        self.cache: Any = None
        self.retry_dir: Path | None = None
        load_adapter(self.s.adapter)  # fail fast on a bad adapter path

    # lease start: recover, then load state --------------------------------------------------------------
    def start(self) -> Lease:
        self.lease = self.state.start_lease()
        committed = {(b, e): published for b, e, published in self.state.batches()}
        for (b, e), published in sorted(committed.items()):
            if not published:
                self._publish(b, e)
        keep = {self._tag(b, e) for b, e in committed}
        shutil.rmtree(self.staging, ignore_errors=True)  # whatever is still staged was never committed
        retries = self.state_dir / "retries"
        if retries.is_dir():
            for d in retries.iterdir():
                if d.name not in keep:
                    shutil.rmtree(d, ignore_errors=True)
        self.consumed = self.state.consumed()
        self.last_batch = self.lease.last_batch
        last = max(committed, default=None)
        retry = self.state_dir / "retries" / self._tag(*last) if last else None
        self.retry_dir = retry if retry and retry.is_dir() else None
        self._load_cache()
        log.info("%s: lease epoch %d, last batch %d", self.dc, self.lease.epoch, self.lease.last_batch)
        return self.lease

    @staticmethod
    def _tag(batch: int, epoch: int) -> str:
        return f"b{batch:010d}-e{epoch}"

    def _store(self) -> Any:
        """The stored EventStore (committed batches only: files are published there after the commit)."""
        root = self.state_dir / "eventstore"
        if not root.is_dir() or not any(root.glob("bucket=*/*.parquet")):
            return None
        return self.spark.read.parquet(str(root))

    def _load_cache(self) -> None:
        from pyspark.sql import functions as F

        now_bucket = int(time.time()) // self.s.bucket_s
        stored = self._store()
        if stored is not None:
            df = stored.where(F.col("bucket") >= now_bucket - self.s.cache_buckets)
        else:
            df = self._empty_queries()
        self._set_cache(df.dropDuplicates(["query_id"]))

    def _set_cache(self, df: Any) -> None:
        old = self.cache
        self.cache = df.localCheckpoint(eager=True)
        if old is not None:
            old.unpersist()

    def _empty_queries(self) -> Any:
        schema = self._spark_schema(pa.schema([*QUERY_FIELDS, pa.field("bucket", pa.int64())]))
        return self.spark.createDataFrame([], schema)

    # the loop --------------------------------------------------------------------------------------------
    def run(
        self,
        *,
        run_for_s: float | None = None,
        until_caught_up: bool = False,
        drain: bool = False,
        max_batches: int | None = None,
        on_batch: Callable[[BatchResult], None] | None = None,
    ) -> list[BatchResult]:
        """Run batches until ``run_for_s`` passes (a lease), or until caught up: no new file, and the retries that
        were due have had one batch since the last new file. With ``drain``, until no retry is left at all."""
        if self.lease is None:
            self.start()
        deadline = time.monotonic() + run_for_s if run_for_s is not None else None
        k = self.last_batch
        results = []
        retried_since_files = False
        while True:
            t0 = time.monotonic()
            q_files, c_files = self._new_files()
            pending, due = self._retry_counts()
            ran = False
            if q_files or c_files:
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
            if deadline is not None and time.monotonic() >= deadline:
                break
            time.sleep(max(0.0, self.s.trigger_interval_s - (time.monotonic() - t0)))
        return results

    def _new_files(self) -> tuple[list[str], list[str]]:
        def listing(kind: str) -> list[str]:
            folder = self.logs / self.dc / kind
            if not folder.is_dir():
                return []
            return sorted(n for n in os.listdir(folder) if n.endswith(".jsonl") and (kind, n) not in self.consumed)

        return listing("queries"), listing("clicks")[: self.s.max_click_files]

    def _retries(self) -> Any:
        if self.retry_dir is None:
            return None
        return self.spark.read.parquet(str(self.retry_dir))

    def _retry_counts(self) -> tuple[int, int]:
        """(waiting, due) retries. Asked on every trigger, so it reads the small retry set with Arrow rather than
        starting a Spark job while the joiner is idle."""
        import pyarrow.parquet as pq

        if self.retry_dir is None or not any(self.retry_dir.glob("*.parquet")):
            return 0, 0
        due_us = pq.read_table(self.retry_dir, columns=["due_us"])["due_us"].to_numpy()
        return len(due_us), int(np.count_nonzero(due_us <= int(time.time() * US)))

    def _parse(self, kind: str, names: list[str]) -> tuple[Any, Any]:
        from pyspark.sql import functions as F

        schema = QUERY_FIELDS if kind == "queries" else CLICK_FIELDS
        spark_schema = self._spark_schema(pa.schema([*schema, pa.field("bad", pa.struct(list(BAD_FIELDS)))]))
        paths = [str(self.logs / self.dc / kind / n) for n in names]
        raw = self.spark.read.format("binaryFile").load(paths).select("path", "content")
        raw = raw.repartition(min(len(paths), max(1, self.s.parallelism * 2)))
        parsed = raw.mapInArrow(_parser(kind), spark_schema).persist()
        good = parsed.where(F.col("bad").isNull()).drop("bad")
        bad = parsed.where(F.col("bad").isNotNull()).select("bad.*").withColumn("kind", F.lit(kind))
        return good, bad

    def _spark_schema(self, schema: pa.Schema) -> Any:
        from pyspark.sql.pandas.types import from_arrow_schema

        return from_arrow_schema(schema)

    def run_batch(self, k: int, q_files: list[str], c_files: list[str]) -> BatchResult:
        from pyspark.sql import functions as F

        assert self.lease is not None
        lease, s = self.lease, self.s
        t_start = time.time()
        now = int(t_start * US)
        tag = self._tag(k, lease.epoch)
        stage = self.staging / tag
        token = lease.token(k)
        metrics: dict[str, Any] = {"started_at_us": now, "query_files": len(q_files), "click_files": len(c_files)}

        # 1. queries into the EventStore (staged with the batch), clicks and due retries in.
        bad_frames = []
        new_q = 0
        if q_files:
            queries, q_bad = self._parse("queries", q_files)
            bad_frames.append(q_bad)
            queries = queries.dropDuplicates(["query_id"]).withColumn(
                "bucket", F.floor(F.col("ts_us") / (s.bucket_s * US)).cast("long")
            )
            store = stage / "eventstore"
            queries.write.mode("overwrite").partitionBy("bucket").parquet(str(store))
            stored = self.spark.read.parquet(str(store))
            new_q = _parquet_rows(store)
            min_bucket = now // US // s.bucket_s - s.cache_buckets
            self._set_cache(
                self.cache.unionByName(stored).where(F.col("bucket") >= min_bucket).dropDuplicates(["query_id"])
            )
        metrics["queries"] = new_q
        click_cols = ["click_id", "click_ts_us", "query_id", "ad_id", "attempts", "first_seen_us"]
        frames = []
        if c_files:
            clicks, c_bad = self._parse("clicks", c_files)
            bad_frames.append(c_bad)
            frames.append(
                clicks.dropDuplicates(["click_id"]).select(
                    "click_id",
                    F.col("ts_us").alias("click_ts_us"),
                    "query_id",
                    "ad_id",
                    F.lit(0).alias("attempts"),
                    F.lit(now).cast("long").alias("first_seen_us"),
                )
            )
        retries = self._retries()
        waiting = None
        if retries is not None:
            frames.append(retries.where(F.col("due_us") <= now).select(*click_cols))
            waiting = retries.where(F.col("due_us") > now)
        if not frames:
            frames.append(
                self.spark.createDataFrame(
                    [],
                    "click_id string, click_ts_us long, query_id string, "
                    "ad_id string, attempts int, first_seen_us long",
                )
            )
        cand = frames[0]
        for f in frames[1:]:
            cand = cand.unionByName(f)
        cand = cand.dropDuplicates(["click_id"])

        # 2. registry pre-filter, in executors.
        looked = (
            cand.repartition(max(1, s.parallelism))
            .mapInArrow(
                _lookup_fn(self.servers),
                self._spark_schema(
                    pa.schema(
                        [
                            pa.field("click_id", pa.string()),
                            pa.field("click_ts_us", pa.int64()),
                            pa.field("query_id", pa.string()),
                            pa.field("ad_id", pa.string()),
                            pa.field("attempts", pa.int32()),
                            pa.field("first_seen_us", pa.int64()),
                            pa.field("reg_token", pa.int64()),
                            pa.field("too_old", pa.bool_()),
                        ]
                    )
                ),
            )
            .persist()
        )
        taken = (F.col("reg_token") >= 0) & (F.col("reg_token") != token.value)
        counts = looked.agg(
            F.count("*").alias("clicks"),
            F.sum(taken.cast("int")).alias("prefiltered"),
            F.sum((F.col("attempts") > 0).cast("int")).alias("retries_in"),
        ).collect()[0]
        metrics.update({name: int(counts[name] or 0) for name in ("clicks", "prefiltered", "retries_in")})
        gc_old = looked.where(~taken & F.col("too_old"))
        live = looked.where(~taken & ~F.col("too_old")).drop("reg_token", "too_old")

        # 3. EventStore lookup: the session's cache of recent buckets, then stored buckets for older queries.
        q_cols = ["query_id", F.col("ts_us").alias("query_ts_us"), "user_id", "query_text", "country", "ads"]
        hit = live.join(self.cache.select(*q_cols), "query_id", "inner")
        miss = live.join(self.cache.select("query_id"), "query_id", "left_anti").persist()
        probe = (
            live.join(self.cache.select("query_id", F.lit(1).alias("hit")), "query_id", "left")
            .agg(F.count("*").alias("lookups"), F.sum(F.coalesce("hit", F.lit(0))).alias("hits"))
            .collect()[0]
        )
        metrics["cache_lookups"], metrics["cache_hits"] = int(probe["lookups"] or 0), int(probe["hits"] or 0)
        found = hit
        miss_buckets = [
            int(r["b"])
            for r in miss.select(
                (F.element_at(F.split("query_id", "-"), -1).cast("long") / (s.bucket_s * US)).cast("long").alias("b")
            )
            .distinct()
            .collect()
        ]
        stored_all = self._store() if miss_buckets else None
        if stored_all is not None:
            stored = stored_all.where(F.col("bucket").isin(miss_buckets)).select(*q_cols).dropDuplicates(["query_id"])
            found = found.unionByName(miss.join(stored, "query_id", "inner"))
            miss = miss.join(stored.select("query_id"), "query_id", "left_anti")

        # 4. adapter, then 5. registration in executors.
        adapted = found.mapInArrow(_adapter_fn(s.adapter), self._spark_schema(ADAPTED_SCHEMA))
        filtered = adapted.where(F.col("reason").isNotNull())
        stats = self.spark.sparkContext.accumulator(np.zeros(3, dtype=np.int64), _NumpyAcc())
        reg_schema = self._spark_schema(pa.schema([*ADAPTED_SCHEMA, pa.field("outcome", pa.int8())]))
        registered = (
            adapted.where(F.col("reason").isNull())
            .coalesce(max(1, s.parallelism))
            .mapInArrow(_register_fn(self.servers, token.value, stats), reg_schema)
            .withColumn("joined_at_us", F.lit(int(time.time() * US)).cast("long"))
            .persist()
        )
        outcome_counts = {int(r["outcome"]): int(r["count"]) for r in registered.groupBy("outcome").count().collect()}
        _maybe_crash("after_register", k)

        # 6. stage output.
        joined = registered.where(F.col("outcome").isin(0, 1)).withColumn("pipeline", F.lit(self.dc))
        joined = joined.select(
            "click_id",
            "query_id",
            "ad_id",
            "click_ts_us",
            "query_ts_us",
            "joined_at_us",
            "pipeline",
            "user_id",
            "query_text",
            "country",
            "advertiser_id",
            "bid_micros",
        )
        joined.coalesce(1).write.mode("overwrite").parquet(str(stage / JOINED))
        decided = F.lit(now).cast("long").alias("decided_at_us")
        give_up = F.lit(now) - F.col("click_ts_us") > int(s.max_join_delay_s * US)
        unjoinable = (
            miss.where(give_up)
            .select("click_id", "query_id", "ad_id", "click_ts_us", decided, F.lit(REASON_TOO_LATE).alias("reason"))
            .unionByName(
                gc_old.select("click_id", "query_id", "ad_id", "click_ts_us", decided, F.lit(REASON_GC).alias("reason"))
            )
            .unionByName(
                registered.where(F.col("outcome") == 3).select(
                    "click_id", "query_id", "ad_id", "click_ts_us", decided, F.lit(REASON_GC).alias("reason")
                )
            )
            .unionByName(filtered.select("click_id", "query_id", "ad_id", "click_ts_us", decided, "reason"))
            .withColumn("pipeline", F.lit(self.dc))
            .select("click_id", "query_id", "ad_id", "click_ts_us", "decided_at_us", "pipeline", "reason")
        )
        unjoinable.coalesce(1).write.mode("overwrite").parquet(str(stage / UNJOINABLE))
        bad: Any = None
        for f in bad_frames:
            bad = f if bad is None else bad.unionByName(f)
        if bad is not None:
            bad.select(
                F.lit(self.dc).alias("pipeline"),
                "kind",
                "file",
                "line",
                "raw",
                "raw_bytes",
                "reason",
                F.lit(now).cast("long").alias("decided_at_us"),
            ).coalesce(1).write.mode("overwrite").parquet(str(stage / QUARANTINE))
        backoff = F.least(F.lit(float(s.retry_max_s)), F.lit(float(s.retry_base_s)) * F.pow(F.lit(2.0), "attempts"))
        again = miss.where(~give_up).select(
            "click_id",
            "click_ts_us",
            "query_id",
            "ad_id",
            (F.col("attempts") + 1).cast("int").alias("attempts"),
            "first_seen_us",
            (F.lit(now) + backoff * US).cast("long").alias("due_us"),
        )
        new_retries = again if waiting is None else waiting.select(*again.columns).unionByName(again)
        retry_dir = self.state_dir / "retries" / tag
        new_retries.coalesce(1).write.mode("overwrite").parquet(str(retry_dir))

        # 7. metrics, commit, publish.
        lat = joined.select(((F.col("joined_at_us") - F.col("click_ts_us")) / US).alias("l"))
        quantiles = (
            lat.approxQuantile("l", [0.5, 0.9, 0.99], 0.001)
            if outcome_counts.get(0, 0) + outcome_counts.get(1, 0)
            else [None, None, None]
        )
        st = stats.value
        metrics.update(
            {
                "joined": outcome_counts.get(0, 0) + outcome_counts.get(1, 0),
                "won_again": outcome_counts.get(1, 0),
                "wasted": outcome_counts.get(2, 0),
                "retried": _parquet_rows(retry_dir),
                "unjoinable": _parquet_rows(stage / UNJOINABLE),
                "quarantined": _parquet_rows(stage / QUARANTINE),
                "registry_txns": int(st[0]),
                "registry_rows": int(st[1]),
                "registry_retries": int(st[2]),
                "latency_p50_s": quantiles[0],
                "latency_p90_s": quantiles[1],
                "latency_p99_s": quantiles[2],
            }
        )
        metrics["duration_s"] = time.time() - t_start
        files = [("queries", n) for n in q_files] + [("clicks", n) for n in c_files]
        _maybe_crash("before_commit", k)
        self.state.commit(lease, k, files, metrics)
        _maybe_crash("after_commit", k)
        self._publish(k, lease.epoch)
        self.consumed.update(files)
        self.retry_dir = retry_dir
        self.last_batch = k
        for df in (looked, miss, registered):
            df.unpersist()
        log.info("%s batch %d: %s", self.dc, k, metrics)
        return BatchResult(k, metrics)

    def _publish(self, k: int, epoch: int) -> None:
        """Move a committed batch's staged files into place (idempotent: safe to repeat after a crash)."""
        tag = self._tag(k, epoch)
        stage = self.staging / tag
        store = stage / "eventstore"
        if store.is_dir():
            for bucket in sorted(d for d in store.iterdir() if d.name.startswith("bucket=")):
                dst = self.state_dir / "eventstore" / bucket.name
                dst.mkdir(parents=True, exist_ok=True)
                for i, part in enumerate(sorted(p for p in bucket.iterdir() if p.name.endswith(".parquet"))):
                    os.replace(part, dst / f"{tag}-{i:03d}.parquet")
        for kind in (JOINED, UNJOINABLE, QUARANTINE):
            src = stage / kind
            dst = self.root / kind
            dst.mkdir(parents=True, exist_ok=True)
            if not src.is_dir():
                continue
            for i, part in enumerate(sorted(p for p in src.iterdir() if p.name.endswith(".parquet"))):
                os.replace(part, dst / f"{self._tag(k, epoch)}-{i:03d}.parquet")
        shutil.rmtree(stage, ignore_errors=True)
        self.state.mark_published(k)


def _parquet_rows(folder: Path) -> int:
    """Rows written under a folder, from the Parquet footers: no Spark job needed to count what was written."""
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(p).metadata.num_rows for p in folder.rglob("*.parquet")) if folder.is_dir() else 0


class _NumpyAcc:
    """Spark accumulator of int64 vectors (registry stats from executors)."""

    def zero(self, value: np.ndarray) -> np.ndarray:
        return np.zeros_like(value)

    def addInPlace(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        a += b
        return a
