"""`make bench-discovery`: what finding new files and starting a lease cost as a pipeline's history grows.

One data center's click folder fills, in arrival partitions (100 files a second: 6,000 per minute), with 20,000,
then 200,000, then 2,000,000 closed files, all consumed by a pipeline whose last batch recorded its listing mark as a
caught-up joiner does; a few new files keep arriving in the partition of now. At each size, side by side:
- trigger: the time one trigger takes to find the new files (the joiner's own ``Discovery.new_files``), median of 20;
- lease start: the time ``Joiner.start()`` takes, and the memory it adds (its consumed-file set), in a fresh process;
- for contrast, the same two figures with the marks of a pipeline that lists everything (as before partitions).
It removes what it created. Last line: the figures as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from photon.joiner.common import JoinSettings
from photon.joiner.lease import Joiner
from photon.joiner.state import PipelineState
from photon.logs.layout import partition_of, sealed_before
from photon.pg import EmbeddedPostgres, autocommit, create_database, drop_database
from photon.registry.admin import init_registry

US = 1_000_000
FILES_PER_S = 100
SIZES = (20_000, 200_000, 2_000_000)

# Run in a fresh process: how long a lease start takes and how much memory it adds.
_LEASE_START = """
import json, sys, time
from pathlib import Path
from photon.joiner.common import JoinSettings
from photon.joiner.lease import Joiner

def peak_mb():  # this process's own peak (VmHWM starts afresh at exec; ru_maxrss would carry the parent's)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024

logs, dsn, everything = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
joiner = Joiner("dc-a", logs, logs.parent / "out", {"main": dsn}, None, JoinSettings(parallelism=1))
if everything:
    joiner.state.marks = lambda: {"queries": None, "clicks": None}  # a pipeline that lists everything
before = peak_mb()
t = time.perf_counter()
joiner.start()
took = time.perf_counter() - t
after = peak_mb()
consumed = len(joiner.discovery.consumed)
print(json.dumps({"seconds": took, "added_mb": after - before, "rss_mb": after, "consumed": consumed}))
"""


def make_files(clicks: Path, start_us: int, first: int, last: int) -> list[str]:
    """Files first..last-1, arriving FILES_PER_S a second from start_us; their names relative to the folder."""
    names = []
    made: set[Path] = set()
    for i in range(first, last):
        at = start_us + i * US // FILES_PER_S
        rel = f"{partition_of(at)}/10.0.{i // 65536 % 256}.{i // 256 % 256}-{i % 256}-{i}.jsonl"
        folder = clicks / rel.rsplit("/", 1)[0]
        if folder not in made:
            folder.mkdir(parents=True, exist_ok=True)
            made.add(folder)
        fd = os.open(clicks / rel, os.O_CREAT | os.O_WRONLY, 0o644)
        os.close(fd)
        names.append(rel)
    return names


def record_consumed(dsn: str, state: PipelineState, names: list[str], marks: dict[str, str | None]) -> None:
    """Commit one batch that consumed ``names`` (as the joiner commits, in pages)."""
    lease = state.start_lease()
    state.commit(lease, lease.last_batch + 1, [("clicks", n) for n in names], marks=marks)


def trigger_s(joiner: Joiner, repeat: int = 20) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        joiner.discovery.new_files()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def lease_start(logs: Path, dsn: str, everything: bool) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", _LEASE_START, str(logs), dsn, "1" if everything else "0"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    ap.add_argument("--work", type=Path, default=None, help="folder for the files (default: a temporary one)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="photon-bench-disc-", dir=args.work))
    pg = None
    try:
        if os.environ.get("PHOTON_REGISTRY_DSN"):
            admin = os.environ["PHOTON_REGISTRY_DSN"]
        else:
            pg = EmbeddedPostgres(tmp / "pg", cleanup_mode="delete")
            pg.start()
            admin = pg.admin_dsn
        dbname = f"photon_bench_disc_{os.getpid()}"
        dsn = create_database(admin, dbname)
        init_registry({"main": dsn}, num_shards=1)
        logs = tmp / "logs"
        clicks = logs / "dc-a" / "clicks"
        state = PipelineState(dsn, "dc-a")
        now = int(time.time() * US)
        start = now - max(args.sizes) * US // FILES_PER_S - 600 * US  # the history ends ten minutes ago or before
        results: dict[int, dict[str, Any]] = {}
        made = 0
        unconsumed: list[str] = []
        for size in sorted(args.sizes):
            t = time.perf_counter()
            names = make_files(clicks, start, made, size)
            made = size
            # As a caught-up joiner commits them: the oldest partition that is not sealed or still holds a file not
            # consumed (the new files of the sizes before are left unconsumed on purpose).
            mark = min([sealed_before(int(time.time() * US)), *unconsumed])
            marks = {"queries": mark, "clicks": mark}
            record_consumed(dsn, state, names, marks)
            setup = time.perf_counter() - t
            for i in range(5):  # a few new files arrive now
                unconsumed.append(partition_of(int(time.time() * US)))
                new = clicks / unconsumed[-1] / f"10.9.9.9-{size}-{i}.jsonl"
                new.parent.mkdir(parents=True, exist_ok=True)
                new.touch()
            joiner = Joiner("dc-a", logs, tmp / "out", {"main": dsn}, None, JoinSettings(parallelism=1))
            joiner.start()
            found = len(joiner.discovery.new_files()[1])
            row: dict[str, Any] = {"files": size, "setup_s": round(setup, 1), "new_found": found}
            row["trigger_s"] = trigger_s(joiner)
            row["lease_start"] = lease_start(logs, dsn, everything=False)
            joiner.discovery.marks = {"queries": None, "clicks": None}
            joiner.discovery.consumed = state.consumed()
            row["trigger_s_listing_everything"] = trigger_s(joiner, repeat=3)
            row["lease_start_listing_everything"] = lease_start(logs, dsn, everything=True)
            results[size] = row
            ls, le = row["lease_start"], row["lease_start_listing_everything"]
            print(
                f"{size:>9,} files seen: trigger {row['trigger_s'] * 1e3:7.2f} ms (listing everything "
                f"{row['trigger_s_listing_everything'] * 1e3:8.1f} ms); lease start {ls['seconds'] * 1e3:7.1f} ms, "
                f"+{ls['added_mb']:.1f} MB, {ls['consumed']:,} records loaded (listing everything "
                f"{le['seconds'] * 1e3:7.1f} ms, +{le['added_mb']:.1f} MB); {found} new files found; setup "
                f"{setup:.0f} s",
                flush=True,
            )
        with autocommit(dsn) as conn, conn.cursor() as cur:
            cur.execute("SELECT count(*) FROM photon.consumed_files")
            recorded = cur.fetchone()[0]
        small, big = results[min(results)], results[max(results)]
        summary = {
            "files_recorded": recorded,
            "trigger_s_at_20k": small["trigger_s"],
            "trigger_s_at_2m": big["trigger_s"],
            "lease_start_s_at_2m": big["lease_start"]["seconds"],
            "lease_rss_mb_at_2m": big["lease_start"]["rss_mb"],
            "lease_added_mb_at_2m": big["lease_start"]["added_mb"],
            "trigger_s_at_2m_listing_everything": big["trigger_s_listing_everything"],
            "lease_start_s_at_2m_listing_everything": big["lease_start_listing_everything"]["seconds"],
            "lease_added_mb_at_2m_listing_everything": big["lease_start_listing_everything"]["added_mb"],
            "sizes": results,
        }
        print(json.dumps(summary))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if pg is not None:
            pg.stop()
        elif "dbname" in locals():
            drop_database(admin, dbname)


if __name__ == "__main__":
    main()
