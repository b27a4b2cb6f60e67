"""`make bench-handover-airflow`: lease hand-overs measured through Airflow, with a running scheduler.

It starts `photon airflow` (scheduler, DAG processor, triggerer, API server; LocalExecutor, metadata on PostgreSQL)
in a temporary PHOTON_HOME with only data center dc-a and a short default lease (``PHOTON_JOIN_LEASE_S``, which the
join DAGs read at parse time), unpauses ``photon_join_dc_a`` and ``photon_join_dc_a_standby`` and, once the first
lease runs, writes live logs (`photon generate --mode live`). The scheduler starts the leases: each DAG run is one
`spark-submit` of `photon join --standby`, the other DAG's run warm beside it. When the logs end, both DAGs are
paused, the leases still running finish, Airflow is stopped and one last `photon join --until-caught-up --drain`
decides the clicks still waiting for their query.

Then the same logs (same seed, rate and length) are joined by a single long `photon join` process, with the DAG's
own settings (``local[*]``, 1 s trigger, 120 s maximum join delay), for comparison.

Figures, for both: the gap at each hand-over (from the registry's batch metrics: the first batch of a lease against
the last batch of the lease before, as `photon status` shows it), the first batch of each lease against the median
batch, the click latency p50/p99/max from the audit (from the click's own timestamp to its joined row), the p99 of
the clicks stamped within 5 s of a hand-over, why each lease started and how long leases joined on for a starting
standby (from the task logs), the audit's verdict, and the load average during the run with the busiest processes
that were not ours. Last line: JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bench.handover import admin_dsn, generate, lease_running
from photon.logs import tables
from photon.pg import autocommit, create_database, drop_database
from photon.registry.admin import init_registry
from photon.tools.audit import audit

US = 1_000_000
ROOT = Path(__file__).resolve().parents[1]
DAGS = ("photon_join_dc_a", "photon_join_dc_a_standby")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Load:
    """The load average every 2 s, and the busiest processes that are not this benchmark's own, every 10 s."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []  # (time, 1-minute load)
        self.others: dict[int, tuple[float, str]] = {}  # pid -> (highest CPU % seen, command)
        self._procs: dict[int, psutil.Process] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        tick = 0
        while not self._stop.wait(2.0):
            self.samples.append((time.time(), os.getloadavg()[0]))
            tick += 1
            if tick % 5 == 0:
                self._busy()

    def _busy(self) -> None:
        me = psutil.Process()
        ours = {me.pid} | {p.pid for p in me.children(recursive=True)}
        for p in psutil.process_iter(["pid", "cmdline"]):
            if p.pid in ours:
                continue
            known = self._procs.setdefault(p.pid, p)
            with contextlib.suppress(psutil.Error):
                cpu = known.cpu_percent(None)  # since the last sample (0.0 the first time)
                if cpu >= 10:
                    cmd = " ".join(p.info["cmdline"] or [])[:120]
                    self.others[p.pid] = (max(cpu, self.others.get(p.pid, (0.0, ""))[0]), cmd)

    def summary(self, since: float, until: float) -> dict[str, Any]:
        window = [v for t, v in self.samples if since <= t <= until] or [os.getloadavg()[0]]
        busiest = sorted(self.others.values(), reverse=True)[:5]
        return {
            "load_1m_mean": round(statistics.fmean(window), 2),
            "load_1m_max": round(max(window), 2),
            "other_busy_processes": [f"{cpu:.0f}% {cmd}" for cpu, cmd in busiest],
        }


def _join(logs: Path, out: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "photon", "join", "--dc", "dc-a", "--logs", str(logs), "--out", str(out), *args]
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"photon join {' '.join(args)} failed:\n{(r.stdout + r.stderr)[-3000:]}")
    return r


def _idle(dsn: str) -> bool:
    """No lease holds the pipeline and no standby has announced itself for 3 s."""
    with autocommit(dsn) as conn, conn.cursor() as cur:
        cur.execute(
            "SELECT (SELECT count(*) FROM photon.pipelines WHERE lease_owner IS NOT NULL)"
            " + (SELECT count(*) FROM photon.standbys WHERE seen_at > now() - interval '3 seconds')"
        )
        return int(cur.fetchone()[0]) == 0


def _running(af: Airflow) -> bool:
    return any(r["state"] == "running" for d in DAGS for r in af.runs(d))


def _epoch(dsn: str) -> int:
    with autocommit(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT coalesce(max(epoch), 0) FROM photon.pipelines")
        return int(cur.fetchone()[0])


def _wait(what: str, check: Any, timeout_s: float, alive: Any = None) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if alive is not None:
            alive()
        with contextlib.suppress(OSError, ValueError, KeyError):
            if result := check():
                return result
        time.sleep(1.0)
    raise RuntimeError(f"{what}: not within {timeout_s:.0f}s")


def measure(dsn: str, out: Path, logs: Path, logs_end_us: int, last_epoch: int) -> dict[str, Any]:
    """Gaps, first batches and latency of one run, from the registry's batch metrics and the audit. Leases are the
    epochs up to ``last_epoch`` (after it: the final drain); hand-overs count while the logs flowed."""
    with autocommit(dsn) as conn, conn.cursor() as cur:
        cur.execute(
            "SELECT epoch, started_at_us, (started_at_us + duration_s * 1e6)::bigint, duration_s"
            " FROM photon.batch_metrics WHERE epoch <= %s ORDER BY batch_seq",
            (last_epoch,),
        )
        batches = cur.fetchall()
    by_epoch = [list(g) for _, g in itertools.groupby(batches, key=lambda b: b[0])]
    leases = [(g[0][1], g[-1][2], g[0][3]) for g in by_epoch]  # (first start, last end, first batch's duration)
    handovers = [(a[1], b[0]) for a, b in itertools.pairwise(leases) if b[0] <= logs_end_us]
    durations = [b[3] for b in batches]
    report = audit(out, manifest=logs / "_manifest")
    near = None
    if handovers:
        rows = tables.read(out, "joined", ["click_ts_us", "joined_at_us"], only=["dc-a"])
        ts, lat = (
            rows["click_ts_us"].to_numpy(),
            (rows["joined_at_us"].to_numpy() - rows["click_ts_us"].to_numpy()) / US,
        )
        mask = np.zeros(len(ts), bool)
        for end, start in handovers:
            mask |= (ts >= end - 5 * US) & (ts <= start + 5 * US)
        if mask.any():
            p50, p99 = np.percentile(lat[mask], [50, 99])
            near = {"clicks": int(mask.sum()), "p50": round(float(p50), 3), "p99": round(float(p99), 3)}
    return {
        "leases": len(leases),
        "handover_gaps_s": [round((start - end) / US, 2) for end, start in handovers],
        "first_batch_s": [round(first, 2) for _, _, first in leases[1:]],
        "median_batch_s": round(statistics.median(durations), 2) if durations else None,
        "latency_s": report.latency_s,
        "latency_near_handovers_s": near,
        "clicks_joined": report.outcomes.get("joined"),
        "audit_ok": report.ok,
        "failures": report.failures(),
    }


class Airflow:
    """``photon airflow`` as a subprocess, and its REST API as the admin user."""

    def __init__(self, home: Path, env: dict[str, str], metadata_db: str):
        self.home, self.port = home, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = home.parent / "photon-airflow.log"
        home.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "photon", "airflow", "--port", str(self.port), "--metadata-db", metadata_db],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=open(self.log, "wb"),  # noqa: SIM115 - closed with the process
            stderr=subprocess.STDOUT,
        )
        self.token: str | None = None

    def alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"photon airflow exited ({self.proc.returncode}):\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        return self.log.read_bytes()[-n:].decode("utf-8", "replace")

    def call(self, method: str, path: str, body: Any = None) -> Any:
        req = urllib.request.Request(
            f"{self.url}{path}", method=method, data=json.dumps(body).encode() if body else None
        )
        req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.load(r)

    def login(self) -> None:
        password = json.loads((self.home / "airflow" / "simple_auth_manager_passwords.json.generated").read_text())
        self.token = self.call("POST", "/auth/token", {"username": "admin", "password": password["admin"]})[
            "access_token"
        ]

    def runs(self, dag_id: str) -> list[dict[str, Any]]:
        return list(self.call("GET", f"/api/v2/dags/{dag_id}/dagRuns?limit=100")["dag_runs"])

    def stop(self) -> float:
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                for p in psutil.Process(self.proc.pid).children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        p.kill()
                self.proc.kill()
                self.proc.wait()
        return time.monotonic() - t0


def task_log_notes(home: Path) -> dict[str, list[str]]:
    """Why each lease started and how long leases joined on for a starting standby, from the join tasks' logs."""
    took, held = [], []
    for path in sorted((home / "airflow" / "logs").rglob("*.log")):
        text = path.read_text(errors="replace")
        took += re.findall(r"took over \((\w+)\)", text)
        held += re.findall(r"held on ([0-9.]+)s for a standby", text)
    return {"took_over": took, "held_on_s": held}


def airflow_run(work: Path, admin: str, args: argparse.Namespace) -> dict[str, Any]:
    name = f"photon_bench_af_{os.getpid()}"
    registry = create_database(admin, name)
    metadata_db = f"{name}_airflow"
    home, logs, out = work / "home", work / "logs", work / "out"
    (logs / "dc-a").mkdir(parents=True)
    init_registry({"main": registry}, num_shards=2)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env |= {
        "PHOTON_HOME": str(home),
        "PHOTON_REGISTRY_DSN": registry,
        "PHOTON_DCS": "dc-a",
        "PHOTON_JOIN_LEASE_S": str(int(args.lease)),
        "PHOTON_TASK_RETRIES": "0",  # a failed lease fails the benchmark rather than hide in a retry
        "AIRFLOW_VAR_PHOTON_LOGS": str(logs),
        "AIRFLOW_VAR_PHOTON_OUT": str(out),
        "PYTHONPATH": os.pathsep.join([str(ROOT / "plugins"), str(ROOT)]),
    }
    af: Airflow | None = None
    gen: subprocess.Popen[bytes] | None = None
    try:
        with Load() as load:
            t_start = time.time()
            af = Airflow(home, env, metadata_db)
            _wait("photon airflow ready", lambda: "ready after" in af.log.read_text(errors="replace"), 300, af.alive)
            ready_s = time.time() - t_start
            af.login()
            _wait("the join DAGs parsed", lambda: all(af.call("GET", f"/api/v2/dags/{d}") for d in DAGS), 180, af.alive)
            for d in DAGS:
                af.call("PATCH", f"/api/v2/dags/{d}", {"is_paused": False})
            t_unpaused = time.time()
            _wait("a first lease", lambda: lease_running(registry), 300, af.alive)
            first_lease_s = time.time() - t_unpaused
            t_logs = time.time()
            gen = generate(logs, env, args.seconds, args.rate, args.seed)
            while gen.poll() is None:
                af.alive()
                failed = [r for d in DAGS for r in af.runs(d) if r["state"] == "failed"]
                if failed:
                    raise RuntimeError(f"a join DAG run failed: {failed}\n{af.tail()}")
                time.sleep(5)
            logs_end_us = int(time.time() * US)
            t_end = time.time()
            # No new runs; the lease running now and the standby already warm beside it finish their terms (a run
            # created in the meantime stays queued). Then Airflow stops (SIGTERM), whatever is left of it.
            for d in DAGS:
                af.call("PATCH", f"/api/v2/dags/{d}", {"is_paused": True})
            with contextlib.suppress(RuntimeError):
                _wait("the last leases end", lambda: _idle(registry), 2 * args.lease + 300, af.alive)
                # ... and their runs are marked done (their processes exit after releasing the pipeline)
                _wait("their runs end", lambda: not _running(af), 120, af.alive)
            runs = [r for d in DAGS for r in af.runs(d)]
            stop_s = af.stop()
        notes = task_log_notes(home)
        last_epoch = _epoch(registry)
        _join(logs, out, env, "--until-caught-up", "--drain", "--max-join-delay", "30")
        result = measure(registry, out, logs, logs_end_us, last_epoch)
        return {
            **result,
            **notes,
            "dag_runs": {s: sum(r["state"] == s for r in runs) for s in sorted({r["state"] for r in runs})},
            "ready_s": round(ready_s, 1),
            "first_lease_after_unpause_s": round(first_lease_s, 1),
            "stopped_in_s": round(stop_s, 1),
            **load.summary(t_logs, t_end),
        }
    finally:
        if gen is not None and gen.poll() is None:
            gen.kill()
            gen.wait()
        if af is not None:
            af.stop()
        if not args.keep:
            drop_database(admin, metadata_db)
            drop_database(admin, name)


def single_run(work: Path, admin: str, args: argparse.Namespace) -> dict[str, Any]:
    name = f"photon_bench_af_single_{os.getpid()}"
    registry = create_database(admin, name)
    logs, out = work / "logs", work / "out"
    (logs / "dc-a").mkdir(parents=True)
    env = {**os.environ, "PHOTON_REGISTRY_DSN": registry, "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}"}
    gen: subprocess.Popen[bytes] | None = None
    proc: subprocess.Popen[str] | None = None
    try:
        init_registry({"main": registry}, num_shards=2)
        with Load() as load:
            cmd = [sys.executable, "-m", "photon", "join", "--dc", "dc-a", "--logs", str(logs), "--out", str(out)]
            cmd += ["--run-for", str(args.seconds + 30), "--master", "local[*]", "--trigger-interval", "1.0"]
            cmd += ["--max-join-delay", "120"]  # the join DAG's defaults
            proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

            def alive() -> None:
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"the single process exited:\n{proc.communicate()[0][-3000:]}")

            _wait("the lease", lambda: lease_running(registry), 300, alive)
            t_logs = time.time()
            gen = generate(logs, env, args.seconds, args.rate, args.seed)
            gen.wait()
            logs_end_us = int(time.time() * US)
            output = proc.communicate()[0]
            if proc.returncode != 0:
                raise RuntimeError(f"the single process failed:\n{output[-3000:]}")
            t_end = time.time()
        last_epoch = _epoch(registry)
        _join(logs, out, env, "--until-caught-up", "--drain", "--max-join-delay", "30")
        return {**measure(registry, out, logs, logs_end_us, last_epoch), **load.summary(t_logs, t_end)}
    finally:
        for p in (gen, proc):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        if not args.keep:
            drop_database(admin, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lease", type=float, default=60.0, help="seconds per lease (PHOTON_JOIN_LEASE_S)")
    ap.add_argument("--seconds", type=float, default=300.0, help="seconds of live logs")
    ap.add_argument("--rate", type=float, default=500.0, help="events/s")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--no-single", action="store_true", help="skip the single-process run")
    ap.add_argument("--keep", action="store_true", help="keep the work folder and the databases")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="photon-bench-handover-airflow-"))
    results: dict[str, Any] = {}
    with admin_dsn(tmp) as admin:
        print(f"load average at the start: {os.getloadavg()}", flush=True)
        results["airflow"] = airflow_run(tmp / "airflow", admin, args)
        r = results["airflow"]
        lat, near = r["latency_s"], r["latency_near_handovers_s"] or {}
        print(
            f"airflow: {r['leases']} leases ({r['dag_runs']} DAG runs; took over: {r['took_over']}; held on for a "
            f"starting standby: {r['held_on_s'] or 'never'}); hand-over gaps {r['handover_gaps_s']} s; first batch "
            f"of each lease {r['first_batch_s']} s (median batch {r['median_batch_s']} s); click latency p50 "
            f"{lat.get('p50')} s, p99 {lat.get('p99')} s, max {lat.get('max')} s; within 5 s of a hand-over p99 "
            f"{near.get('p99')} s ({near.get('clicks')} clicks); audit {'PASS' if r['audit_ok'] else r['failures']}; "
            f"load {r['load_1m_mean']} (max {r['load_1m_max']})",
            flush=True,
        )
        if not args.no_single:
            results["single"] = single_run(tmp / "single", admin, args)
            r = results["single"]
            lat = r["latency_s"]
            print(
                f"single process: click latency p50 {lat.get('p50')} s, p99 {lat.get('p99')} s, max {lat.get('max')} "
                f"s; median batch {r['median_batch_s']} s; audit {'PASS' if r['audit_ok'] else r['failures']}; load "
                f"{r['load_1m_mean']} (max {r['load_1m_max']})",
                flush=True,
            )
    print(json.dumps({"lease_s": args.lease, "seconds": args.seconds, "rate": args.rate, **results}))


if __name__ == "__main__":
    main()
