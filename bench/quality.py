"""`make bench-quality`: one data-quality check (`photon.tools.quality.check_quality`, the task of
`photon_data_quality`) timed by phase, on synthetic hours, idle and under load.

For each size (--clicks: clicks in the hour) the generator (`photon.tools.generator`) writes one hour of logs in two
replicas at the default realism settings (files rotated every second, arrival partitions, duplicates, malformed lines),
and its ground truth becomes the two pipelines' output tables as the joiners write them (Delta tables partitioned by
hour, `photon.logs.tables`): dc-a joins the even clicks that must join, dc-b the odd ones, both give up the rest;
every malformed line is quarantined by both. Two output shapes:
- `batches`: one data file per 1-s micro-batch, pipeline, kind and hour (by the row's joined_at or decided_at), as a
  live joiner's tasks write them (`tables.stage_rows`): up to 7,200 joined files for an hour of two pipelines. They are
  committed by `tables.publish_batch` --commit-every batches at a time (default 60: one commit a minute, 60 a table;
  a live joiner commits each batch, 3,600 an hour, which delta-rs checkpoints every 100: a reader replays at most 99
  commits either way, and the data files read are the same);
- `one-file`: one batch per pipeline, a data file per kind and hour (a backfill's few large batches).
Two site histories: `fresh` (an empty `_quality`), and `history`: --history earlier hours already checked (three
validation results each, with their pages, copied from a real run under other run ids: what a month of hourly checks
leaves in the Data Docs site).
Each case runs --runs times after one untimed warm-up, idle and with --load N busy processes (pure-Python spinning
loops this bench starts and stops), and prints each phase's median, min and max: input (listing and parsing the hour's
click files), output (loading the tables' snapshots, the click_id scan), frames (joined, unjoinable, quarantine reads
and pandas), gx_setup (context, suites, definitions, checkpoints), validation (the three checkpoint runs), data_docs
(pages and index), localize (localize_data_docs), total. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from photon.logs import tables
from photon.logs.schemas import JOINED_SCHEMA, QUARANTINE_SCHEMA, UNJOINABLE_SCHEMA
from photon.tools.generator import GeneratorSettings, generate
from photon.tools.quality import QUALITY_DIR, QualitySettings, check_quality

US = 1_000_000
HOUR = 3600 * US
PHASES = ("input", "output", "frames", "gx_setup", "validation", "data_docs", "localize")
# Clicks per event at the default settings (0.1 clicks per query): events/s for a wanted number of clicks per hour.
CLICKS_PER_EVENT = 0.1 / 1.1


def _spin() -> None:
    while True:
        pass


def synthetic_output(logs: Path, out: Path, shape: str, start_us: int, commit_every: int) -> dict[str, int]:
    """The two pipelines' output tables for the generator's ground truth, in ``shape`` (module docstring)."""
    m = pq.read_table(logs / "_manifest" / "clicks.parquet")
    files = pq.read_table(logs / "_manifest" / "files.parquet")
    rng = np.random.default_rng(7)
    must = pc.is_in(m["expect"], value_set=pa.array(["join", "either"]))
    joined, gave_up = m.filter(must), m.filter(pc.invert(must))
    counts = {"joined_rows": joined.num_rows}
    for i, dc in enumerate(("dc-a", "dc-b")):
        root = out / dc
        tables.ensure_tables(root)
        (root / "_pipeline.json").write_text(json.dumps({"pipeline": dc, "dc": dc}))
        mine = joined.filter(pa.array(np.arange(joined.num_rows) % 2 == i))
        k = mine.num_rows
        # A click joins within a few seconds of its own timestamp: file lag, the batch, the commit.
        joined_at = pc.add(mine["click_ts_us"], pa.array(rng.lognormal(np.log(2e6), 0.4, k).astype(np.int64)))
        jt = pa.table(
            {
                "click_id": mine["click_id"],
                "query_id": mine["query_id"],
                "ad_id": mine["ad_id"],
                "click_ts_us": mine["click_ts_us"],
                "query_ts_us": mine["query_ts_us"],
                "joined_at_us": joined_at,
                "pipeline": pa.array([dc] * k),
                "user_id": pa.array([f"u{j % 997}" for j in range(k)]),
                "query_text": pa.array(["cheap flights"] * k),
                "country": pa.array(["DE"] * k),
                "advertiser_id": pa.array(["adv9"] * k),
                "bid_micros": pa.array(np.full(k, 120_000, np.int64)),
            },
            schema=JOINED_SCHEMA,
        )
        u = gave_up.num_rows
        decided = pc.add(gave_up["click_ts_us"], 121 * US)
        ut = pa.table(
            {
                "click_id": gave_up["click_id"],
                "query_id": gave_up["query_id"],
                "ad_id": gave_up["ad_id"],
                "click_ts_us": gave_up["click_ts_us"],
                "decided_at_us": decided,
                "pipeline": pa.array([dc] * u),
                "reason": pa.array(["query not found within the maximum join delay"] * u),
            },
            schema=UNJOINABLE_SCHEMA,
        )
        f = files.filter(pc.and_(pc.equal(files["dc"], dc), pc.greater(files["malformed"], 0))).to_pylist()
        rows = [(r["kind"], r["name"], j + 1, r["arrival_us"] + US) for r in f for j in range(r["malformed"])]
        qt = pa.table(
            {
                "pipeline": pa.array([dc] * len(rows)),
                "kind": pa.array([r[0] for r in rows], pa.string()),
                "file": pa.array([r[1] for r in rows], pa.string()),
                "line": pa.array([r[2] for r in rows], pa.int64()),
                "raw": pa.array([b'{"click_id": '] * len(rows), pa.binary()),
                "raw_bytes": pa.array([13] * len(rows), pa.int64()),
                "reason": pa.array(["not valid JSON"] * len(rows), pa.string()),
                "decided_at_us": pa.array([r[3] for r in rows], pa.int64()),
            },
            schema=QUARANTINE_SCHEMA,
        )
        kinds = (
            ("joined", jt, "joined_at_us"),
            ("unjoinable", ut, "decided_at_us"),
            ("quarantine", qt, "decided_at_us"),
        )
        if shape == "one-file":
            stage = f"_staging/{dc}"
            for kind, table, _ in kinds:
                tables.stage_rows(root, kind, stage, "b0000000001-e1-p0", table, 1)
            tables.publish_batch(root, dc, 1, stage)
            shutil.rmtree(root / stage)
            continue
        # The 1-s micro-batch each row was decided in (batch 10^6 + k: second k of the hour; late clicks were decided
        # before it began): one data file per batch, kind and hour as the tasks write them.
        by_batch: dict[int, list[tuple[str, pa.Table]]] = {}
        for kind, table, when in kinds:
            batch = pc.divide(pc.subtract(table[when], start_us), US).to_numpy() + 10**6
            order = np.argsort(batch, kind="stable")
            table, batch = table.take(pa.array(order)), batch[order]
            edges = np.flatnonzero(np.diff(batch)) + 1
            for a, b in zip(np.r_[0, edges], np.r_[edges, len(batch)], strict=True):
                if b > a:
                    by_batch.setdefault(int(batch[a]), []).append((kind, table.slice(a, b - a)))
        group: list[int] = []
        stage = f"_staging/{dc}"
        last = max(by_batch)
        for k in sorted(by_batch):
            for kind, part in by_batch[k]:
                tables.stage_rows(root, kind, stage, f"b{k:010d}-e1-p0", part, k)
            group.append(k)
            if len(group) == commit_every or k == last:
                tables.publish_batch(root, dc, k, stage)
                shutil.rmtree(root / stage)
                group.clear()
    counts["joined_files"] = sum(t.table().get_add_actions().num_rows for t in tables.tables(out, "joined"))
    return counts


def copy_history(root: Path, hours: int) -> int:
    """``hours`` earlier checked hours in the GX project and its site: the three validation results (JSON) and pages
    (HTML) of the run already there, copied under the run ids of the hours before it. Returns results added."""
    added = 0
    for base in (root / "gx" / "uncommitted" / "validations", root / "data_docs" / "validations"):
        for suite in [p for p in base.iterdir() if p.is_dir()] if base.is_dir() else []:
            runs = [p for p in suite.iterdir() if p.is_dir()]
            if not runs:
                continue
            run = runs[0]  # interval <start>+3600s / <run time> / <batch id>.(json|html)
            run_time = next(p for p in run.iterdir() if p.is_dir())
            for h in range(1, hours + 1):
                name, stamp = _shift(run.name, run_time.name, h)
                dst = suite / name / stamp
                shutil.copytree(run_time, dst)
                added += base.name == "validations" and base.parent.name == "uncommitted"
    return added


def _shift(run_name: str, run_time: str, hours_back: int) -> tuple[str, str]:
    """The run name (``interval %Y-%m-%dT%H:%M:%S+3600s``) and run-time folder (``%Y%m%dT%H%M%S.%fZ``) of the hour
    ``hours_back`` before."""
    from datetime import datetime, timedelta

    start = datetime.strptime(run_name.split(" ")[1].split("+")[0], "%Y-%m-%dT%H:%M:%S")
    t = datetime.strptime(run_time, "%Y%m%dT%H%M%S.%fZ")
    d = timedelta(hours=hours_back)
    return f"interval {start - d:%Y-%m-%dT%H:%M:%S}+3600s", f"{t - d:%Y%m%dT%H%M%S.%f}Z"


def time_check(out: Path, logs: Path, start: int, runs: int, settings: QualitySettings) -> dict[str, Any]:
    samples: dict[str, list[float]] = {p: [] for p in (*PHASES, "total")}
    joined = 0
    for _ in range(runs):
        t0 = time.perf_counter()
        r = check_quality(out, logs, start, start + HOUR, settings)
        total = time.perf_counter() - t0
        if not r.success:
            raise SystemExit(f"the synthetic hour failed its check: {r.details}")
        joined = r.joined
        for p in PHASES:
            if p in r.phases:  # data_docs: within validation where the checkpoints build it
                samples[p].append(r.phases[p])
        samples["total"].append(total)
    return {
        "joined": joined,
        **{p: {"median": statistics.median(v), "min": min(v), "max": max(v)} for p, v in samples.items() if v},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clicks", type=int, nargs="+", default=[10_000, 100_000], help="clicks in the hour")
    ap.add_argument("--shapes", nargs="+", choices=("batches", "one-file"), default=["batches", "one-file"])
    ap.add_argument("--history", type=int, default=720, help="earlier hours in the 'history' site (720: a month)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument(
        "--commit-every", type=int, default=60, help="batches: 1-s batches per Delta commit (60: one a minute)"
    )
    ap.add_argument("--load", type=int, default=2, help="busy processes for the loaded runs (0: idle only)")
    ap.add_argument("--root", type=Path, default=None, help="work folder (default: a temporary one, removed)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-quality-", dir=args.root))
    # An hour that has settled long ago, on UTC hour boundaries.
    start = (int(time.time() * US) // HOUR - 3) * HOUR
    settings = QualitySettings(max_unjoinable_rate=0.2)  # the generator gives up about 10% of clicks on purpose
    results: list[dict[str, Any]] = []
    try:
        for clicks in args.clicks:
            logs = tmp / f"logs-{clicks}"
            t0 = time.perf_counter()
            gen = generate(
                GeneratorSettings(events_per_s=clicks / 3600 / CLICKS_PER_EVENT, late_click_max_s=600.0),
                logs,
                start_us=start,
                end_us=start + HOUR,
            )
            print(
                f"== {clicks:,} clicks: generated {gen.clicks:,} clicks, {gen.files:,} files per replica in"
                f" {time.perf_counter() - t0:.0f} s",
                flush=True,
            )
            for shape in args.shapes:
                out = tmp / f"out-{clicks}-{shape}"
                counts = synthetic_output(logs, out, shape, start, args.commit_every)
                for history in ("fresh", "history"):
                    shutil.rmtree(out / QUALITY_DIR, ignore_errors=True)
                    check_quality(out, logs, start, start + HOUR, settings)  # warm-up: imports, the page cache
                    if history == "history":
                        copy_history(out / QUALITY_DIR, args.history)
                        check_quality(out, logs, start, start + HOUR, settings)  # pages of the copies localized
                    for load in sorted({0, args.load}):
                        procs = [mp.Process(target=_spin, daemon=True) for _ in range(load)]
                        for p in procs:
                            p.start()
                        try:
                            r = time_check(out, logs, start, args.runs, settings)
                        finally:
                            for p in procs:
                                p.terminate()
                                p.join()
                        case = {
                            "clicks": clicks,
                            "shape": shape,
                            "joined_files": counts["joined_files"],
                            "history_hours": args.history if history == "history" else 0,
                            "load": load,
                            **r,
                        }
                        results.append(case)
                        print(
                            f"{clicks:>7,} clicks, {shape:8} ({counts['joined_files']:>5,} joined files),"
                            f" {history:7}, load {load}: total {r['total']['median']:6.2f} s"
                            f" [{r['total']['min']:.2f}-{r['total']['max']:.2f}]; "
                            + ", ".join(f"{p} {r[p]['median']:.2f}" for p in PHASES if p in r),
                            flush=True,
                        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({"runs": args.runs, "cpus": os.cpu_count(), "cases": results}))


if __name__ == "__main__":
    main()
