"""``photon spark up|status|down``: a Spark standalone cluster from the pyspark wheel, its processes' lives. (A join on
such a cluster: test_airflow.py's lease on a standalone cluster, started by the same code.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from photon.tools import spark_cluster
from photon.tools.storage_server import alive

ROOT = Path(__file__).resolve().parents[2]


def photon(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}", "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "photon", *args], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT
    )


def test_up_status_down_and_a_worker_killed(tmp_path: Path) -> None:
    """Up: a master and two workers, each worker in a folder of its own, all on loopback; status says so (JSON for
    scripts); a SIGKILLed worker makes the cluster not running (exit 1), and the next up stops what is left and starts
    it anew; down leaves no process behind, and a second down says there was none."""
    folder = tmp_path / "spark"
    try:
        up = photon("spark", "up", "--folder", str(folder))
        assert up.returncode == 0, up.stderr
        assert "a master and 2 worker(s)" in up.stdout and "photon join --master spark://127.0.0.1:" in up.stdout
        status = photon("spark", "status", "--folder", str(folder), "--json")
        info = json.loads(status.stdout)
        assert status.returncode == 0 and info["running"] and info["alive_workers"] == 2 and info["cores"] == 2, info
        first = spark_cluster.running(folder)
        assert first is not None and [p["role"] for p in first.processes] == ["master", "worker-1", "worker-2"]
        for p in first.processes:
            proc = psutil.Process(p["pid"])
            listening = [c.laddr.ip for c in proc.net_connections() if c.status == psutil.CONN_LISTEN]
            assert listening and set(listening) <= {"127.0.0.1", "::ffff:127.0.0.1"}, (p["role"], listening)
        assert (folder / "worker-1").is_dir() and (folder / "worker-2").is_dir()

        os.kill(first.processes[2]["pid"], signal.SIGKILL)  # a worker dies
        deadline = time.monotonic() + 10
        while spark_cluster.running(folder) is not None and time.monotonic() < deadline:
            time.sleep(0.2)
        status = photon("spark", "status", "--folder", str(folder))
        assert status.returncode == 1 and "no Spark cluster runs" in status.stdout, status.stdout
        again = photon("spark", "up", "--folder", str(folder), "--workers", "1")
        assert again.returncode == 0 and "a master and 1 worker(s)" in again.stdout, again.stderr
        second = spark_cluster.running(folder)
        assert second is not None and second.master_url != first.master_url
        # The old master and worker were stopped, not left running (here nobody reaps them: a zombie is not alive).
        assert not [p for p in first.processes if alive(p["pid"], p["created"])]

        down = photon("spark", "down", "--folder", str(folder))
        assert down.returncode == 0 and "stopped" in down.stdout, down.stderr
        assert not [p for p in second.processes if alive(p["pid"], p["created"])]
        assert photon("spark", "down", "--folder", str(folder)).stdout.startswith("no Spark cluster runs")
    finally:
        spark_cluster.stop(folder, hard=True)


def test_bad_sizes_are_one_line_and_start_nothing(tmp_path: Path) -> None:
    """Memory Spark could not parse (its worker would exit printing its usage), no worker or no core: one line, and no
    process started."""
    folder = tmp_path / "spark"
    for args, said in (
        (("--memory", "lots"), "memory 'lots'"),
        (("--workers", "0"), "at least one worker"),
        (("--cores", "0"), "at least one core"),
    ):
        bad = photon("spark", "up", "--folder", str(folder), *args)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and said in bad.stderr, (args, bad.stderr)
        assert spark_cluster.running(folder) is None and not (folder / "cluster.json").exists()
