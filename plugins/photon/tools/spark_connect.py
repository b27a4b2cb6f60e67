"""``photon spark-connect``: a Spark Connect server on this machine, kept warm for short joiner processes.

A backfill task is one ``photon join --until-caught-up`` process: on its own it pays Python's and Spark's start (a
JVM, a SparkContext, the Python workers' imports: 7-10 s) before its first batch, more than the batch itself on an
hour of logs. With ``photon join --connect`` the process is a Spark Connect client of this server instead: the JVM
and its executors are already running and warm, and the process pays a gRPC session (about 0.3 s). Spark Connect
gives each client session Python workers of its own (their pool is keyed by the session's environment), forked at
the session's first task: a session pays its workers' imports, and its EventStore caches last as long as it does.

The server is Spark's own (``org.apache.spark.sql.connect.service.SparkConnectServer``, in the pyspark wheel), run
through spark-submit in local mode with the project's driver options; bound to 127.0.0.1 and answering only clients
that present its token (``spark.connect.authenticate.token``, given in the environment, not on the command line), a
random one made once per PHOTON_HOME in ``spark-connect/token`` (mode 600). Once it answers, a warm-up job runs the
joiner's task code through the JVM's Arrow and shuffle paths; then ``spark-connect/url`` (mode 600) names its address
and the fingerprint of the photon code it runs, which ``photon join --connect`` reads (``connection``), with the
token. A joiner whose code differs does not use it (``connection`` says so; a backfill task then starts its own
Spark), and a task that reaches a worker with other code anyway (or another copy of its adapter) is refused there
(``photon.joiner.common.check_code``): restart the server after changing the code. SIGTERM
or SIGINT stops it (its whole process group), and removes the url file.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from photon.durable import secret_file
from photon.spark_session import driver_java_options

SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
DEFAULT_PORT = 15002
TOKEN_ENV = "SPARK_CONNECT_AUTHENTICATE_TOKEN"  # the server's, and a client's when its URL names no token
START_TIMEOUT_S = 120.0
STOP_GRACE_S = 15.0
ROOT = Path(__file__).resolve().parents[3]


class NoServerError(RuntimeError):
    pass


def folder(home: Path) -> Path:
    return home / "spark-connect"


def connection(home: Path) -> tuple[str, str]:
    """The running server's URL (``sc://localhost:<port>``, from ``spark-connect/url``) and its token, if its workers
    run this process's photon code. The token goes to a client in ``SPARK_CONNECT_AUTHENTICATE_TOKEN``, not in the
    URL, which Spark's errors print."""
    from photon.joiner.common import CODE_FINGERPRINT

    where = folder(home)
    try:
        text = (where / "url").read_text().strip()
        token = (where / "token").read_text().strip()
    except FileNotFoundError:
        raise NoServerError(f"no Spark Connect server under {where}: start one with `photon spark-connect`") from None
    remote, _, code = text.partition("\n")
    if code.strip() != CODE_FINGERPRINT:
        raise NoServerError(
            f"the Spark Connect server under {where} runs other photon code ({code.strip()}) than this one "
            f"({CODE_FINGERPRINT}): the checkout changed since it started; restart it (photon spark-connect)"
        )
    return remote.strip(), token


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def server_command(port: int, master: str, cores: int) -> list[str]:
    """spark-submit running Spark's Connect server: loopback only, local mode, the joiner's Python and code."""
    conf = {
        "spark.connect.grpc.binding.address": "127.0.0.1",
        "spark.connect.grpc.binding.port": str(port),
        "spark.ui.enabled": "false",
        "spark.default.parallelism": str(cores),
        "spark.sql.shuffle.partitions": "4",
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.pyspark.python": sys.executable,
        "spark.executorEnv.PYTHONPATH": os.pathsep.join([str(ROOT / "plugins"), str(ROOT)]),
    }
    cmd = [str(spark_home() / "bin" / "spark-submit"), "--master", master, "--class", SERVER_CLASS]
    cmd += ["--name", "photon-spark-connect", "--driver-java-options", driver_java_options()]
    for key, value in conf.items():
        cmd += ["--conf", f"{key}={value}"]
    return [*cmd, "spark-internal"]


def _listening(proc: subprocess.Popen[bytes], port: int) -> bool:
    """Whether the server this process started (not some other one: two deployments may race for a port) listens on
    ``port``."""
    import psutil

    try:
        root = psutil.Process(proc.pid)
        for p in [root, *root.children(recursive=True)]:
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in p.net_connections(kind="inet")):
                return True
    except psutil.Error:
        pass
    return False


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


def _warm_task(batches: Iterator[Any]) -> Iterator[Any]:
    """In each Python worker: the joiner's executor side imported, the parser run once."""
    import photon.joiner.tasks  # noqa: F401
    from photon.logs.parse import parse_file

    parse_file("warm-up", b'{"click_id": "x"}\n', "clicks")
    yield from batches


def warm_up(remote: str, token: str, cores: int) -> float:
    """A job of two stages (a shuffle between them) over 2 x ``cores`` tasks through the server: its JVM runs the
    Arrow, Python and shuffle paths once (compiled before the first joiner's batch). Seconds it took."""
    from photon.spark_session import get_spark

    t0 = time.monotonic()
    os.environ[TOKEN_ENV] = token
    spark = get_spark("photon-spark-connect-warm-up", remote=remote)
    try:
        n = 2 * cores
        (
            spark.range(0, n, 1, n)
            .mapInArrow(_warm_task, "id long")
            .repartition(cores, "id")
            .mapInArrow(_warm_task, "id long")
            .collect()
        )
    finally:
        spark.stop()
    return time.monotonic() - t0


def serve(
    home: Path,
    *,
    port: int = DEFAULT_PORT,
    master: str = "local[*]",
    say: Callable[[str], None] = print,
) -> int:
    """Run the server until SIGTERM or SIGINT; its exit status (0 once stopped by a signal)."""
    from photon.joiner.common import CODE_FINGERPRINT  # before the workers import the code

    home = home.resolve()
    where = folder(home)
    where.mkdir(parents=True, exist_ok=True)
    token = secret_file(where / "token", lambda: secrets.token_urlsafe(32))
    cores = os.cpu_count() or 2
    if master.startswith("local[") and master[6:-1].isdigit():
        cores = int(master[6:-1])
    if _answers(port):
        say(f"error: 127.0.0.1:{port} is taken (another Spark Connect server?): choose another with --port")
        return 2
    env = os.environ | {
        "SPARK_HOME": str(spark_home()),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,
        TOKEN_ENV: token,
    }
    log = where / "server.log"
    t0 = time.monotonic()
    stopping: list[int] = []

    def stop(signum: int, _frame: Any) -> None:
        stopping.append(signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    url_file = where / "url"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            server_command(port, master, cores), env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        while not _listening(proc, port):
            if proc.poll() is not None:
                say(f"error: the Spark Connect server exited with {proc.returncode} before it answered: see {log}")
                return 2
            if stopping or time.monotonic() - t0 > START_TIMEOUT_S:
                if not stopping:
                    say(
                        f"error: the Spark Connect server did not answer on 127.0.0.1:{port} in {START_TIMEOUT_S:.0f} s"
                    )
                return 0 if stopping else 2
            time.sleep(0.2)
        remote = f"sc://localhost:{port}"  # localhost: gRPC's local credentials, which carry the token
        warm_s = warm_up(remote, token, cores)
        # The URL, and the code the workers imported (the warm-up, just now, in this checkout).
        secret_file(url_file, lambda: f"{remote}\n{CODE_FINGERPRINT}", replace=True)
        say(
            f"Spark Connect on 127.0.0.1:{port} ({master}, {cores} cores): warm, up in {time.monotonic() - t0:.1f} s "
            f"(warm-up {warm_s:.1f} s); `photon join --connect` uses it; log {log}"
        )
        while not stopping and proc.poll() is None:
            time.sleep(0.2)
        if proc.poll() is not None and not stopping:
            say(f"error: the Spark Connect server exited with {proc.returncode}: see {log}")
            return 2
        return 0
    finally:
        with contextlib.suppress(FileNotFoundError):
            url_file.unlink()
        _stop_group(proc)
        for s, handler in previous.items():
            signal.signal(s, handler)
        if stopping:
            say(f"Spark Connect on 127.0.0.1:{port}: stopped")


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's process group (spark-submit, its JVM, the Python workers), SIGKILL after a grace."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=STOP_GRACE_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group is left (Python workers)
    proc.wait()
