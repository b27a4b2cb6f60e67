"""The peer: what a Spark user would write instead of the joiner, Spark Structured Streaming's stream-stream join.

Both log folders of one data center are file sources (JSON with the joiner's own explicit schemas, only closed
``*.jsonl`` files); each side gets a watermark on its event time; clicks are deduplicated on their id with
``dropDuplicatesWithinWatermark``; the join is an inner equi-join on the query id with an event-time range (a click
from ``skew_s`` before its query to ``range_s`` after it, the contract's clock skew and the joiner's maximum join
delay); the joined row is EVENTS.md's, filled from the clicked ad as the joiner's default adapter fills it (a click
on an ad its query did not show is dropped); the sink is Parquet, the trigger ``availableNow`` and the state in
RocksDB. It has no unjoinable output, no quarantine and no exactly once across two pipelines: it is the throughput
a Spark user gets, not a replacement.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pyarrow.dataset as ds

from photon.logs.parse import CLICK_FIELDS, QUERY_FIELDS
from photon.settings import MAX_CLOCK_SKEW_S

ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
# Set on the session both sides share (a SQL setting: the joiner runs no stateful streaming query, so it is unaffected).
PEER_CONF = {"spark.sql.streaming.stateStore.providerClass": ROCKSDB_PROVIDER}


def configure(spark: Any) -> None:
    for key, value in PEER_CONF.items():
        spark.conf.set(key, value)


@dataclass
class PeerResult:
    seconds: float  # from start() until awaitTermination() returned: the query's whole processing
    batches: int
    input_rows: int  # rows the sources read (both sides; malformed lines included)
    joined_rows: int
    joined_ids: int  # distinct click ids among them
    state_rows: int  # rows in the state stores after the last batch
    durations_ms: dict[str, int] = field(default_factory=dict)  # summed over batches, by phase (Spark's progress)


def peer_query(
    spark: Any,
    dc_logs: Path,
    out: Path,
    checkpoint: Path,
    *,
    watermark_s: float = 30.0,
    range_s: float = 120.0,
    skew_s: float = MAX_CLOCK_SKEW_S,
) -> Any:
    """The streaming query's writer, not started."""
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.types import from_arrow_schema

    def source(kind: str, schema: Any) -> Any:
        return (
            spark.readStream.schema(from_arrow_schema(schema))
            .option("pathGlobFilter", "*.jsonl")  # closed files only (EVENTS.md)
            .option("recursiveFileLookup", "true")
            .json(str(dc_logs / kind))
        )

    queries = (
        source("queries", QUERY_FIELDS)
        .where("query_id IS NOT NULL AND ts_us IS NOT NULL")  # a malformed line reads as nulls (PERMISSIVE)
        .select(
            F.col("query_id").alias("q_query_id"),
            F.col("ts_us").alias("query_ts_us"),
            F.timestamp_micros("ts_us").alias("query_time"),
            "user_id",
            "query_text",
            "country",
            "ads",
        )
        .withWatermark("query_time", f"{watermark_s:g} seconds")
    )
    clicks = (
        source("clicks", CLICK_FIELDS)
        .where("click_id IS NOT NULL AND ts_us IS NOT NULL AND query_id IS NOT NULL")
        .select(
            "click_id",
            "query_id",
            F.col("ad_id").alias("click_ad_id"),
            F.col("ts_us").alias("click_ts_us"),
            F.timestamp_micros("ts_us").alias("click_time"),
        )
        .withWatermark("click_time", f"{watermark_s:g} seconds")
        .dropDuplicatesWithinWatermark(["click_id"])
    )
    joined = clicks.join(
        queries,
        F.expr(
            f"query_id = q_query_id AND click_time >= query_time - INTERVAL {skew_s:g} SECONDS"
            f" AND click_time <= query_time + INTERVAL {range_s:g} SECONDS"
        ),
        "inner",
    )
    ad = F.element_at(F.filter("ads", lambda a: a["ad_id"] == F.col("click_ad_id")), 1)
    rows = (
        joined.withColumn("ad", ad)
        .where(F.col("ad").isNotNull())
        .select(
            "click_id",
            "query_id",
            F.col("click_ad_id").alias("ad_id"),
            "click_ts_us",
            "query_ts_us",
            F.unix_micros(F.current_timestamp()).alias("joined_at_us"),
            F.lit("peer").alias("pipeline"),
            "user_id",
            "query_text",
            "country",
            F.col("ad.advertiser_id").alias("advertiser_id"),
            F.col("ad.bid_micros").alias("bid_micros"),
        )
    )
    return (
        rows.writeStream.format("parquet")
        .option("path", str(out))
        .option("checkpointLocation", str(checkpoint))
        .outputMode("append")
        .trigger(availableNow=True)
    )


def run_peer(spark: Any, dc_logs: Path, out: Path, checkpoint: Path, **options: Any) -> PeerResult:
    """Run the peer over every closed file in ``dc_logs`` (availableNow) and count what it wrote (after timing)."""
    configure(spark)
    writer = peer_query(spark, dc_logs, out, checkpoint, **options)
    t0 = time.perf_counter()
    query = writer.start()
    query.awaitTermination()
    seconds = time.perf_counter() - t0
    if query.exception() is not None:
        raise RuntimeError(f"the peer's streaming query failed: {query.exception()}")
    progress = query.recentProgress
    durations: dict[str, int] = {}
    for p in progress:
        for phase, ms in (p.durationMs or {}).items():
            durations[phase] = durations.get(phase, 0) + int(ms)
    last = progress[-1] if progress else None
    state_rows = sum(int(s.numRowsTotal) for s in last.stateOperators) if last is not None else 0
    ids = ds.dataset(str(out), format="parquet").to_table(columns=["click_id"]).column("click_id")
    return PeerResult(
        seconds=seconds,
        batches=len(progress),
        input_rows=sum(int(p.numInputRows) for p in progress),
        joined_rows=len(ids),
        joined_ids=len(pc.unique(ids)),
        state_rows=state_rows,
        durations_ms=durations,
    )
