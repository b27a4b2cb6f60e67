"""`make bench-handover`: the gap at each lease hand-over, as Airflow runs the joiner (one spark-submit per lease).

Live logs for one data center; the joiner runs as consecutive `photon join --run-for LEASE` processes, started the
way the join DAG starts them, in three modes measured one after the other on the same machine:
- ``standby``: two runs at a time (the DAG's max_active_runs=2): the next process starts its Spark session while the
  current lease runs (`--standby`) and takes over the moment it releases the pipeline after its last batch;
- ``sequential``: the next process starts when the current one exits (before: max_active_runs=1, no standby);
- ``single``: one process for the whole run (the demo's shape: no hand-over at all).
For each: the gaps between the last batch of one lease and the first batch of the next (from the registry's batch
metrics), each lease's first batch against the median batch, and the click latency p50/p99 from the audit (from the
click's own timestamp). Last line: JSON. `bench/handover_airflow.py` measures the same through Airflow.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from photon.pg import EmbeddedPostgres, autocommit, create_database, drop_database
from photon.registry.admin import init_registry
from photon.tools.audit import audit

US = 1_000_000
ROOT = Path(__file__).resolve().parents[1]


_OUTPUT: dict[int, IO[str]] = {}  # a process's output goes to a file: a full pipe would stall a long lease


def _join(logs: Path, out: Path, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "photon", "join", "--dc", "dc-a", "--logs", str(logs), "--out", str(out)]
    cmd += ["--trigger-interval", "0.5", "--master", "local[1]", *args]
    output = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed by _output
    p = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT, text=True)
    _OUTPUT[p.pid] = output
    return p


def _output(p: subprocess.Popen[str]) -> str:
    """What an ended process printed."""
    output = _OUTPUT.pop(p.pid)
    with output:
        output.seek(0)
        return output.read()


def generate(logs: Path, env: dict[str, str], seconds: float, rate: float, seed: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "photon", "generate", "--logs", str(logs), "--mode", "live"),
            *("--duration", str(seconds), "--rate", str(rate), "--dcs", "dc-a", "--seed", str(seed)),
            *("--max-join-delay", "30", "--set", "late_query_file_fraction=0", "--set", "late_click_fraction=0"),
        ],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def lease_running(dsn: str) -> bool:
    with autocommit(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT 1 FROM photon.pipelines WHERE lease_owner IS NOT NULL")
        return cur.fetchone() is not None


def _wait_for_a_lease(dsn: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if lease_running(dsn):
            return
        time.sleep(0.2)
    raise RuntimeError("no lease started")


@contextlib.contextmanager
def admin_dsn(tmp: Path) -> Iterator[str]:
    """PHOTON_REGISTRY_DSN's server, or an embedded one under ``tmp`` for the run."""
    if "PHOTON_REGISTRY_DSN" in os.environ:
        yield os.environ["PHOTON_REGISTRY_DSN"]
        return
    pg = EmbeddedPostgres(tmp / "pg", cleanup_mode="delete")
    pg.start()
    try:
        yield pg.admin_dsn
    finally:
        pg.stop()


def run_leases(
    work: Path, dsn: str, *, mode: str, lease_s: float, seconds: float, rate: float, seed: int = 5
) -> dict[str, Any]:
    """One run of ``seconds`` of live logs joined in ``mode``; returns the gaps, latency and the audit's verdict."""
    logs, out = work / "logs", work / "out"
    env = {**os.environ, "PHOTON_REGISTRY_DSN": dsn, "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}"}
    (logs / "dc-a").mkdir(parents=True, exist_ok=True)
    outputs: list[str] = []
    lease = ["--run-for", str(lease_s), "--max-join-delay", "30"]
    gen: subprocess.Popen[bytes] | None = None
    logs_end_us: int | None = None
    try:
        if mode == "single":
            procs = [_join(logs, out, env, "--run-for", str(seconds + 30), "--max-join-delay", "30")]
        else:
            procs = [_join(logs, out, env, *lease, *(["--standby"] if mode == "standby" else []))]
            if mode == "standby":
                procs.append(_join(logs, out, env, *lease, "--standby"))
        _wait_for_a_lease(dsn)  # the logs start once the first lease runs: its Spark start is not a hand-over
        gen = generate(logs, env, seconds, rate, seed)
        while gen.poll() is None or any(p.poll() is None for p in procs):
            if gen.poll() is not None and logs_end_us is None:
                logs_end_us = int(time.time() * US)
            done = [p for p in procs if p.poll() is not None]
            for p in done:
                procs.remove(p)
                outputs.append(_output(p))
                if p.returncode != 0:
                    raise RuntimeError(f"a lease failed ({p.returncode}):\n{outputs[-1][-3000:]}")
                if gen.poll() is None and mode != "single":  # the scheduler starts the next run
                    procs.append(_join(logs, out, env, *lease, *(["--standby"] if mode == "standby" else [])))
            time.sleep(0.2)
    finally:
        if gen is not None:
            gen.wait()
        for p in procs:
            p.wait()
            outputs.append(_output(p))
    logs_end_us = logs_end_us or int(time.time() * US)
    with autocommit(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT coalesce(max(epoch), 0) FROM photon.pipelines")
        last_epoch = cur.fetchone()[0]  # the final drain's epoch comes after it
    final = _join(logs, out, env, "--until-caught-up", "--drain", "--max-join-delay", "30")
    final.wait()
    outputs.append(_output(final))
    if final.returncode != 0:
        raise RuntimeError(f"the final run failed:\n{outputs[-1][-3000:]}")
    with autocommit(dsn) as conn, conn.cursor() as cur:
        cur.execute(
            "SELECT m.epoch, min(m.started_at_us), max(m.started_at_us + (m.duration_s * 1e6)::bigint), count(*),"
            " (array_agg(m.duration_s ORDER BY m.batch_seq))[1]"
            " FROM photon.batch_metrics m WHERE m.epoch <= %s GROUP BY m.epoch ORDER BY m.epoch",
            (last_epoch,),
        )
        leases = cur.fetchall()
        cur.execute(
            "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY duration_s) FROM photon.batch_metrics"
            " WHERE epoch <= %s",
            (last_epoch,),
        )
        median = cur.fetchone()[0]
    # Hand-overs while the logs flowed: after they end, the next lease's first batch waits for a retry to be due.
    gaps = [(nxt[1] - cur_[2]) / US for cur_, nxt in itertools.pairwise(leases) if nxt[1] <= logs_end_us]
    after = [(nxt[1] - cur_[2]) / US for cur_, nxt in itertools.pairwise(leases) if nxt[1] > logs_end_us]
    report = audit(out, manifest=logs / "_manifest")
    return {
        "mode": mode,
        "leases": len(leases),
        "handover_gaps_s": [round(g, 2) for g in gaps],
        "max_gap_s": round(max(gaps), 2) if gaps else None,
        "gaps_after_the_logs_s": [round(g, 2) for g in after],
        # A lease's first batch against the median batch: what a take-over costs beyond the gap itself.
        "first_batch_s": [round(float(lease[4]), 2) for lease in leases[1:]],
        "median_batch_s": round(float(median), 2) if median is not None else None,
        "latency_s": report.latency_s,
        "audit_ok": report.ok,
        "failures": report.failures(),
        "took_over": [
            line.split("took over (", 1)[1].split(")")[0]
            for o in outputs
            for line in o.splitlines()
            if "took over (" in line
        ],
        "held_on_s": [float(x) for o in outputs for x in re.findall(r"held on ([0-9.]+)s for a standby", o)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lease", type=float, default=30.0, help="seconds per lease")
    ap.add_argument("--seconds", type=float, default=150.0, help="seconds of live logs per mode")
    ap.add_argument("--rate", type=float, default=500.0, help="events/s")
    ap.add_argument("--modes", nargs="+", default=["standby", "sequential", "single"])
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="photon-bench-handover-"))
    results = {}
    with admin_dsn(tmp) as admin:
        for mode in args.modes:
            name = f"photon_bench_handover_{mode}_{os.getpid()}"
            dsn = create_database(admin, name)
            try:
                init_registry({"main": dsn}, num_shards=2)
                r = run_leases(tmp / mode, dsn, mode=mode, lease_s=args.lease, seconds=args.seconds, rate=args.rate)
            finally:
                drop_database(admin, name)
            results[mode] = r
            lat = r["latency_s"]
            print(
                f"{mode:>10}: {r['leases']} leases, hand-over gaps {r['handover_gaps_s']} s (max {r['max_gap_s']}), "
                f"first batch of a lease {r['first_batch_s']} s (median batch {r['median_batch_s']} s), "
                f"held on for a starting standby {r['held_on_s']} s; "
                f"click latency p50 {lat.get('p50', float('nan')):.2f} s, p99 {lat.get('p99', float('nan')):.2f} s; "
                f"audit {'PASS' if r['audit_ok'] else 'FAIL ' + str(r['failures'])}",
                flush=True,
            )
    print(json.dumps({"lease_s": args.lease, "rate": args.rate, **results}))


if __name__ == "__main__":
    main()
