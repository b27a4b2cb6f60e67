"""The joiner and its peer side by side: same machine, same input files, same Spark session settings.

For one workload (logs of one data center): the joiner until caught up, then the peer (bench/peer.py: Spark
Structured Streaming's stream-stream join, availableNow), each in the shared session and timed without the session's
start; their joined counts against each other and the manifest; optionally each again as a whole process of its own
(its Spark start included), and the joiner's executor side replayed stage by stage (bench/stages.py).

``python -m bench.side_by_side --role joiner|peer ...`` is one whole-process run (used by ``run_workload``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from bench.peer import configure, run_peer
from bench.stages import DriverClock, commit_ms, commit_text, last_stage_id, replay, spark_stages, timed_table_commits
from photon.joiner.common import JoinSettings
from photon.joiner.lease import Joiner
from photon.logs import tables
from photon.pg import EmbeddedPostgres, create_database
from photon.registry.admin import init_registry
from photon.tools.generator import GeneratorSettings, generate

US = 1_000_000
DC = "dc-a"
# The one session both sides share, here and in their whole-process runs.
MASTER, SHUFFLE_PARTITIONS = "local[2]", 4


@dataclass(frozen=True)
class Workload:
    name: str
    settings: GeneratorSettings
    seconds: float  # of log time
    about: str
    reshape: Callable[[Path], str] | None = None  # rewrites the generated logs of DC in place; says what it did


def default_workload(rate: float, seconds: float) -> Workload:
    """The project's generator defaults as ``make bench-pipeline`` has always used them (10 queries per click)."""
    s = GeneratorSettings(events_per_s=rate, clicks_per_query=0.1, dcs=(DC,), rotate_s=10.0, chunk_s=10.0)
    lines = rate / 1.1 * s.rotate_s / s.query_servers
    return Workload("default", s, seconds, f"generator defaults, about {lines:,.0f} lines per query file")


def _large_files(rate: float, lines_per_file: int, **more: Any) -> tuple[GeneratorSettings, float]:
    """One data center, 10 s files, as many query servers as make ``lines_per_file`` lines per query file, clicks
    from one server; the settings and the lines per query file."""
    qps = rate / 1.1
    servers = max(1, round(qps * 10.0 / lines_per_file))
    s = GeneratorSettings(
        events_per_s=rate,
        clicks_per_query=0.1,
        dcs=(DC,),
        rotate_s=10.0,
        chunk_s=10.0,
        query_servers=servers,
        click_servers=1,
        **more,
    )
    return s, qps * 10.0 / servers


def long_non_ascii_workload(rate: float, seconds: float, lines_per_file: int = 20_000) -> Workload:
    """Long query texts (20-60 words, every one non-ASCII, several scripts) in large files: ``lines_per_file``
    lines per query file, clicks from one server."""
    s, lines = _large_files(rate, lines_per_file, query_vocabulary="non_ascii", query_words_min=20, query_words_max=60)
    return Workload(
        "long_non_ascii",
        s,
        seconds,
        f"20-60 non-ASCII words per query text, about {lines:,.0f} lines per query file, "
        f"{rate / 11 * 10:,.0f} per click file",
    )


def nested_ads_workload(rate: float, seconds: float, lines_per_file: int = 20_000) -> Workload:
    """Short query texts (the default 1-4 words) with 1-4 ads each in the nested array (a Poisson of mean 2, clipped
    to 1..8), ``lines_per_file`` lines per query file, 3% of lines sent twice and 0.1% malformed."""
    s, lines = _large_files(rate, lines_per_file, ads_per_query=2.0, duplicate_fraction=0.03, malformed_fraction=0.001)
    return Workload(
        "nested_ads",
        s,
        seconds,
        f"1-4 ads per query (mean 2), short texts, about {lines:,.0f} lines per query file, 3% "
        "duplicate and 0.1% malformed lines",
    )


def shuffled_clicks_workload(rate: float, seconds: float, clicks_per_file: int = 5_000) -> Workload:
    """``nested_ads``, with its click lines then shuffled over the whole time range and rewritten into files of
    ``clicks_per_file``: every click file holds clicks from anywhere in the workload, as a replica that ships late
    and out of order would."""
    w = nested_ads_workload(rate, seconds)

    def reshape(dc_logs: Path) -> str:
        return shuffle_click_files(dc_logs / "clicks", clicks_per_file, seed=w.settings.seed)

    return Workload(
        "shuffled_clicks",
        w.settings,
        seconds,
        f"{w.about}; click lines shuffled over the whole range into files of {clicks_per_file:,}",
        reshape,
    )


def shuffle_click_files(clicks: Path, per_file: int, seed: int) -> str:
    """Every line of the closed click files under ``clicks``, shuffled (seeded), rewritten as files of ``per_file``
    lines in the last file's arrival partition; the originals removed."""
    files = sorted(p for p in clicks.rglob("*.jsonl"))
    lines = [line for f in files for line in f.read_bytes().splitlines(keepends=True)]
    random.Random(seed).shuffle(lines)
    last = files[-1].parent
    for f in files:
        f.unlink()
    for i in range(0, len(lines), per_file):
        (last / f"10.250.0.{1 + i // per_file % 250}-{1 + i // per_file}-1.jsonl").write_bytes(
            b"".join(lines[i : i + per_file])
        )
    return f"{len(lines):,} click lines of {len(files)} files shuffled into {-(-len(lines) // per_file)} files"


def _start_us(s: GeneratorSettings) -> int:
    """An hour ago, on a rotation boundary (the generator starts there), so a workload's size is its own."""
    rot = int(s.rotate_s * US)
    t = (int(time.time()) - 3_600) * US
    return t - t % rot


def _seconds(v: float) -> str:
    return f"{v:.1f}"


def _joiner_ids(out: Path) -> pa.Array:
    """The click ids in the joiner's joined table under ``out``: its committed rows, through the Delta log."""
    return tables.read(out, "joined", ["click_id"], only=[DC])["click_id"].combine_chunks()


def _peer_ids(folder: Path) -> pa.Array:
    """The click ids the peer wrote: plain Parquet files of its own sink (no table)."""
    if not folder.is_dir():
        return pa.array([], pa.string())
    return ds.dataset(str(folder), format="parquet").to_table(columns=["click_id"]).column("click_id").combine_chunks()


def _registry(pg: EmbeddedPostgres, name: str) -> dict[str, str]:
    servers = {"main": create_database(pg.admin_dsn, name)}
    init_registry(servers)
    return servers


def run_joiner(spark: Any, servers: dict[str, str], logs: Path | str, out: Path | str) -> dict[str, Any]:
    joiner = Joiner(DC, logs, out, servers, spark, JoinSettings(trigger_interval_s=0.0))
    clock = DriverClock()
    clock.attach(joiner)
    since = last_stage_id(spark)
    with timed_table_commits() as commits:
        t0 = time.perf_counter()
        results = joiner.run(until_caught_up=True, drain=True)
        seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "batches": len(results),
        "joined": sum(int(r.metrics.get("joined", 0)) for r in results),
        "unjoinable": sum(int(r.metrics.get("unjoinable", 0)) for r in results),
        "driver": clock.seconds(results),
        "table_commit_s": commits,
        "stages": spark_stages(spark, since),
    }


def _whole_process(
    role: str, logs: Path, out: Path, dsn: str | None, connect_home: Path | None = None
) -> dict[str, Any]:
    """One side as a process of its own, timed from its start to its exit: the joiner as a backfill task runs it,
    ``photon join --until-caught-up --drain`` (with ``connect_home``, ``--connect`` to the Spark Connect server kept
    there); the peer through ``--role peer`` below."""
    if role == "joiner":
        cmd = [sys.executable, "-m", "photon", "join", "--dc", DC, "--logs", str(logs), "--out", str(out)]
        cmd += ["--until-caught-up", "--drain"]
        env = os.environ | {"PHOTON_REGISTRY_DSN": dsn or "", "PHOTON_REGISTRY_REPLICATION": "single"}
        if connect_home is not None:
            cmd.append("--connect")
            env["PHOTON_HOME"] = str(connect_home)
    else:
        cmd = [sys.executable, "-m", "bench.side_by_side", "--role", role, "--logs", str(logs), "--out", str(out)]
        env = os.environ.copy()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"whole-process {role} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    if role == "joiner":
        return {"wall_s": wall, "joined": len(_joiner_ids(out))}
    return {"wall_s": wall, **json.loads(proc.stdout.strip().splitlines()[-1])}


def spread(xs: list[float]) -> str:
    """Median (min-max)."""
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def run_workload(
    spark: Any,
    pg: EmbeddedPostgres,
    root: Path,
    w: Workload,
    *,
    whole_process: int = 3,
    stages: bool = True,
    keep_logs: bool = False,
    repeat: int = 5,
    connect_home: Path | None = None,
) -> dict[str, Any]:
    """Generate the workload, run both sides on it ``repeat`` times, alternating which goes first, each run on a
    fresh registry and output; then ``whole_process`` times each as a process of its own, alternating too. The
    figures are medians with their spread (min-max), the ratios the medians of the per-run ratios; print and
    return them."""
    logs = root / "logs"
    start = _start_us(w.settings)
    rep = generate(w.settings, logs, start_us=start, end_us=start + int(w.seconds * US))
    reshaped = w.reshape(logs / DC) if w.reshape else None
    events = rep.queries + rep.clicks
    size = sum(p.stat().st_size for p in (logs / DC).rglob("*.jsonl"))
    files = sum(1 for _ in (logs / DC).rglob("*.jsonl"))
    print(
        f"\n== workload {w.name}: {w.about}\n"
        f"   {rep.queries:,} queries + {rep.clicks:,} clicks = {events:,} events in {files} files "
        f"({size / 1e6:,.0f} MB); manifest: {rep.expect}" + (f"\n   {reshaped}" if reshaped else "")
    )
    tag = f"{w.name}_{os.getpid()}"
    j_runs, p_runs = [], []
    for r in range(max(1, repeat)):

        def joiner(r: int = r) -> dict[str, Any]:
            return run_joiner(spark, _registry(pg, f"bench_sbs_{tag}_{r}"), logs, root / f"out{r}")

        def peer(r: int = r) -> Any:
            return run_peer(spark, logs / DC, root / f"peer-out{r}", root / f"peer-ckpt{r}")

        if r % 2 == 0:
            j_runs.append(joiner())
            p_runs.append(peer())
        else:
            p_runs.append(peer())
            j_runs.append(joiner())
    j_s = [float(x["seconds"]) for x in j_runs]
    p_s = [float(x.seconds) for x in p_runs]
    ratios = [p / j for j, p in zip(j_s, p_s, strict=True)]
    j_rate, p_rate = events / statistics.median(j_s), events / statistics.median(p_s)
    ratio = statistics.median(ratios)
    j, p = j_runs[0], p_runs[0]
    j_ids, p_ids = _joiner_ids(root / "out0"), _peer_ids(root / "peer-out0")
    commits = commit_ms([s for x in j_runs for s in x["table_commit_s"]])
    only_joiner = int(pc.sum(pc.invert(pc.is_in(j_ids, value_set=p_ids))).as_py() or 0)
    only_peer = int(pc.sum(pc.invert(pc.is_in(p_ids, value_set=j_ids))).as_py() or 0)
    print(
        f"   {len(j_runs)} runs each, alternating which goes first; seconds per run: joiner "
        f"{', '.join(_seconds(x) for x in j_s)}; peer {', '.join(_seconds(x) for x in p_s)}\n"
        f"   joiner (photon join --until-caught-up --drain, in the shared session): median {statistics.median(j_s):.2f}"
        f" s = {j_rate:,.0f} events/s, {j['batches']} batch(es)\n"
        f"   peer (Structured Streaming, availableNow, RocksDB state): median {statistics.median(p_s):.2f} s = "
        f"{p_rate:,.0f} events/s, {p.batches} micro-batch(es), {p.state_rows:,} state rows at the end\n"
        f"   ratio joiner / peer, per run: median (min-max) {spread(ratios)}\n"
        f"   joined: joiner {j['joined']:,} ({len(j_ids):,} rows, {len(pc.unique(j_ids)):,} ids), peer "
        f"{p.joined_rows:,} rows ({p.joined_ids:,} ids); only in the joiner's {only_joiner:,}, only in the peer's "
        f"{only_peer:,}; manifest must join {rep.expect.get('join', 0):,} (either {rep.expect.get('either', 0):,})\n"
        f"   joiner's {commit_text(commits)} over its {len(j_runs)} run(s) (photon.logs.tables.publish_batch: one "
        "Delta commit per table with rows)"
    )
    if p.joined_rows > p.joined_ids:
        print(
            f"   the peer wrote {p.joined_rows - p.joined_ids:,} click(s) twice: joined to a query logged twice (it "
            "deduplicates click ids only; the joiner keeps the first copy of a query)"
        )
    phases = ", ".join(f"{k} {v / 1e3:.1f}s" for k, v in sorted(p.durations_ms.items(), key=lambda kv: -kv[1]))
    print(f"   peer's progress by phase (summed over batches, first run): {phases}")
    result: dict[str, Any] = {
        "events": events,
        "files": files,
        "mb": round(size / 1e6, 1),
        "events_per_s": round(j_rate),
        "peer_events_per_s": round(p_rate),
        "ratio_to_peer": round(ratio, 3),
        "ratio_to_peer_spread": [round(min(ratios), 3), round(max(ratios), 3)],
        "joiner_s_runs": [round(x, 2) for x in j_s],
        "peer_s_runs": [round(x, 2) for x in p_s],
        "joined": j["joined"],
        "peer_joined": p.joined_rows,
        "peer_joined_ids": p.joined_ids,
        "only_in_joiner": only_joiner,
        "only_in_peer": only_peer,
        "must_join": rep.expect.get("join", 0),
        **commits,
    }
    if stages:
        result["joiner_stages"] = print_stages(spark, pg, root, logs, events, j, tag)
    if whole_process:
        sides: dict[str, list[float]] = {"joiner": [], "peer": []}
        if connect_home is not None:
            sides["joiner_connect"] = []
        joined: dict[str, int] = {}
        for r in range(whole_process):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            for side in order:
                if side == "peer":
                    res = _whole_process("peer", logs, root / f"peer-out-wp{r}", None)
                else:
                    dsn = _registry(pg, f"bench_wp_{tag}_{side}_{r}")["main"]
                    home = connect_home if side == "joiner_connect" else None
                    res = _whole_process("joiner", logs, root / f"out-wp-{side}{r}", dsn, home)
                sides[side].append(res["wall_s"])
                joined[side] = int(res["joined"])
        cold = [p / j for j, p in zip(sides["joiner"], sides["peer"], strict=True)]
        runs = "; ".join(f"{side} {', '.join(_seconds(x) for x in xs)} s" for side, xs in sides.items())
        print(
            f"   as whole processes, {whole_process} each, alternating (Python start included; the joiner as a "
            f"backfill task runs it, `photon join --until-caught-up --drain`, with its own Spark start"
            + (", and with --connect on a warm Spark Connect server" if connect_home is not None else "")
            + f"): {runs}\n   whole-process ratio, own Spark start: {spread(cold)}"
            + f" (joined {', '.join(f'{k} {v:,}' for k, v in joined.items())})"
        )
        result.update(
            {
                "whole_process_s_runs": [round(x, 2) for x in sides["joiner"]],
                "whole_process_peer_s_runs": [round(x, 2) for x in sides["peer"]],
                "ratio_whole_process_cold": round(statistics.median(cold), 3),
                "ratio_whole_process_cold_spread": [round(min(cold), 3), round(max(cold), 3)],
            }
        )
        headline = cold
        if connect_home is not None:
            warm = [p / j for j, p in zip(sides["joiner_connect"], sides["peer"], strict=True)]
            print(f"   whole-process ratio, on the warm Spark Connect server: {spread(warm)}")
            result["whole_process_connect_s_runs"] = [round(x, 2) for x in sides["joiner_connect"]]
            result["ratio_whole_process_connect_spread"] = [round(min(warm), 3), round(max(warm), 3)]
            headline = warm
        result["ratio_whole_process"] = round(statistics.median(headline), 3)
    if not keep_logs:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return result


def print_stages(
    spark: Any, pg: EmbeddedPostgres, root: Path, logs: Path, events: int, j: dict[str, Any], tag: str
) -> dict[str, Any]:
    """Where the joiner's time went: the real run's driver steps and Spark stages, then the executor side replayed
    on one core, step by step."""
    total = j["seconds"]
    driver = {k: v for k, v in sorted(j["driver"].items(), key=lambda kv: -kv[1]) if v >= 0.0005}
    print("   joiner, where the time went (the real run's driver side, then its Spark stages):")
    for k, v in driver.items():
        print(f"     {k:<40} {v:7.2f} s  {v / total:6.1%}")
    for i, s in enumerate(j["stages"]):  # every batch is one job of two stages
        what = "parse + store queries, shuffle write" if i % 2 == 0 else "shuffle read + join"
        print(
            f"     Spark stage {s['id']} ({what}): {s['wall_s']:.2f} s wall, {s['tasks']} tasks, task time "
            f"{s['task_s']:.2f} s (JVM CPU {s['cpu_s']:.2f} s, GC {s['gc_s']:.2f} s), shuffle write "
            f"{s['shuffle_write_mb']:.1f} MB in {s['shuffle_write_s']:.2f} s, read {s['shuffle_read_mb']:.1f} MB"
        )
    r = replay(spark, _registry(pg, f"bench_replay_{tag}"), logs, DC, root / "replay-out")
    one_core = sum(r.seconds.values())
    print(
        f"   the same, with each batch's Spark job replayed in this process on one core ({r.wall_s:.1f} s wall, "
        f"{r.batches} batch(es); stage 1 {r.source_s:.2f} s, stage 2 {r.join_s:.2f} s; {r.joined:,} joined):"
    )
    for k, v in sorted(r.seconds.items(), key=lambda kv: -kv[1]):
        if v >= 0.0005:
            print(f"     {k:<40} {v:7.2f} s  {v / one_core:6.1%}  ({events / v:>12,.0f} events/s per core)")
    task_s = sum(s["task_s"] for s in j["stages"])
    if task_s:
        spark_share = task_s - (r.source_s + r.join_s)
        print(
            f"     real job's task time {task_s:.2f} s vs the replay's {r.source_s + r.join_s:.2f} s: Spark's own "
            f"share (Arrow to rows and back, shuffle, scheduling, worker IPC) about {spark_share:.2f} s"
        )
    return {
        "driver_s": {k: round(v, 3) for k, v in driver.items()},
        "spark_stages": [
            {k: (round(v, 3) if isinstance(v, float) else v) for k, v in s.items() if k != "name"} for s in j["stages"]
        ],
        "replay_one_core_s": {k: round(v, 3) for k, v in r.seconds.items()},
        "replay_stage1_s": round(r.source_s, 3),
        "replay_stage2_s": round(r.join_s, 3),
    }


def warm_up(spark: Any, pg: EmbeddedPostgres, root: Path) -> None:
    """Both sides once on a few seconds of logs, unmeasured: the first run in a session pays for class loading,
    JIT and the Python workers' start, and neither side should pay it for the other."""
    import shutil

    w = default_workload(5_000.0, 5.0)
    start = _start_us(w.settings)
    generate(w.settings, root / "logs", start_us=start, end_us=start + int(w.seconds * US))
    run_joiner(spark, _registry(pg, f"bench_warm_{os.getpid()}"), root / "logs", root / "out")
    run_peer(spark, root / "logs" / DC, root / "peer-out", root / "peer-ckpt")
    shutil.rmtree(root, ignore_errors=True)


# -- one side as a whole process ---------------------------------------------------------------------------------


def _role_main() -> None:
    t_begin = time.perf_counter()
    ap = argparse.ArgumentParser(description="one side of the side-by-side benchmark as a whole process")
    ap.add_argument("--role", choices=("joiner", "peer"), required=True)
    ap.add_argument("--logs", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dsn")
    args = ap.parse_args()
    from photon.spark_session import get_spark

    spark = get_spark(f"photon-bench-{args.role}", master=MASTER, shuffle_partitions=SHUFFLE_PARTITIONS)
    configure(spark)  # the same settings in both processes
    started = time.perf_counter()
    if args.role == "joiner":
        joiner = Joiner(DC, args.logs, args.out, {"main": args.dsn}, spark, JoinSettings(trigger_interval_s=0.0))
        t0 = time.perf_counter()
        results = joiner.run(until_caught_up=True, drain=True)
        seconds, joined = time.perf_counter() - t0, sum(int(r.metrics.get("joined", 0)) for r in results)
    else:
        res = run_peer(spark, args.logs / DC, args.out / "data", args.out / "checkpoint")
        seconds, joined = res.seconds, res.joined_rows
    spark.stop()
    print(json.dumps({"seconds": seconds, "joined": joined, "until_spark_s": started - t_begin}))


if __name__ == "__main__":
    _role_main()
