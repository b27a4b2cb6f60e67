"""A Spark standalone cluster on this machine (``photon spark up|down|status``): a master and workers started from the
pyspark wheel alone (``spark-class``; the wheel has no ``start-master.sh``), each a plain process in its session of
its own, on 127.0.0.1 only, every port a free one (so that several clusters run side by side). Each worker has a
working folder of its own (``worker-<n>/``: its executors' scratch space and logs), under the cluster's folder,
which also holds ``cluster.json`` (the processes, their start times, the master's URL and UI port) and the logs.

A joiner runs on it with ``photon join --master spark://127.0.0.1:<port>``, or under Airflow with the connection
``spark_default`` pointing at the master (``airflow_connection``). Executors read the logs and write the output where
the driver does: on one machine a shared folder; across machines an object store (issue 35's goal)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import psutil

from photon.tools.storage_server import alive, free_ports, kill_group

MEMORY = re.compile(r"(?P<n>[1-9][0-9]*)(?P<unit>[mgtMGT])")  # a worker's --memory, in Spark's notation
MIN_MEMORY_MB = 512  # an executor needs 450 MiB at least (300 reserved, x 1.5); a worker exits with less than 1 MiB
START_TIMEOUT_S = 90.0  # a master and two workers: 10-17 s on this machine, more under load
STOP_GRACE_S = 10.0


class SparkClusterError(RuntimeError):
    """The cluster could not start or answer; the message says why and where its logs are."""


@dataclass(frozen=True)
class Cluster:
    folder: Path
    master_url: str
    ui_port: int
    processes: list[dict[str, Any]]  # {"role", "pid", "created"}: the master first

    def state(self) -> dict[str, Any]:
        """The master's own view (its UI's ``/json/``): workers alive, cores, running and finished applications."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=5) as r:
            return dict(json.load(r))


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent


def _env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    # Loopback only, this Python for the executors' Python workers. The executors read the object store with the
    # standard AWS variables of this environment (or ``extra``'s): never from the driver.
    return {
        **os.environ,
        **(extra or {}),
        "SPARK_HOME": str(spark_home()),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,
        # The master's REST submission server would take port 6066 (or the next free one up to 6082): nothing here
        # submits through it, and a fixed port collides.
        "SPARK_MASTER_OPTS": " ".join(
            filter(None, [os.environ.get("SPARK_MASTER_OPTS"), "-Dspark.master.rest.enabled=false"])
        ),
    }


def running(folder: Path) -> Cluster | None:
    """The cluster ``cluster.json`` names, if its master and every worker are alive."""
    folder = folder.resolve()
    try:
        info = json.loads((folder / "cluster.json").read_text())
        cluster = Cluster(folder, str(info["master_url"]), int(info["ui_port"]), list(info["processes"]))
        procs = [(int(p["pid"]), float(p["created"])) for p in cluster.processes]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return cluster if procs and all(_ours(p, folder) for p in cluster.processes) else None


def start(
    folder: Path, *, workers: int = 2, cores: int = 1, memory: str = "1g", env: Mapping[str, str] | None = None
) -> Cluster:
    """Start the cluster of ``folder`` (or return the one running), its processes with this environment and ``env``.
    Two starts at once take turns; a start that fails or is interrupted stops what it started. Workers that died
    under a live master are started again as they were (the master's applications carry on: their executors come
    back on them); a cluster whose master died is stopped and started anew."""
    if workers < 1 or cores < 1:
        raise SparkClusterError("a cluster needs at least one worker of at least one core")
    m = MEMORY.fullmatch(memory)
    if m is None or int(m["n"]) * {"m": 1, "g": 1024, "t": 1024**2}[m["unit"].lower()] < MIN_MEMORY_MB:
        raise SparkClusterError(f"memory {memory!r}: at least 512m, in Spark's notation (512m, 2g)")
    folder = folder.resolve()
    with _locked(folder, create=True), _interrupted_once():
        found = running(folder) or _revive(folder, env)
        if found is not None:
            return found
        _stop_listed(folder, 0.0)  # whatever is left of a cluster whose master died
        return _start(folder, workers, cores, memory, env)


@contextlib.contextmanager
def _locked(folder: Path, *, create: bool) -> Iterator[None]:
    """The folder's start lock (starts and stops take turns); a folder that cannot be one is one line."""
    try:
        if create:
            folder.mkdir(parents=True, exist_ok=True)
        elif not folder.is_dir():
            yield
            return
        lock = open(folder / ".start.lock", "w")  # noqa: SIM115 (held for the block)
    except OSError as exc:
        raise SparkClusterError(f"{folder}: {exc.strerror or exc}") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@contextlib.contextmanager
def _interrupted_once() -> Iterator[None]:
    """Ctrl-C or SIGTERM (timeout's, a service manager's) interrupts a start, once: the start then stops what it
    started, and a second signal (a double Ctrl-C, SIGTERM after SIGINT) cannot cut that short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    interrupted = False

    def interrupt(signum: int, frame: Any) -> None:
        nonlocal interrupted
        if not interrupted:
            interrupted = True
            raise KeyboardInterrupt

    before = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _start(folder: Path, workers: int, cores: int, memory: str, env: Mapping[str, str] | None) -> Cluster:
    spark_class = str(spark_home() / "bin" / "spark-class")
    port, ui, *worker_ui = free_ports(2 + workers)
    master_url = f"spark://127.0.0.1:{port}"
    master = [spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port)]
    commands = [("master", [*master, "--webui-port", str(ui)])]
    for n in range(workers):
        work = folder / f"worker-{n + 1}"
        worker = [spark_class, "org.apache.spark.deploy.worker.Worker", master_url, "--host", "127.0.0.1"]
        worker += ["--cores", str(cores), "--memory", memory, "--webui-port", str(worker_ui[n])]
        worker += ["--work-dir", str(work)]
        commands.append((f"worker-{n + 1}", worker))
    processes: list[dict[str, Any]] = []
    started: list[subprocess.Popen[bytes]] = []  # this start's children: their pids are theirs until reaped
    info = {"master_url": master_url, "ui_port": ui, "processes": processes}
    try:
        for path in (folder / "logs", *(folder / role for role, _ in commands[1:])):
            path.mkdir(exist_ok=True)
        for role, argv in commands:
            processes.append({"role": role, "argv": argv})
            _spawn(folder, info, len(processes) - 1, env, started)
        return _wait(Cluster(folder, master_url, ui, processes), workers, started)
    except BaseException as exc:
        _undo(folder, started)
        with contextlib.suppress(OSError):  # missing, or a folder of that name (the start's error says)
            (folder / "cluster.json").unlink()
        if isinstance(exc, OSError):
            raise SparkClusterError(f"{exc.filename or folder}: {exc.strerror or exc}") from None
        raise


def _revive(folder: Path, env: Mapping[str, str] | None) -> Cluster | None:
    """Start the dead workers of a cluster whose master is alive again, each with its recorded command (its folder,
    cores, memory and ports); None if the master is not alive (or the record predates the commands)."""
    try:
        info = json.loads((folder / "cluster.json").read_text())
        processes = list(info["processes"])
        cluster = Cluster(folder, str(info["master_url"]), int(info["ui_port"]), processes)
        if not processes or processes[0]["role"] != "master" or not all(p.get("argv") for p in processes):
            return None
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    if not _ours(processes[0], folder):
        return None
    started: list[subprocess.Popen[bytes]] = []
    try:
        for i, p in enumerate(processes):
            if not _ours(p, folder):
                _spawn(folder, info, i, env, started)
        return _wait(cluster, len(processes) - 1, started)
    except BaseException as exc:
        _undo(folder, started)  # the workers this revival started; the master and the live ones keep running
        if isinstance(exc, OSError):
            raise SparkClusterError(f"{exc.filename or folder}: {exc.strerror or exc}") from None
        raise


def _spawn(
    folder: Path,
    info: dict[str, Any],
    i: int,
    env: Mapping[str, str] | None,
    started: list[subprocess.Popen[bytes]],
) -> None:
    """Start process ``i`` of ``info["processes"]`` (its role and argv) and record its pid and start time."""
    p = info["processes"][i]
    # An interrupt between the fork and the record would leave a process nothing names: held until it is named in
    # cluster.json (before it answers, so that `photon spark down` can always find it).
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        with open(folder / "logs" / f"{p['role']}.log", "wb") as log:  # this start's: its reason is not an old one
            proc = subprocess.Popen(
                p["argv"],
                env=_env(env),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=folder,
                # The child would inherit the held signals: Spark's threads with SIGINT and SIGTERM blocked.
                preexec_fn=partial(signal.pthread_sigmask, signal.SIG_SETMASK, held),
            )
        started.append(proc)
        p |= {"pid": proc.pid, "created": psutil.Process(proc.pid).create_time()}
        _write_json(folder / "cluster.json", info)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _wait(cluster: Cluster, workers: int, started: list[subprocess.Popen[bytes]]) -> Cluster:
    """Wait until the master counts ``workers`` workers alive; a process of this start that exits fails it."""
    logs = cluster.folder / "logs"
    roles = {p["pid"]: p["role"] for p in cluster.processes}
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        dead = [roles[proc.pid] for proc in started if proc.poll() is not None]
        if dead:
            said = _last_line(logs / f"{dead[0]}.log")
            raise SparkClusterError(f"the Spark cluster's {', '.join(dead)} exited at start: {said} (logs {logs})")
        with contextlib.suppress(OSError, ValueError):
            if cluster.state().get("aliveworkers", 0) >= workers:
                return cluster
        if time.monotonic() > deadline:
            raise SparkClusterError(
                f"the Spark cluster did not have {workers} worker(s) alive after {START_TIMEOUT_S:.0f} s (logs {logs})"
            )
        time.sleep(0.5)


def _undo(folder: Path, started: list[subprocess.Popen[bytes]]) -> None:
    """Stop what a failed or interrupted start started (a second signal cannot interrupt this: _interrupted_once
    swallows it)."""
    for proc in reversed(started):  # by the child itself: one that has not exec'd Spark yet is stopped too
        kill_group(proc.pid, 0.0)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()
    _stop_strays(folder, keep=_listed_alive(folder))  # a revival's: the master and live workers keep running


def _strays(folder: Path, keep: frozenset[int] = frozenset()) -> list[psutil.Process]:
    """Spark masters and workers running in ``folder`` (each is started there) that cluster.json may not name: an
    `up` SIGKILLed between a fork and its record leaves one. Not those in ``keep``."""
    found = []
    for proc in psutil.process_iter(["cmdline", "cwd", "status"]):
        if proc.info["status"] == psutil.STATUS_ZOMBIE or proc.info["cwd"] != str(folder) or proc.pid in keep:
            continue
        if any(a.startswith("org.apache.spark.deploy.") for a in proc.info["cmdline"] or []):
            found.append(proc)
    return found


def _stop_strays(folder: Path, grace_s: float = 0.0, keep: frozenset[int] = frozenset()) -> bool:
    strays = _strays(folder, keep)
    for proc in strays:
        kill_group(proc.pid, grace_s)
    return bool(strays)


def _listed_alive(folder: Path) -> frozenset[int]:
    """The pids of the processes cluster.json names that are alive and its own."""
    try:
        processes = json.loads((folder / "cluster.json").read_text())["processes"]
    except (OSError, ValueError, TypeError, KeyError):
        return frozenset()
    return frozenset(int(p["pid"]) for p in processes if _ours(p, folder))


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value, indent=2))
    os.replace(tmp, path)  # whole or not at all: a start killed mid-write leaves the last list


def _ours(p: Mapping[str, Any], folder: Path) -> bool:
    """Whether a process cluster.json names is alive and is that Spark process: started at the recorded time (to a
    clock tick) and running Spark's master or worker, never another process given its pid since."""
    try:
        proc = psutil.Process(int(p["pid"]))
        return (
            alive(proc.pid)
            and abs(proc.create_time() - float(p["created"])) < 0.02
            and any(a.startswith("org.apache.spark.deploy.") for a in proc.cmdline())
            and proc.cwd() == str(folder)  # not another folder's (a copy of this one names the same processes)
        )
    except (psutil.Error, ValueError, TypeError, KeyError):
        return False


def _last_line(log: Path) -> str:
    """What a process said last before it exited (Spark's reason is its last line, or an exception's first)."""
    lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    reason = next((x for x in lines if "Exception" in x or "Error" in x), lines[-1] if lines else "no output")
    return reason[:300]


def _stop_listed(folder: Path, grace_s: float) -> bool:
    """Stop every process ``cluster.json`` names (workers first) that is still the one started; True if any was."""
    try:
        processes = json.loads((folder / "cluster.json").read_text())["processes"]
    except (OSError, ValueError, TypeError, KeyError):
        processes = []
    live = [p for p in reversed(processes) if _ours(p, folder)]
    for p in live:
        kill_group(int(p["pid"]), grace_s)
    stray = _stop_strays(folder, grace_s)  # started by an `up` killed before it could name them
    with contextlib.suppress(OSError):
        (folder / "cluster.json").unlink()
    return bool(live) or stray


def stop(folder: Path, *, hard: bool = False) -> bool:
    """Stop the folder's cluster (SIGKILL at once with ``hard``); False if none of it was running."""
    folder = folder.resolve()
    with _locked(folder, create=False):
        return _stop_listed(folder, 0.0 if hard else STOP_GRACE_S)


def airflow_connection(cluster: Cluster) -> str:
    """``AIRFLOW_CONN_SPARK_DEFAULT``'s value for this cluster (the join DAGs submit to ``spark_default``)."""
    host, port = cluster.master_url.rsplit(":", 1)
    return json.dumps({"conn_type": "spark", "host": host, "port": int(port)})
