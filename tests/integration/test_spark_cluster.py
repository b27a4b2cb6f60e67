"""``photon spark up|status|down``: a Spark standalone cluster from the pyspark wheel, its processes' lives. (A join on
such a cluster: test_airflow.py's lease on a standalone cluster, started by the same code.)"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

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
    scripts); a SIGKILLed worker makes the cluster not running (exit 1), and the next up starts that worker again under
    the same master; a SIGKILLed master, and the next up stops what is left and starts anew; down leaves no process
    behind, and a second down says there was none."""
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
        # Up again: the dead worker alone starts again, as it was (the master and the other worker keep running).
        revived = photon("spark", "up", "--folder", str(folder))
        assert revived.returncode == 0 and "a master and 2 worker(s)" in revived.stdout, revived.stderr
        back = spark_cluster.running(folder)
        assert back is not None and back.master_url == first.master_url and back.state()["aliveworkers"] == 2
        assert back.processes[:2] == first.processes[:2] and back.processes[2]["pid"] != first.processes[2]["pid"]
        assert back.processes[2]["argv"] == first.processes[2]["argv"]

        os.kill(first.processes[0]["pid"], signal.SIGKILL)  # the master dies: the next up starts anew
        while spark_cluster.running(folder) is not None and time.monotonic() < deadline + 10:
            time.sleep(0.2)
        again = photon("spark", "up", "--folder", str(folder), "--workers", "1")
        assert again.returncode == 0 and "a master and 1 worker(s)" in again.stdout, again.stderr
        second = spark_cluster.running(folder)
        assert second is not None and second.master_url != first.master_url
        # The old workers were stopped, not left running (here nobody reaps them: a zombie is not alive).
        assert not [p for p in back.processes if alive(p["pid"], p["created"])]

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
        (("--memory", "1"), "at least 512m"),  # a worker exited with "Uncaught exception"
        (("--memory", "100m"), "at least 512m"),
        (("--workers", "0"), "at least one worker"),
        (("--cores", "0"), "at least one core"),
    ):
        bad = photon("spark", "up", "--folder", str(folder), *args)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and said in bad.stderr, (args, bad.stderr)
        assert spark_cluster.running(folder) is None and not (folder / "cluster.json").exists()


def spark_processes_in(folder: Path) -> list[psutil.Process]:
    """Every live Spark master or worker of ``folder`` (its log there is its output), whatever recorded it."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if not any(a.startswith("org.apache.spark.deploy.") for a in p.info["cmdline"] or []):
            continue
        with contextlib.suppress(psutil.Error):
            if any(f.path.startswith(f"{folder}/") for f in p.open_files()):
                found.append(p)
    return found


def children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@pytest.mark.parametrize(
    "signals",
    # (SIGINT alone is the first half of int-int; SIGTERM after SIGINT is swallowed as a second SIGINT is.)
    [(signal.SIGTERM,), (signal.SIGINT, signal.SIGINT)],
    ids=["term", "int-int"],
)
def test_an_up_interrupted_as_each_process_starts_leaves_none_running(tmp_path: Path, signals: tuple[int, ...]) -> None:
    """A reviewer's break: SIGINT the moment `photon spark up` had forked a process left it running, named nowhere
    (12 of 12 tries), and SIGTERM (timeout's, a service manager's) left the whole cluster. Now the process is named
    in cluster.json before an interrupt can land, and SIGTERM stops a start as Ctrl-C does: nothing is left. A second
    reviewer's: a second signal 0-50 ms after the first (a double Ctrl-C) cut the cleanup short (16 of 16)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}"}
    for n in (1, 2, 3):
        folder = tmp_path / f"spark-{n}"
        up = subprocess.Popen(
            [sys.executable, "-m", "photon", "spark", "up", "--folder", str(folder)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
        )
        try:
            deadline = time.monotonic() + 60
            while len(children(up.pid)) < n and up.poll() is None and time.monotonic() < deadline:
                pass  # as tight as it gets: the interrupt lands right after the n-th fork
            for i, sig in enumerate(signals):
                if i and sig == signals[0]:
                    time.sleep(0.005)  # the same signal twice at once is one (the kernel keeps one pending)
                up.send_signal(sig)
            up.communicate(timeout=60)
            time.sleep(0.5)
            left = spark_processes_in(folder)
            assert not left, (n, [p.cmdline()[-6:] for p in left])
            assert spark_cluster.running(folder) is None
        finally:
            for p in spark_processes_in(folder):
                p.kill()


def test_down_never_stops_a_process_that_is_not_the_clusters(tmp_path: Path) -> None:
    """A reviewer's break: a cluster.json naming another live process (a pid reused, a folder copied, a file edited)
    made `down` kill it and its group. A process is the cluster's only if it started at the recorded time and runs
    Spark's master or worker."""
    folder = tmp_path / "spark"
    folder.mkdir()
    other = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        created = psutil.Process(other.pid).create_time()
        for skew in (0.0, 0.9):
            processes = [{"role": "master", "pid": other.pid, "created": created + skew}]
            info = {"master_url": "spark://127.0.0.1:1", "ui_port": 1, "processes": processes}
            (folder / "cluster.json").write_text(json.dumps(info))
            assert spark_cluster.running(folder) is None
            down = photon("spark", "down", "--folder", str(folder))
            assert down.returncode == 0 and down.stdout.startswith("no Spark cluster runs"), down.stdout
            assert other.poll() is None, skew
    finally:
        other.kill()
        other.wait()


def test_a_folder_that_cannot_be_one_is_one_line(tmp_path: Path) -> None:
    """A reviewer's break: a file where the folder goes, or a folder under a file, printed a traceback."""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for folder in (a_file, a_file / "sub"):
        bad = photon("spark", "up", "--folder", str(folder))
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and str(folder) in bad.stderr, bad.stderr


def test_an_up_killed_right_after_a_fork_leaves_nothing_down_cannot_stop(tmp_path: Path) -> None:
    """SIGKILL cannot be held: an `up` killed between a fork and its record leaves a process cluster.json does not
    name. Each runs in the cluster's folder, and `down` stops those too."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}"}
    for n in (1, 3):
        folder = tmp_path / f"spark-{n}"
        up = subprocess.Popen(
            [sys.executable, "-m", "photon", "spark", "up", "--folder", str(folder)], env=env, cwd=ROOT
        )
        try:
            deadline = time.monotonic() + 60
            while len(children(up.pid)) < n and up.poll() is None and time.monotonic() < deadline:
                pass
            up.kill()
            up.wait()
            time.sleep(1.0)  # the forked child becomes Spark
            down = photon("spark", "down", "--folder", str(folder))
            assert down.returncode == 0, down.stderr
            time.sleep(0.5)
            assert not spark_processes_in(folder), n
        finally:
            for p in spark_processes_in(folder):
                p.kill()


def test_down_on_a_copy_of_the_folder_leaves_the_original_running(tmp_path: Path) -> None:
    """A copied folder's cluster.json names the original's processes (pids and start times alike): they are not the
    copy's, since they run in the original folder."""
    import shutil

    original, copy = tmp_path / "a", tmp_path / "b"
    try:
        assert photon("spark", "up", "--folder", str(original), "--workers", "1").returncode == 0
        shutil.copytree(original, copy)
        assert spark_cluster.running(copy) is None
        down = photon("spark", "down", "--folder", str(copy))
        assert down.stdout.startswith("no Spark cluster runs"), down.stdout
        assert spark_cluster.running(original) is not None
    finally:
        spark_cluster.stop(original, hard=True)
        spark_cluster.stop(copy, hard=True)


def test_files_where_the_cluster_writes_are_one_line(tmp_path: Path) -> None:
    """A second reviewer's: a file named logs or worker-1, or a folder named cluster.json, printed a traceback (the
    last after starting and killing a master)."""
    for name, make in (("logs", "file"), ("worker-1", "file"), ("cluster.json", "folder")):
        folder = tmp_path / name
        folder.mkdir()
        if make == "file":
            (folder / name).write_text("x")
        else:
            (folder / name).mkdir()
        bad = photon("spark", "up", "--folder", str(folder), "--workers", "1")
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and name in bad.stderr, (name, bad.stderr)
        assert not spark_processes_in(folder), name
