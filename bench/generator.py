"""`make bench-generator`: the log generator's historical throughput and the auditor's, measured in one run.

1. `photon generate` in historical mode at the default realism settings, --seconds of log time at --rate events/s
   (both replicas written; the second is hard-linked): events/s and MB/s.
2. `photon audit` over --clicks synthetic clicks (a manifest and a two-pipeline output, built column-wise):
   clicks/s, peak memory. Last line: the figures as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from photon.logs.schemas import JOINED_SCHEMA
from photon.logs.tables import append_rows, ensure_tables
from photon.tools.audit import audit
from photon.tools.generator import GeneratorSettings, generate


def synthetic_audit_input(root: Path, n: int) -> None:
    """A manifest of n clicks and an output where dc-a and dc-b joined alternate halves of them."""
    rng = np.random.default_rng(1)
    ts = 1_763_700_000_000_000 + np.arange(n, dtype=np.int64) * 37
    ids = pc.binary_join_element_wise(
        "10.9.0.1-",
        pc.cast(pa.array(rng.integers(1, 60_000, n)), pa.string()),
        "-",
        pc.cast(pa.array(ts), pa.string()),
        "",
    )
    qids = pc.binary_join_element_wise("10.1.0.1-77-", pc.cast(pa.array(ts - 5_000_000), pa.string()), "")
    (root / "_manifest").mkdir(parents=True)
    pq.write_table(
        pa.table(
            {
                "click_id": ids,
                "query_id": qids,
                "expect": pa.array(["join"] * n),
                "click_ts_us": pa.array(ts, pa.int64()),
            }
        ),
        root / "_manifest" / "clicks.parquet",
    )
    pq.write_table(
        pa.table(
            {
                "dc": pa.array([], pa.string()),
                "kind": pa.array([], pa.string()),
                "name": pa.array([], pa.string()),
                "malformed": pa.array([], pa.int64()),
            }
        ),
        root / "_manifest" / "files.parquet",
    )
    for i, dc in enumerate(("dc-a", "dc-b")):
        mask = pa.array(np.arange(n) % 2 == i)
        k = int(np.count_nonzero(np.arange(n) % 2 == i))
        sel_ts = pa.array(ts).filter(mask)
        out = root / "out" / dc
        append_rows(
            out,
            "joined",
            pa.table(
                {
                    "click_id": ids.filter(mask),
                    "query_id": qids.filter(mask),
                    "ad_id": pa.array(["a1"] * k),
                    "click_ts_us": sel_ts,
                    "query_ts_us": pc.subtract(sel_ts, 5_000_000),
                    "joined_at_us": pc.add(sel_ts, 1_500_000),
                    "pipeline": pa.array([dc] * k),
                    "user_id": pa.array(["u"] * k),
                    "query_text": pa.array(["q"] * k),
                    "country": pa.array(["DE"] * k),
                    "advertiser_id": pa.array(["x"] * k),
                    "bid_micros": pa.array(np.ones(k, np.int64)),
                },
                schema=JOINED_SCHEMA,
            ),
            1,
        )
        ensure_tables(out)  # unjoinable and quarantine: empty tables


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=200_000)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--clicks", type=int, default=10_000_000)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="photon-bench-gen-"))
    try:
        settings = GeneratorSettings(events_per_s=args.rate, rotate_s=10.0, chunk_s=10.0)
        start = 1_763_700_000_000_000
        rep = generate(settings, tmp / "logs", start_us=start, end_us=start + int(args.seconds * 1e6))
        events = rep.queries + rep.clicks
        print(
            f"generate (historical): {events:,} events ({rep.lines:,} lines, {rep.bytes / 1e6:,.0f} MB per "
            f"replica, 2 replicas) in {rep.seconds:.1f}s = {rep.events_per_s:,.0f} events/s, "
            f"{rep.bytes / 1e6 / rep.seconds:,.0f} MB/s"
        )
        shutil.rmtree(tmp / "logs")
        synthetic_audit_input(tmp / "audit", args.clicks)
        t0 = time.perf_counter()
        report = audit(tmp / "audit" / "out", manifest=tmp / "audit" / "_manifest")
        seconds = time.perf_counter() - t0
        assert report.ok and report.input_clicks == args.clicks, report.failures()
        peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
        print(
            f"audit: {args.clicks:,} clicks, 2 pipelines, in {seconds:.1f}s = {args.clicks / seconds:,.0f} "
            f"clicks/s; peak memory of this process {peak_gb:.1f} GB"
        )
        print(
            json.dumps(
                {
                    "generator_events_per_s": round(rep.events_per_s),
                    "generator_mb_per_s": round(rep.bytes / 1e6 / rep.seconds),
                    "audit_clicks": args.clicks,
                    "audit_seconds": round(seconds, 1),
                    "audit_clicks_per_s": round(args.clicks / seconds),
                    "audit_peak_rss_gb": round(peak_gb, 1),
                }
            )
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
