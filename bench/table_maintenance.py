"""`make bench-table`: 1-s batches into one pipeline's output tables, then `photon table maintain`.

--commits batches (default 1,200: 20 minutes of 1-s batches; 3,600 for an hour's) are staged and published as a
joiner does (``photon.logs.tables.stage_rows`` into a stage folder, then ``photon.joiner.publish.publish_files``: one
Delta commit per table that got rows, under ``txn(photon/<pipeline>, batch)``): --rows joined rows a batch, an
unjoinable row every 10th batch and a quarantined line every 60th, their click times in the batch's second, starting
at half past an hour (so an hour of batches spans two ``hour`` partitions, as one not starting on the hour does).

Then, per table: its commits (version + 1), the data files its snapshot names, the data files in its folder, the
commit files a reader opening it reads after its last checkpoint, and the time to open it and read every row (median
of --reads): before maintenance, after ``maintain`` with the default retention (168 h: the files compaction replaced
stay on disk, as readers of older snapshots may need them), and after a second run with the retention passed
(``--retention-hours 0 --force``: nobody is writing here, so the replaced files go). Both runs are timed, and so is
publishing a batch: the first 100, the last 100, and 100 more after maintenance. Ends with one JSON line. Everything
is written under a temporary folder (--work to choose it), removed at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pyarrow as pa

from photon.joiner.common import batch_tag
from photon.joiner.publish import publish_files
from photon.logs import tables
from photon.logs.ids import make_id
from photon.logs.schemas import JOINED, QUARANTINE, UNJOINABLE
from photon.tools.maintenance import DEFAULT_RETENTION_HOURS, maintain, table_facts

US = 1_000_000
PIPELINE = "dc-a"
T0 = (1_790_000_000 // 3600 * 3600 + 1800) * US  # half past an hour


def batch_rows(kind: str, k: int, n: int) -> pa.Table:
    """``n`` rows of ``kind`` for batch ``k``, their times in the batch's second."""
    schema = tables.ROW_SCHEMAS[kind]
    ts = [T0 + (k - 1) * US + i * (US // max(n, 1)) for i in range(n)]
    cols: dict[str, Any] = {}
    for f in schema:
        if pa.types.is_integer(f.type):
            cols[f.name] = ts
        elif pa.types.is_binary(f.type):
            cols[f.name] = [b"{not json" for _ in ts]
        else:
            cols[f.name] = [f"{f.name}-{k}-{i}" for i in range(n)]
    if kind != QUARANTINE:
        cols["click_id"] = [make_id("10.0.0.1", 1, t) for t in ts]
    cols["pipeline"] = [PIPELINE] * n
    return pa.table(cols, schema=schema)


def publish_hour(root: Path, batches: range, rows: int) -> list[float]:
    """Stage and publish ``batches`` as a joiner does; seconds each took."""
    tables.ensure_tables(root)
    took = []
    for k in batches:
        t0 = time.monotonic()
        stage = f"_staging/{batch_tag(k, 1)}"
        for kind, n in ((JOINED, rows), (UNJOINABLE, int(k % 10 == 0)), (QUARANTINE, int(k % 60 == 0))):
            if n:
                tables.stage_rows(root, kind, stage, f"{batch_tag(k, 1)}-t0", batch_rows(kind, k, n), k)
        publish_files(root, PIPELINE, k, 1)
        took.append(time.monotonic() - t0)
    return took


def read_seconds(path: Path, reads: int) -> float:
    """Median seconds to open the table (its log) and read every row."""
    from deltalake import DeltaTable

    times = []
    for _ in range(reads):
        t0 = time.monotonic()
        DeltaTable(str(path)).to_pyarrow_dataset().to_table()
        times.append(time.monotonic() - t0)
    return statistics.median(times)


def measure(out: Path, reads: int) -> dict[str, Any]:
    found = {}
    for kind in (JOINED, UNJOINABLE, QUARANTINE):
        t = next(tables.tables(out, kind, [PIPELINE]))
        f = asdict(table_facts(t))
        found[kind] = {
            "commits": f["version"] + 1,
            "files": f["files"],
            "files_on_disk": f["files_on_disk"],
            "log_files": f["log_files"],
            "commits_since_checkpoint": f["commits_since_checkpoint"],
            "rows": f["rows"],
            "mb": round(f["bytes"] / 1e6, 2),
            "mb_on_disk": round(f["bytes_on_disk"] / 1e6, 2),
            "read_s": round(read_seconds(t.path, reads), 4),
        }
    return found


def show(label: str, facts: dict[str, Any]) -> None:
    print(f"== {label}")
    for kind, f in facts.items():
        print(
            f"  {kind:<10} commits {f['commits']:>6,}  files {f['files']:>6,}  on disk {f['files_on_disk']:>6,}  "
            f"log files {f['log_files']:>6,} ({f['commits_since_checkpoint']} after the checkpoint)  "
            f"rows {f['rows']:>8,}  {f['mb_on_disk']:.1f} MB on disk  open+read {f['read_s'] * 1000:.0f} ms"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--commits", type=int, default=1200, help="Batches published (1-s batches: 3,600 an hour).")
    ap.add_argument("--rows", type=int, default=50, help="Joined rows a batch.")
    ap.add_argument("--reads", type=int, default=3, help="Reads timed per table and state (the median is shown).")
    ap.add_argument("--work", type=Path, default=None, help="Folder to work in (default: a temporary one).")
    ap.add_argument("--keep", action="store_true", help="Keep the work folder.")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="photon-bench-table-"))
    out = work / "out"
    try:
        print(f"publishing {args.commits:,} batches of {args.rows} joined rows into {out / PIPELINE} ...", flush=True)
        took = publish_hour(out / PIPELINE, range(1, args.commits + 1), args.rows)
        publish_s, tail = sum(took), min(100, len(took))
        first_ms, last_ms = (statistics.mean(took[:tail]) * 1000, statistics.mean(took[-tail:]) * 1000)
        print(
            f"published in {publish_s:.1f} s: {first_ms:.0f} ms a batch (the first {tail}), {last_ms:.0f} ms (the last)"
        )
        before = measure(out, args.reads)
        show("before maintenance", before)
        t0 = time.monotonic()
        report = maintain(out)
        maintain_s = time.monotonic() - t0
        after = measure(out, args.reads)
        show(f"after photon table maintain ({maintain_s:.1f} s, retention {DEFAULT_RETENTION_HOURS} h)", after)
        t0 = time.monotonic()
        vacuum = maintain(out, retention_hours=0, force=True)
        vacuum_s = time.monotonic() - t0
        passed = measure(out, args.reads)
        show(f"after a run with the retention passed ({vacuum_s:.1f} s, --retention-hours 0 --force)", passed)
        more = publish_hour(out / PIPELINE, range(args.commits + 1, args.commits + tail + 1), args.rows)
        after_ms = statistics.mean(more) * 1000
        print(f"publishing {tail} more batches after maintenance: {after_ms:.0f} ms a batch")
        print(
            json.dumps(
                {
                    "commits": args.commits,
                    "rows_per_batch": args.rows,
                    "publish_s": round(publish_s, 1),
                    "publish_ms_first": round(first_ms, 1),
                    "publish_ms_last": round(last_ms, 1),
                    "publish_ms_after_maintenance": round(after_ms, 1),
                    "maintain_s": round(maintain_s, 2),
                    "maintain_retention_passed_s": round(vacuum_s, 2),
                    "files_compacted": report.totals()["files_compacted"],
                    "vacuumed": vacuum.totals()["vacuumed"],
                    "before": before,
                    "after": after,
                    "after_retention_passed": passed,
                }
            )
        )
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
