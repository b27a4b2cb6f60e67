"""`make bench-pipeline`: the joiner measured against Spark's own ceiling, in one run.

1. A historical workload (10 queries per click) for dc-a.
2. The ceiling: Spark reading the same JSON logs and writing Parquet, nothing else.
3. The joiner over the same logs until caught up: events/s (queries + clicks) and its ratio to the ceiling.
4. Live: the generator at --live-rate events/s for --live-seconds with both joiners running; click latency
   percentiles from the audit.
Last line: the figures as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path

from photon.audit import audit
from photon.generator import GeneratorSettings, generate
from photon.joiner import Joiner, JoinSettings
from photon.pg import EmbeddedPostgres, create_database
from photon.registry_admin import init_registry
from photon.spark_session import get_spark

US = 1_000_000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=20_000, help="historical events/s of log time")
    ap.add_argument("--seconds", type=float, default=60, help="historical seconds of log time")
    ap.add_argument("--live-rate", type=float, default=1_000)
    ap.add_argument("--live-seconds", type=float, default=45)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="photon-bench-pipe-"))
    pg = EmbeddedPostgres(tmp / "pg", cleanup_mode="delete")
    pg.start()
    try:
        spark = get_spark("photon-bench", master="local[2]", shuffle_partitions=4)
        logs = tmp / "logs"
        start = (int(time.time()) - 3_600) * US
        settings = GeneratorSettings(
            events_per_s=args.rate, clicks_per_query=0.1, dcs=("dc-a",), rotate_s=10.0, chunk_s=10.0
        )
        rep = generate(settings, logs, start_us=start, end_us=start + int(args.seconds * US))
        events = rep.queries + rep.clicks
        print(f"workload: {rep.queries:,} queries + {rep.clicks:,} clicks = {events:,} events, {rep.files} files")

        t0 = time.perf_counter()
        for kind in ("queries", "clicks"):
            df = spark.read.json(str(logs / "dc-a" / kind))
            df.write.mode("overwrite").parquet(str(tmp / "ceiling" / kind))
        ceiling = events / (time.perf_counter() - t0)
        print(f"ceiling (Spark JSON -> Parquet): {ceiling:,.0f} events/s")

        servers = {"main": create_database(pg.admin_dsn, "bench")}
        init_registry(servers)
        joiner = Joiner("dc-a", logs, tmp / "out", servers, spark, JoinSettings(trigger_interval_s=0.0))
        t0 = time.perf_counter()
        batches = joiner.run(until_caught_up=True, drain=True)
        joined_rate = events / (time.perf_counter() - t0)
        print(
            f"joiner (historical, until caught up): {joined_rate:,.0f} events/s in {len(batches)} batch(es); "
            f"{joined_rate / ceiling:.2f} of the ceiling"
        )

        live_logs, live_out = tmp / "live-logs", tmp / "live-out"
        live_servers = {"main": create_database(pg.admin_dsn, "bench_live")}
        init_registry(live_servers)
        now = int(time.time() * US)
        live = GeneratorSettings(
            events_per_s=args.live_rate,
            clicks_per_query=0.1,
            max_join_delay_s=30,
            late_query_file_fraction=0.0,
            late_click_fraction=0.0,
        )
        done = threading.Event()

        def gen() -> None:
            generate(live, live_logs, start_us=now, end_us=now + int(args.live_seconds * US), live=True)
            done.set()

        def join(dc: str) -> None:
            j = Joiner(dc, live_logs, live_out, live_servers, spark, JoinSettings(max_join_delay_s=30))
            while not done.is_set():
                j.run(run_for_s=5)
            j.run(until_caught_up=True, drain=True)

        threads = [threading.Thread(target=gen)] + [threading.Thread(target=join, args=(d,)) for d in live.dcs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        report = audit(live_out, manifest=live_logs / "_manifest")
        lat = report.latency_s
        print(
            f"live, {args.live_rate:,.0f} events/s, two pipelines: audit {'PASS' if report.ok else 'FAIL'}, "
            f"click latency p50 {lat['p50']}s p90 {lat['p90']}s p99 {lat['p99']}s"
        )
        print(
            json.dumps(
                {
                    "events_per_s": round(joined_rate),
                    "p50_s": lat["p50"],
                    "p90_s": lat["p90"],
                    "p99_s": lat["p99"],
                    "ceiling_events_per_s": round(ceiling),
                    "ratio_to_ceiling": round(joined_rate / ceiling, 3),
                }
            )
        )
    finally:
        pg.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
