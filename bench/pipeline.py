"""`make bench-pipeline`: the joiner against its peer side by side, and against Spark's own ceiling, in one run.

1. Side by side, on four workloads of one data center (--workloads): the project's default generator workload
   (--rate, --seconds; 10 queries per click); long non-ASCII query texts in large files (--long-rate,
   --long-seconds; 20-60 words per query, 20,000 lines per query file); `nested_ads` (1-4 ads per query in the
   nested array, short texts, 20,000 lines per query file, 3% duplicate and 0.1% malformed lines; --nested-rate,
   --nested-seconds); `shuffled_clicks` (the same, its click lines then shuffled over the whole time range into
   files of 5,000). On each: the joiner until caught up and the peer a Spark user would write instead
   (bench/peer.py: Structured Streaming's stream-stream join, watermarks on both sides, dropDuplicatesWithinWatermark
   on click ids, an event-time range condition, a Parquet sink, availableNow, RocksDB state), in the same local[2]
   session, each timed without the session's start (both warmed up first), --repeat times each (default 5),
   alternating which goes first; the median of each side and the median of the per-run ratios, with their spread
   (min-max); both joined counts. Then each side --whole-process times (default 3) as a process of its own,
   alternating: the joiner as a backfill task runs it (`photon join --until-caught-up --drain`, its own Python and
   Spark start), the peer likewise (--no-whole-process skips it). Where the joiner's time goes, per stage
   (bench/stages.py; --no-stages skips it).
2. The ceiling: Spark reading the default workload's JSON logs and writing Parquet, nothing else (schema inferred,
   and given; the faster counts), against the joiner's rate on the same logs.
3. Live, at rising rates (--live-rates, events/s per replica, for --live-seconds each; --no-live skips it): the
   generator writing both replicas while both joiners run in one Spark session; click latency percentiles from the
   audit, batch durations from the joiners. First with files shipped fast and clocks in step (the joiner's own
   latency), then once with the generator's realistic defaults.
Every run of the joiner in this process also times each batch's table commit (photon.logs.tables.publish_batch: one
Delta commit per table that got rows): p50 and p99 per workload and per live run.
Last line: the figures as one JSON object (`events_per_s`, `peer_events_per_s`, `ratio_to_peer` of the default
workload at the top, with its `table_commit_ms_p50` and `_p99`, and the top live rate's `live_table_commit_ms_p50`
and `_p99`; `ratio_to_peer_<workload>` and `ratio_whole_process_<workload>`, medians, for each workload; every
workload's figures, runs and spreads under `workloads`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from pyspark.sql.pandas.types import from_arrow_schema

from bench.side_by_side import (
    default_workload,
    long_non_ascii_workload,
    nested_ads_workload,
    run_workload,
    shuffled_clicks_workload,
    warm_up,
)
from bench.stages import commit_ms, commit_text, timed_table_commits
from photon.joiner.common import BatchResult, JoinSettings
from photon.joiner.lease import Joiner
from photon.logs.parse import CLICK_FIELDS, QUERY_FIELDS
from photon.pg import EmbeddedPostgres, create_database
from photon.registry.admin import init_registry
from photon.spark_session import get_spark
from photon.storage import open_store
from photon.tools.audit import audit
from photon.tools.generator import GeneratorSettings, generate

US = 1_000_000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=50_000, help="default workload: events/s of log time")
    ap.add_argument("--seconds", type=float, default=20, help="default workload: seconds of log time")
    ap.add_argument("--long-rate", type=float, default=17_600, help="long non-ASCII workload: events/s of log time")
    ap.add_argument("--long-seconds", type=float, default=60, help="long non-ASCII workload: seconds of log time")
    ap.add_argument("--nested-rate", type=float, default=50_000, help="nested_ads, shuffled_clicks: events/s")
    ap.add_argument("--nested-seconds", type=float, default=20, help="nested_ads, shuffled_clicks: seconds")
    every = ["default", "long_non_ascii", "nested_ads", "shuffled_clicks"]
    ap.add_argument("--workloads", nargs="+", choices=every, default=every)
    ap.add_argument("--repeat", type=int, default=5, help="side by side: runs of each side, alternating; the median")
    ap.add_argument(
        "--whole-process", type=int, default=3, help="runs of each side as a process of its own, alternating"
    )
    ap.add_argument("--no-whole-process", action="store_true", help="skip each side's run as a process of its own")
    ap.add_argument(
        "--no-connect", action="store_true", help="whole processes: skip the joiner on a warm Spark Connect server"
    )
    ap.add_argument("--no-stages", action="store_true", help="skip the joiner's per-stage breakdown")
    ap.add_argument("--no-live", action="store_true", help="skip the live runs")
    ap.add_argument("--live-rates", type=float, nargs="+", default=[1_000, 5_000, 20_000])
    ap.add_argument("--live-seconds", type=float, default=30)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="photon-bench-pipe-"))
    pg = EmbeddedPostgres(tmp / "pg", cleanup_mode="delete")
    pg.start()
    stack = contextlib.ExitStack()
    try:
        spark = get_spark("photon-bench", master="local[2]", shuffle_partitions=4)
        warm_up(spark, pg, tmp / "warm-up")
        workloads = {
            "default": default_workload(args.rate, args.seconds),
            "long_non_ascii": long_non_ascii_workload(args.long_rate, args.long_seconds),
            "nested_ads": nested_ads_workload(args.nested_rate, args.nested_seconds),
            "shuffled_clicks": shuffled_clicks_workload(args.nested_rate, args.nested_seconds),
        }
        side: dict[str, dict[str, Any]] = {}
        ceiling = None
        connect_home = None
        if not args.no_whole_process and not args.no_connect:
            connect_home = tmp / "connect-home"
            server = stack.enter_context(connect_server(connect_home))
            print(f"Spark Connect server for the whole-process runs: {server}")
        for name in args.workloads:
            root = tmp / f"side-{name}"
            side[name] = run_workload(
                spark,
                pg,
                root,
                workloads[name],
                whole_process=0 if args.no_whole_process else args.whole_process,
                connect_home=connect_home,
                stages=not args.no_stages,
                keep_logs=name == "default",
                repeat=args.repeat,
            )
            if name == "default":
                ceiling = measure_ceiling(spark, root / "logs", tmp / "ceiling", side[name]["events"])
                print(
                    f"   the joiner at {side[name]['events_per_s'] / ceiling:.2f} of the ceiling (Spark reading the "
                    "same JSON logs and writing Parquet, nothing else)"
                )
                shutil.rmtree(root, ignore_errors=True)

        runs = []
        for profile in () if args.no_live else ("joiner", "realistic"):
            for rate in args.live_rates if profile == "joiner" else args.live_rates[:1]:
                run = live(pg, spark, tmp / f"live-{profile}-{rate:g}", rate, args.live_seconds, profile)
                runs.append(run)
                print(
                    f"live, {profile} workload, {rate:,.0f} events/s per replica, two pipelines: audit "
                    f"{'PASS' if run['ok'] else 'FAIL'}; click latency p50 {run['p50']}s p90 {run['p90']}s "
                    f"p99 {run['p99']}s; batch duration p50 {run['batch_p50']:.2f}s p90 {run['batch_p90']:.2f}s "
                    f"({run['batches']} batches); {commit_text(run)}"
                )
        first = side.get("default") or next(iter(side.values()))
        summary: dict[str, Any] = {
            "events_per_s": first["events_per_s"],
            "peer_events_per_s": first["peer_events_per_s"],
            "ratio_to_peer": first["ratio_to_peer"],
            # The table commit's cost per batch (photon.logs.tables.publish_batch), side by side: few large batches.
            "table_commit_ms_p50": first["table_commit_ms_p50"],
            "table_commit_ms_p99": first["table_commit_ms_p99"],
        }
        for name, r in side.items():
            summary[f"ratio_to_peer_{name}"] = r["ratio_to_peer"]
            if "ratio_whole_process" in r:
                summary[f"ratio_whole_process_{name}"] = r["ratio_whole_process"]
                summary[f"ratio_whole_process_cold_{name}"] = r["ratio_whole_process_cold"]
        if ceiling is not None:
            summary["ceiling_events_per_s"] = round(ceiling)
            summary["ratio_to_ceiling"] = round(side["default"]["events_per_s"] / ceiling, 3)
        if runs:
            top = [r for r in runs if r["profile"] == "joiner"][-1]
            real = next(r for r in runs if r["profile"] == "realistic")
            summary.update(
                {
                    "p50_s": top["p50"],
                    "p90_s": top["p90"],
                    "p99_s": top["p99"],
                    "live_events_per_s": top["rate"],
                    # Live: many small batches, as in production.
                    "live_table_commit_ms_p50": top["table_commit_ms_p50"],
                    "live_table_commit_ms_p99": top["table_commit_ms_p99"],
                    "realistic_p50_s": real["p50"],
                    "realistic_p90_s": real["p90"],
                    "realistic_p99_s": real["p99"],
                }
            )
        summary["workloads"] = side
        print(json.dumps(summary))
    finally:
        stack.close()
        pg.stop()
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def connect_server(home: Path) -> Iterator[str]:
    """``photon spark-connect`` (local[2], as the joiner's own runs) under ``home`` until the block ends; yields its
    ready line."""
    log = home.parent / "spark-connect.log"
    home.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "photon", "spark-connect", "--port", str(port), "--master", "local[2]"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=os.environ | {"PHOTON_HOME": str(home)}, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while "warm, up in" not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"photon spark-connect did not start: {log.read_text()[-2000:]}")
            time.sleep(0.5)
        yield log.read_text().strip().splitlines()[-1]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def measure_ceiling(spark: Any, logs: Path, out: Path, events: int) -> float:
    """Spark reading the same JSON logs and writing Parquet, nothing else: schema inferred, and given; the faster."""
    rates = {}
    for how in ("inferred", "explicit"):
        t0 = time.perf_counter()
        for kind, schema in (("queries", QUERY_FIELDS), ("clicks", CLICK_FIELDS)):
            reader = spark.read if how == "inferred" else spark.read.schema(from_arrow_schema(schema))
            reader = reader.option("pathGlobFilter", "*.jsonl").option("recursiveFileLookup", "true")
            reader.json(str(logs / "dc-a" / kind)).write.mode("overwrite").parquet(str(out / kind))
        rates[how] = events / (time.perf_counter() - t0)
        print(f"   ceiling (Spark JSON -> Parquet, {how} schema): {rates[how]:,.0f} events/s")
    shutil.rmtree(out, ignore_errors=True)
    return max(rates.values())


def live(
    pg: EmbeddedPostgres,
    spark: Any,
    root: Path,
    rate: float,
    seconds: float,
    profile: str,
    logs_url: str | None = None,
    out_url: str | None = None,
) -> dict[str, Any]:
    """Both pipelines joining live logs while the generator writes them (into ``root/logs``, or into the bucket
    ``logs_url``), their output and state into ``root/out`` (or ``out_url``); latency from the audit, batch
    durations from the joiners. Profile ``joiner`` ships files fast and keeps clocks in step, so latency is the
    joiner's own; ``realistic`` keeps the generator's defaults (query files shipped with a 2 s median lag, 1.5x
    slower to dc-b, server clocks up to 5 s apart, which the latency measured from the click's own timestamp
    includes)."""
    servers = {"main": create_database(pg.admin_dsn, f"bench_{profile}_{int(rate)}_{'s3' if logs_url else 'fs'}")}
    init_registry(servers)
    out: Path | str = out_url or root / "out"
    manifest = root / "logs" / "_manifest"
    logs: Path | str = logs_url or root / "logs"
    kw: dict[str, Any] = {
        "events_per_s": rate,
        "clicks_per_query": 0.1,
        "max_join_delay_s": 30,
        "late_query_file_fraction": 0.0,  # minutes late by design: they measure the retry path, not latency
        "late_click_fraction": 0.0,
    }
    if profile == "joiner":
        kw.update(max_clock_skew_s=0.0, query_lag_median_s=0.5, dc_lag_factor={})
    settings = GeneratorSettings(**kw)
    now = int(time.time() * US)
    done = threading.Event()
    durations: list[float] = []

    def gen() -> None:
        generate(settings, logs, start_us=now, end_us=now + int(seconds * US), live=True, manifest=manifest)
        done.set()

    def join(dc: str) -> None:
        j = Joiner(dc, logs, out, servers, spark, JoinSettings(max_join_delay_s=30))

        def record(r: BatchResult) -> None:
            durations.append(r.metrics["duration_s"])

        while not done.is_set():
            j.run(run_for_s=5, on_batch=record)
        j.run(until_caught_up=True, drain=True, on_batch=record)

    threads = [threading.Thread(target=gen)] + [threading.Thread(target=join, args=(d,)) for d in settings.dcs]
    with timed_table_commits() as commits:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    report = audit(open_store(out), manifest=manifest)
    shutil.rmtree(root, ignore_errors=True)
    if out_url:
        open_store(out_url).remove_all("")
    q = np.quantile(durations, [0.5, 0.9]) if durations else [0.0, 0.0]
    return {
        "profile": profile,
        "rate": rate,
        "ok": report.ok,
        **{k: report.latency_s.get(k) for k in ("p50", "p90", "p99")},
        "batch_p50": float(q[0]),
        "batch_p90": float(q[1]),
        "batches": len(durations),
        **commit_ms(commits),
    }


if __name__ == "__main__":
    main()
