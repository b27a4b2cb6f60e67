"""A `photon spark-connect` server for tests: started as a plain process under a PHOTON_HOME of the test's, waited
for until warm, stopped whole (its process tree) afterwards."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

from photon.registry.cluster import _free_port as free_port  # the tests' one free-port helper

ROOT = Path(__file__).resolve().parents[2]
__all__ = ["ROOT", "free_port", "spark_connect_server"]


@contextlib.contextmanager
def spark_connect_server(home: Path, log: Path, port: int) -> Iterator[subprocess.Popen[str]]:
    env = os.environ | {"PHOTON_HOME": str(home), "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "photon", "spark-connect", "--port", str(port), "--master", "local[2]"],
        env=env,
        stdout=open(log, "w"),  # noqa: SIM115 - closed with the process
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while "warm, up in" not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    child.kill()
                proc.kill()
