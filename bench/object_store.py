"""`make bench-object-store`: the joiner reading its logs from a bucket against reading them from a folder, side by
side in one run, on a local S3 server (SeaweedFS, as `photon storage up` runs it) on loopback.

1. Throughput: the same logs (the generator's bytes, key for key) joined `--until-caught-up` from the folder and
   from the bucket, ``--repeat`` times each, alternating which goes first, each on a fresh registry and output:
   events/s (median, spread) and the ratio bucket/folder (the issue's goal: at least 0.7), on two workloads (the
   bench's default, and many small files: the per-object request cost), and the requests a batch makes on the
   bucket by type (LIST, GET, PUT, COPY, DELETE, ...: as the S3 server counted them, deltalake's included).
2. Live: both pipelines over live logs written at ``--live-rate`` events/s per replica into the folder, then into
   the bucket: click latency p50/p90 from the audit (goal: the bucket's p90 within 1 s of the folder's).
3. Listing: one trigger's ``Discovery.new_files`` from a caught-up pipeline's mark, with 1,000 and then
   ``--objects`` objects in older partitions of the bucket (goal: flat), median of 20.

The bucket's side keeps its output tables and its state (stages, EventStore, retry sets) in the bucket too: nothing
of it in a folder. Last line: the figures as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.pipeline import live
from bench.side_by_side import (
    DC,
    MASTER,
    SHUFFLE_PARTITIONS,
    _registry,
    default_workload,
    run_joiner,
    spread,
    warm_up,
)
from photon.joiner.common import JoinSettings
from photon.joiner.discovery import Discovery
from photon.logs.layout import partition_of
from photon.pg import EmbeddedPostgres, drop_database
from photon.registry.clock import ServerClock
from photon.spark_session import get_spark
from photon.storage import S3Store, open_store
from photon.tools import storage_server
from photon.tools.generator import GeneratorSettings, generate

US = 1_000_000


def throughput(spark: Any, pg: EmbeddedPostgres, server: storage_server.Server, root: Path, bucket: str, name: str,
               s: GeneratorSettings, seconds: float, repeat: int) -> dict[str, Any]:  # fmt: skip
    start = (int(time.time()) - 3_600) * US
    start -= start % int(s.rotate_s * US)
    folder, url = root / f"{name}-logs", f"s3://{bucket}/{name}"
    rep = generate(s, folder, start_us=start, end_us=start + int(seconds * US))
    generate(s, url, start_us=start, end_us=start + int(seconds * US), manifest=root / f"{name}-manifest")
    events = rep.queries + rep.clicks
    files = sum(1 for _ in (folder / DC).rglob("*.jsonl"))
    runs: dict[str, list[float]] = {"folder": [], "bucket": []}
    joined: dict[str, set[int]] = {"folder": set(), "bucket": set()}
    per_batch: list[dict[str, float]] = []  # the bucket's runs: requests the server answered, by type, per batch
    for r in range(repeat):
        for where in ("folder", "bucket") if r % 2 == 0 else ("bucket", "folder"):
            if where == "bucket" and r:
                # Under a new prefix each run, as a catch-up's objects are new to every worker: the Python workers
                # keep the query objects they read, by key (a folder's files are in the page cache every run).
                url = _moved(url, f"s3://{bucket}/{name}-{r}")
            db = f"bench_os_{name}_{where}_{r}"
            # Each side's output and state where its logs are: a folder, or the bucket
            out = root / f"{name}-out-{r}" if where == "folder" else f"s3://{bucket}/{name}-out-{r}"
            before = storage_server.requests(server) or {}
            x = run_joiner(spark, _registry(pg, db), folder if where == "folder" else url, out)
            if where == "bucket":
                after = storage_server.requests(server) or {}
                per_batch.append({k: (v["count"] - before.get(k, {}).get("count", 0)) / x["batches"]
                                  for k, v in after.items()})  # fmt: skip
            runs[where].append(x["seconds"])
            joined[where].add(x["joined"])
            open_store(out).remove_all("") if where == "bucket" else shutil.rmtree(out, ignore_errors=True)
            drop_database(pg.admin_dsn, db)  # and the Python workers' connections to it (200 at most)
    ratios = [f / b for f, b in zip(runs["folder"], runs["bucket"], strict=True)]
    result = {
        "workload": name,
        "events": events,
        "files": files,
        "folder_events_per_s": round(events / statistics.median(runs["folder"])),
        "bucket_events_per_s": round(events / statistics.median(runs["bucket"])),
        "ratio": round(statistics.median(ratios), 3),
        "ratio_min": round(min(ratios), 3),
        "same_output": joined["folder"] == joined["bucket"] and len(joined["folder"]) == 1,
        "requests_per_batch": {
            k: round(statistics.median(r.get(k, 0) for r in per_batch), 1)
            for k in sorted({k for r in per_batch for k in r})
        },
    }
    requests = ", ".join(f"{k} {v:g}" for k, v in result["requests_per_batch"].items() if v)
    print(
        f"throughput, {name}: {events:,} events in {files} files; seconds per run: folder {spread(runs['folder'])}, "
        f"bucket {spread(runs['bucket'])}; {result['folder_events_per_s']:,} vs {result['bucket_events_per_s']:,} "
        f"events/s, ratio bucket/folder {result['ratio']} (min {result['ratio_min']}); joined the same: "
        f"{result['same_output']}; requests per batch on the bucket (median of runs): {requests}"
    )
    return result


def _moved(src: str, dst: str) -> str:
    """Every object under ``src`` moved under ``dst``; ``dst``. Got and put again, not copied by the server: SeaweedFS
    stores a server-side copy of a log gzipped (it takes a copied chunk for text), and inflates it on every read."""
    source, target = open_store(src), open_store(dst)
    for e in source.listing(""):
        target.put(e.key, source.get(e.key))
        source.delete(e.key)
    return dst


def listing(bucket: str, sizes: list[int]) -> dict[str, Any]:
    """A caught-up pipeline's trigger over a bucket holding ``n`` older objects: the listing from its mark."""
    store = S3Store(f"s3://{bucket}/listing")
    now = int(time.time() * US)
    mark = partition_of(now - 90 * US)
    put = 0
    found: dict[str, Any] = {}
    for n in sizes:
        while put < n:  # old partitions, a day back and more: 100 objects a minute
            store.put(f"{DC}/clicks/{partition_of(now - 86_400 * US - put * 600_000)}/f{put}.jsonl", b"{}\n")
            put += 1
        d = Discovery(store, DC, DC, JoinSettings(parallelism=1), ServerClock.assumed())
        d.marks = {"queries": mark, "clicks": mark}
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            d.new_files()
            times.append(time.perf_counter() - t0)
        found[str(n)] = round(statistics.median(times) * 1000, 2)
        print(f"listing: one trigger's new_files from a recent mark over {n:,} older objects: "
              f"{spread([t * 1000 for t in times])} ms")  # fmt: skip
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=50_000, help="throughput: events/s of log time")
    ap.add_argument("--seconds", type=float, default=20, help="throughput: seconds of log time")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each side, alternating; the median")
    ap.add_argument("--live-rate", type=float, default=20_000, help="live: events/s per replica")
    ap.add_argument("--live-seconds", type=float, default=30)
    ap.add_argument("--objects", type=int, default=20_000, help="listing: the larger bucket's older objects")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="photon-bench-os-"))
    pg = EmbeddedPostgres(tmp / "pg", cleanup_mode="delete")
    pg.start()
    server = storage_server.start(tmp / "s3")
    try:
        os.environ.update(server.env())  # before Spark starts: its Python workers read the store with them
        bucket = f"bench-{secrets.token_hex(4)}"
        storage_server.create_bucket(server, bucket)
        spark = get_spark("photon-bench-object-store", master=MASTER, shuffle_partitions=SHUFFLE_PARTITIONS)
        warm_up(spark, pg, tmp / "warm-up")
        default = default_workload(args.rate, args.seconds)
        small = GeneratorSettings(events_per_s=args.rate / 5, clicks_per_query=0.1, dcs=(DC,), rotate_s=1.0)
        results = [
            throughput(spark, pg, server, tmp, bucket, "default", default.settings, args.seconds, args.repeat),
            throughput(spark, pg, server, tmp, bucket, "small_files", small, args.seconds, args.repeat),
        ]
        lives = {}
        for where in ("folder", "bucket"):
            url = None if where == "folder" else f"s3://{bucket}/live"
            out = None if where == "folder" else f"s3://{bucket}/live-out"
            run = live(pg, spark, tmp / f"live-{where}", args.live_rate, args.live_seconds, "joiner", url, out)
            lives[where] = run
            print(f"live, {args.live_rate:,.0f} events/s per replica, logs in a {where}: audit "
                  f"{'PASS' if run['ok'] else 'FAIL'}; click latency p50 {run['p50']}s p90 {run['p90']}s; "
                  f"batch p50 {run['batch_p50']:.2f}s ({run['batches']} batches)")  # fmt: skip
        spark.stop()  # the listing runs in the driver alone
        listed = listing(bucket, [1_000, args.objects])
        summary = {
            "ratio_default": results[0]["ratio"],
            "ratio_small_files": results[1]["ratio"],
            "live_p90_folder_s": lives["folder"]["p90"],
            "live_p90_bucket_s": lives["bucket"]["p90"],
            "listing_ms": listed,
            "throughput": results,
        }
        print(json.dumps(summary))
    finally:
        storage_server.stop(tmp / "s3")
        pg.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
