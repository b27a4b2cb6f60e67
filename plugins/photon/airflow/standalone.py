"""``photon airflow``: Airflow on this machine, the way a data engineer runs it on a laptop or a single server.

- Metadata on PostgreSQL, never SQLite: its own database (``airflow`` by default) on the registry's server, that is
  the embedded PostgreSQL under ``PHOTON_HOME`` or the server ``PHOTON_REGISTRY_DSN`` names (created if missing).
  ``AIRFLOW__DATABASE__SQL_ALCHEMY_CONN``, when set, is used as it is.
- The LocalExecutor, with enough slots for every data center's joiner lease (they hold a slot all the time) plus the
  backfill, data-quality, GC and verify tasks (``default_parallelism``).
- The four components run as separate processes, each in its own session: ``api-server`` (bound to 127.0.0.1 unless
  told otherwise), ``scheduler``, ``dag-processor`` and ``triggerer``; the scheduler and the triggerer without their
  log servers (Airflow's listen on every interface): instead Airflow's log server app runs on 127.0.0.1 as a fifth
  process, ``log-server``, which the API server asks for a running task's log (``log_server_options``).
- Quiet by default: the API server's HTTP access log (a line per request: every UI poll, every task heartbeat) and
  the DAG processor's per-parse bookkeeping are left out of the console, their warnings and errors kept
  (``QUIET_LOGGERS``); the DAG processor's statistics come every 5 minutes instead of 30 s. ``access_log`` brings the
  access log back, ``verbose`` all of Airflow's defaults. The tasks' own lines (a joiner's batch lines) still show:
  the LocalExecutor copies every task's log to the scheduler's output whatever the levels say. Once the API server
  answers and the components' start-up output has died down, the line with the URL, user and password comes last,
  framed.
- SIGINT or SIGTERM stops all of it: the scheduler, DAG processor and triggerer first (the task supervisors forward
  SIGTERM to their tasks, whose ``on_kill`` stops spark-submit), then the API server, which the tasks report their end
  to; whatever is left of the process tree (a task runs in its own process group, Spark's JVM and Python workers
  below it) gets SIGTERM and, after a short wait, SIGKILL. On Linux this process is a child subreaper, so a process
  whose parent died is still found in its tree. Then the embedded PostgreSQL stops (when no other process holds it).

Nothing here imports Airflow: the components are started with the ``airflow`` executable beside this Python.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psutil
import psycopg2.extensions

from photon.durable import secret_file

# Stopped first: they run the tasks. The API server goes last, so that the tasks can report how they ended.
WORKERS: dict[str, list[str]] = {
    # Not the scheduler's own log server: Airflow binds it on every interface (host '' in
    # airflow.utils.serve_logs.core), and this deployment listens on loopback only. LocalAirflow runs the same app on
    # 127.0.0.1 instead (component_commands, "log-server").
    "scheduler": ["scheduler", "--skip-serve-logs"],
    "dag-processor": ["dag-processor"],
    "triggerer": ["triggerer", "--skip-serve-logs"],
}
ROOT = Path(__file__).resolve().parents[3]
PR_SET_CHILD_SUBREAPER = 36
# Loggers whose INFO lines the console leaves out (Airflow's ``[logging] namespace_levels``): the access log, and the
# bookkeeping of every DAG parse (some 40 lines a minute: "setting next dagrun info" and the like).
ACCESS_LOGGER = "http.access"
QUIET_LOGGERS = (
    "airflow.serialization.definitions.dag",
    "airflow.models.dag",
    # Each task's bookkeeping, some 25 lines a task (596 console lines in 7.5 minutes of a three-hour backfill): the
    # scheduler queueing it, the executor's worker starting, the supervisor's secrets and the API client's CAs, the
    # task runner's "::group::" markers and DAG bag, the API server's state updates. A run's end still shows
    # (airflow.models.dagrun: "Marking run ... successful"/"failed"), and so do every warning and error.
    "airflow.jobs.scheduler_job_runner",
    "airflow.executors.local_executor",
    "airflow.api_fastapi.execution_api.routes.task_instances",
    "airflow.sdk.api.client",
    "airflow.dag_processing.dagbag",
    "airflow.dag_processing.bundles.manager",
    "supervisor",
    "task",
)
# Third-party warnings every component and airflow command repeats, about nothing this deployment does: Airflow's
# CLI without graphviz (it draws DAGs as images; nothing here asks it to: three lines before each `dags` command's
# output), pathspec's deprecation of the pattern class Airflow's .airflowignore handling uses (20 times in 7 minutes
# of a backfill). PYTHONWARNINGS entries; left in with --verbose.
QUIET_WARNINGS = (
    "ignore:Could not import graphviz:UserWarning",
    "ignore:GitWildMatchPattern:DeprecationWarning",
)
QUIET_STATS_INTERVAL_S = 300  # the DAG processor's table of files parsed (Airflow's default: every 30 s)
# How long a task's supervisor waits for the API server to answer a call (Airflow's default: 5 s, retried 5 times).
# The first task's first call timed out even on a quiet machine (the API server busy beside the DAG processor's
# first parse and the Spark Connect warm-up); under load (CI: 3 test workers on 2 cores) every try did, the task
# failed before it ran, and the scheduler logged "task state changed externally". A caller's setting wins.
EXECUTION_API_TIMEOUT_S = 30
SETTLE_S = 2.0  # the ready line waits for this long a silence of the components' output...
SETTLE_MAX_S = 15.0  # ... but no longer than this after the API server first answers


_OUTPUT = threading.Lock()  # one line at a time: the components' relays and this process's own messages

# A task's log line as the LocalExecutor copies it to the scheduler's output: time, level, message, then the task's
# logger and every field of its context (dag_id, run_id, task_id, ti_id, try_number, map_index, loc), which made a
# joiner's batch line some 450 characters wide. The task's own log file keeps all of it.
_TASK_LINE = re.compile(r"^\d{4}-\d\d-\d\d[ T](?P<hms>\d\d:\d\d:\d\d)\S* \[(?P<level>\w+)\s*\] (?P<rest>.*)$")
_TASK_CONTEXT = re.compile(r"\s+\[[\w.]+\] (?P<fields>.*\bdag_id=.*\btask_id=.*)$")
_FIELD = re.compile(r"\b(dag_id|task_id)=([^\s,]+)")
# What a task stopped by the deployment's own stop says, each a line per lease: not a failure of anything.
_STOPPED_TASK = ("Task failed with exception", "Sending kill signal to", "Received SIGTERM", "Killing subprocess")


def task_line(line: str, *, stopping: bool = False) -> str | None:
    """A task's log line for the console: ``hh:mm:ss dag_id.task_id: message`` (the level where it is not info).
    Other lines are returned as they are. While the deployment stops, a task's report of being killed is one info
    line (``stopped with the deployment``), or nothing for the rest of what it says then: the stop is on purpose."""
    m = _TASK_LINE.match(line)
    ctx = _TASK_CONTEXT.search(m.group("rest")) if m else None
    if m is None or ctx is None:
        return line
    fields = dict(_FIELD.findall(ctx.group("fields")))
    who = ".".join(filter(None, (fields.get("dag_id"), fields.get("task_id"))))
    message = m.group("rest")[: ctx.start()].rstrip()
    level = m.group("level").lower()
    if stopping and message.startswith(_STOPPED_TASK):
        return f"{m.group('hms')} {who}: stopped with the deployment" if message.startswith(_STOPPED_TASK[0]) else None
    return f"{m.group('hms')} {who}: {'' if level == 'info' else f'[{level}] '}{message}"


def emit(name: str, line: str, out: IO[str] | None = None) -> None:
    """One line of output, prefixed with who said it (as ``airflow standalone`` does)."""
    with _OUTPUT:
        stream = out or sys.stdout
        stream.write(f"{name:<13}| {line}\n")
        stream.flush()


def default_parallelism(data_centers: int, cpus: int | None = None) -> int:
    """LocalExecutor slots: two per data center for its joiner lease and the standby warming up beside it (each
    holds its slot for minutes), plus max(6, 2 per core) for the rest: a backfill run's task, the data-quality
    checkpoint, GC, verify and reshard."""
    return 2 * data_centers + max(6, 2 * (cpus or os.cpu_count() or 1))


def sqlalchemy_url(dsn: str) -> str:
    """Airflow's ``sql_alchemy_conn`` for a libpq DSN or URI (a Unix-socket host goes in the query, as libpq takes
    it)."""
    from sqlalchemy.engine import URL

    p = psycopg2.extensions.parse_dsn(dsn)
    host = p.get("host") or None
    query: dict[str, str] = {}
    if host and host.startswith("/"):
        query["host"] = host  # libpq's socket folder; the port names the socket file in it
        host = None
    for key in ("port", "sslmode", "sslrootcert", "sslcert", "sslkey", "connect_timeout"):
        if key in p and (key != "port" or host is None):
            query[key] = p[key]
    url = URL.create(
        "postgresql+psycopg2",
        username=p.get("user") or None,
        password=p.get("password") or None,
        host=host,
        port=int(p["port"]) if p.get("port") and host else None,
        database=p.get("dbname") or None,
        query=query,
    )
    return url.render_as_string(hide_password=False)


def registry_connection(servers: Mapping[str, str]) -> str:
    """The ``photon_registry`` connection (Airflow's JSON form) for the registry's servers."""
    p = psycopg2.extensions.parse_dsn(servers["main"])
    conn: dict[str, Any] = {"conn_type": "postgres", "host": p.get("host"), "login": p.get("user")}
    conn["schema"] = p.get("dbname")
    conn |= {k: v for k, v in (("port", p.get("port")), ("password", p.get("password"))) if v}
    if len(servers) > 1:
        conn["extra"] = json.dumps({"servers": {k: v for k, v in servers.items() if k != "main"}})
    return json.dumps(conn)


@dataclass(frozen=True)
class LocalAirflow:
    """What ``photon airflow`` runs, and where."""

    airflow_home: Path
    photon_home: Path
    metadata_url: str
    registry: Mapping[str, str]
    host: str = "127.0.0.1"
    port: int = 8080
    parallelism: int = 8
    grace_s: float = 30.0
    access_log: bool = False
    verbose: bool = False
    # Component -> its login's DSN on ``main`` (the embedded registry): the connections photon_registry_<component>.
    components: Mapping[str, str] = field(default_factory=dict)
    # The port of the Spark Connect server kept warm for backfill tasks (photon spark-connect); None: no server.
    spark_connect_port: int | None = None
    # The task log server's port on 127.0.0.1 (see component_commands); None: none runs.
    log_server_port: int | None = None

    @property
    def url(self) -> str:
        """Where this machine's clients (the tasks' execution API calls, the readiness check) reach the server."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def options(self) -> dict[str, dict[str, str]]:
        """This deployment's Airflow settings, by section: written into ``airflow.cfg`` (so that any ``airflow``
        command run with this ``AIRFLOW_HOME``, e.g. ``airflow backfill create``, reaches the same metadata database
        and reads the same DAGs and plugins) and given to the components in their environment."""
        options = {
            "core": {
                "dags_folder": str(ROOT / "dags"),
                "plugins_folder": str(ROOT / "plugins"),
                "load_examples": "False",
                "executor": "LocalExecutor",
                "parallelism": str(self.parallelism),
                "execution_api_server_url": f"{self.url}/execution/",
                "auth_manager": "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
            },
            "database": {"sql_alchemy_conn": self.metadata_url},
            "api": {"host": self.host, "port": str(self.port), "secret_key": self.api_secret_key()},
            "api_auth": {"jwt_secret": self.jwt_secret()},
            "workers": {"execution_api_timeout": str(EXECUTION_API_TIMEOUT_S)},
            **self.logging_options(),
        }
        for section, values in self.log_server_options().items():
            options[section] = options.get(section, {}) | values
        return options

    def log_server_options(self) -> dict[str, dict[str, str]]:
        """The API server reads a running task's log from the log server of the host the task ran on
        (``http://<ti.hostname>:<worker_log_server_port>/log/``; it always asks, even with the file in the shared
        local folder) and, with nothing there, printed three connection errors of some 230 traceback lines each per
        read. Here every task runs on this machine: its hostname is the loopback address the log server listens on."""
        if self.log_server_port is None:
            return {}
        return {
            "logging": {"worker_log_server_port": str(self.log_server_port)},
            "core": {"hostname_callable": f"{__name__}.loopback_hostname"},
        }

    def logging_options(self) -> dict[str, dict[str, str]]:
        """What the console leaves out (see the module's docstring); nothing when ``verbose``."""
        if self.verbose:
            return {}
        quiet = [*QUIET_LOGGERS, *(() if self.access_log else (ACCESS_LOGGER,))]
        return {
            "logging": {"namespace_levels": " ".join(f"{name}=warning" for name in quiet)},
            "dag_processor": {"print_stats_interval": str(QUIET_STATS_INTERVAL_S)},
        }

    def environment(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment every component runs in: the caller's, with this deployment's settings on top (a
        connection or Variable the caller set is kept)."""
        base = dict(os.environ if base is None else base)
        bin_dir = str(Path(sys.executable).parent)
        env = base | {
            f"AIRFLOW__{section.upper()}__{key.upper()}": value
            for section, values in self.options().items()
            for key, value in values.items()
        }
        timeout = "AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT"
        if base.get(timeout):
            env[timeout] = base[timeout]
        levels = "AIRFLOW__LOGGING__NAMESPACE_LEVELS"
        if base.get(levels) and levels in env and env[levels] != base[levels]:
            env[levels] = f"{env[levels]} {base[levels]}"  # the caller's levels after ours: theirs win
        if not self.verbose:  # the caller's filters after ours: theirs win
            env["PYTHONWARNINGS"] = ",".join([*QUIET_WARNINGS, *filter(None, [base.get("PYTHONWARNINGS")])])
        if "AIRFLOW_CONN_SPARK_DEFAULT" not in base:
            # local[*]: the Spark driver started by spark-submit stays on loopback (the default is the address the
            # hostname resolves to, reachable from outside). A cluster's spark_default keeps the machine's address.
            env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        components = {
            f"AIRFLOW_CONN_PHOTON_REGISTRY_{c.upper()}": registry_connection({"main": dsn})
            for c, dsn in self.components.items()
        }
        return (
            env
            | {k: base.get(k, v) for k, v in components.items()}
            | {
                "AIRFLOW_HOME": str(self.airflow_home),
                "AIRFLOW_CONN_PHOTON_REGISTRY": base.get(
                    "AIRFLOW_CONN_PHOTON_REGISTRY", registry_connection(self.registry)
                ),
                "AIRFLOW_CONN_SPARK_DEFAULT": base.get(
                    "AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[*]"})
                ),
                "AIRFLOW_VAR_PHOTON_LOGS": base.get("AIRFLOW_VAR_PHOTON_LOGS", str(self.photon_home / "logs")),
                "AIRFLOW_VAR_PHOTON_OUT": base.get("AIRFLOW_VAR_PHOTON_OUT", str(self.photon_home / "out")),
                "PHOTON_HOME": str(self.photon_home),
                "PATH": os.pathsep.join([bin_dir, base.get("PATH", "")]),
                "PYTHONPATH": os.pathsep.join([str(ROOT / "plugins"), str(ROOT)]),
            }
        )

    def jwt_secret(self) -> str:
        """The key the API server signs its tokens with and every component checks them with: 64 random bytes and
        more, made once per AIRFLOW_HOME (``jwt_secret``, mode 600), so restarts and airflow-cli agree. Airflow's own
        default is 16 bytes, which PyJWT warns is below the 64 that HS512 wants."""
        return secret_file(self.airflow_home / "jwt_secret", lambda: secrets.token_urlsafe(64))

    def api_secret_key(self) -> str:
        """The key the API server signs its requests to a task's log server with (HS512): 64 random bytes and more,
        made once per AIRFLOW_HOME (``api_secret_key``, mode 600). Airflow's own is 16 bytes, and PyJWT warns."""
        return secret_file(self.airflow_home / "api_secret_key", lambda: secrets.token_urlsafe(64))

    @property
    def config_file(self) -> Path:
        return self.airflow_home / "airflow.cfg"

    def component_commands(self) -> dict[str, list[str]]:
        airflow = str(Path(sys.executable).parent / "airflow")
        commands = {name: [airflow, *args] for name, args in WORKERS.items()}
        if self.log_server_port is not None:
            # Airflow's own log server app (what `airflow serve-logs` runs), on loopback: stopped with the API server.
            commands["log-server"] = [sys.executable, "-m", "uvicorn", "airflow.utils.serve_logs.log_server:get_app"]
            commands["log-server"] += ["--factory", "--host", "127.0.0.1", "--port", str(self.log_server_port)]
            commands["log-server"] += ["--no-access-log", "--log-level", "warning"]
        if self.spark_connect_port is not None:
            # Stopped with the API server, after the tasks that use it.
            commands["spark-connect"] = [sys.executable, "-m", "photon", "spark-connect"]
            commands["spark-connect"] += ["--port", str(self.spark_connect_port)]
        return commands | {"api-server": [airflow, "api-server", "--host", self.host, "--port", str(self.port)]}

    @property
    def password_file(self) -> Path:
        return self.airflow_home / "simple_auth_manager_passwords.json.generated"


def local_component_logins(airflow_home: Path, admin_dsn: str) -> dict[str, str]:
    """Component -> DSN of its own least-privilege login on the embedded registry, which this deployment
    administers: the logins are created (or their passwords set) from ``registry_logins.json`` in AIRFLOW_HOME
    (mode 600), so that a laptop runs every component as production does, not as the owner."""
    from photon.registry.admin import COMPONENT_ROLES, ensure_component_logins

    text = secret_file(
        airflow_home / "registry_logins.json",
        lambda: json.dumps({c: secrets.token_urlsafe(24) for c in COMPONENT_ROLES}),
    )
    return ensure_component_logins(admin_dsn, json.loads(text))


def loopback_hostname() -> str:
    """``[core] hostname_callable`` of a deployment whose every task runs on this machine: the address its task log
    server listens on (LocalAirflow.log_server_options)."""
    return "127.0.0.1"


def free_spark_connect_port() -> int:
    """A free port on loopback for the deployment's Spark Connect server (the tasks find it through the url file it
    leaves in PHOTON_HOME, not by its port; two deployments on one machine never race for 15002) or log server."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def component_connection_vars() -> list[str]:
    from photon.registry.admin import COMPONENT_ROLES

    return [f"AIRFLOW_CONN_PHOTON_REGISTRY_{c.upper()}" for c in COMPONENT_ROLES]


def embedded_component_logins(airflow_home: Path, embedded: Any | None, servers: Mapping[str, str]) -> dict[str, str]:
    """The components' own logins where this deployment administers the registry (the embedded server, alone);
    none where the registry is a server someone else runs: its roles are theirs to create (README: Deployment)."""
    if embedded is None or len(servers) != 1:
        return {}
    return local_component_logins(airflow_home, servers["main"])


def write_config(path: Path, options: Mapping[str, Mapping[str, str]]) -> None:
    """Set ``options`` in an ``airflow.cfg``, keeping every other line (Airflow's comments and defaults) as it is.
    Values are escaped for Airflow's config parser (``%`` is ``%%``)."""
    lines = path.read_text().splitlines() if path.exists() else []
    pending = {section: dict(values) for section, values in options.items()}
    out: list[str] = []
    section: str | None = None

    def flush(name: str | None) -> None:
        for key, value in pending.pop(name, {}).items() if name is not None else ():
            out.append(f"{key} = {value.replace('%', '%%')}")

    for line in lines:
        stripped = line.strip()
        if stripped.startswith("[") and stripped.endswith("]"):
            flush(section)
            section = stripped[1:-1].strip()
        elif section in pending and "=" in stripped and not stripped.startswith(("#", ";")):
            key = stripped.split("=", 1)[0].strip()
            if key in pending[section]:
                out.append(f"{key} = {pending[section].pop(key).replace('%', '%%')}")
                continue
        out.append(line)
    flush(section)
    for name in list(pending):
        out.append(f"[{name}]")
        flush(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it may hold a database password
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(out) + "\n")
    os.replace(tmp, path)


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def health(url: str, timeout: float = 2.0) -> dict[str, Any] | None:
    """The API server's ``/api/v2/monitor/health`` (no login needed), or None while it does not answer."""
    try:
        with urllib.request.urlopen(f"{url}/api/v2/monitor/health", timeout=timeout) as r:
            return dict(json.load(r))
    except (OSError, ValueError):
        return None


def is_healthy(report: Mapping[str, Any] | None) -> bool:
    if not report:
        return False
    parts = ("metadatabase", "scheduler", "triggerer", "dag_processor")
    return all((report.get(p) or {}).get("status") == "healthy" for p in parts)


def become_subreaper() -> bool:
    """Linux: orphaned descendants are re-parented to this process instead of init, so the tree stays findable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


class Supervisor:
    """Starts the components, relays their output, and stops the whole process tree."""

    def __init__(self, deployment: LocalAirflow, env: Mapping[str, str], out: IO[str] | None = None):
        self.deployment = deployment
        self.env = dict(env)
        self.out = out or sys.stdout
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._threads: list[threading.Thread] = []
        self._seen: dict[int, float] = {}  # every descendant seen: pid -> create time (a reused pid is not ours)
        self.last_output = time.monotonic()  # when a component last printed a line
        self.stopping = threading.Event()  # set by stop(): the tasks' reports of being killed are expected

    def say(self, name: str, line: str) -> None:
        emit(name, line, self.out)

    def migrate(self) -> None:
        """``airflow db migrate`` (creates or upgrades the metadata schema; idempotent)."""
        airflow = str(Path(sys.executable).parent / "airflow")
        r = subprocess.run([airflow, "db", "migrate"], env=self.env, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise RuntimeError(f"airflow db migrate failed:\n{(r.stdout + r.stderr)[-3000:]}")

    def start(self) -> None:
        for name, cmd in self.deployment.component_commands().items():
            proc = subprocess.Popen(
                cmd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own session and process group: the terminal's Ctrl-C reaches us only
            )
            self.procs[name] = proc
            t = threading.Thread(target=self._relay, args=(name, proc), daemon=True)
            t.start()
            self._threads.append(t)

    def _relay(self, name: str, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line: str | None = raw.decode("utf-8", "replace").rstrip()
            if line is not None and not self.deployment.verbose:
                line = task_line(line, stopping=self.stopping.is_set())
            if line is not None:
                self.say(name, line)
            self.last_output = time.monotonic()

    def exited(self) -> dict[str, int]:
        return {name: rc for name, p in self.procs.items() if (rc := p.poll()) is not None}

    def tree(self) -> list[psutil.Process]:
        """Every live process below this one (and any seen before whose parent died), zombies reaped."""
        me = psutil.Process()
        found: dict[int, psutil.Process] = {}
        with contextlib.suppress(psutil.Error):
            for p in me.children(recursive=True):
                found[p.pid] = p
        for pid, created in list(self._seen.items()):
            if pid not in found:
                try:
                    p = psutil.Process(pid)
                    if p.create_time() == created:
                        found[pid] = p
                except psutil.Error:
                    pass
        alive = []
        for pid, p in found.items():
            try:
                self._seen.setdefault(pid, p.create_time())
                if p.status() == psutil.STATUS_ZOMBIE:
                    self._reap(p)
                    continue
            except psutil.Error:
                continue
            alive.append(p)
        return alive

    def _reap(self, p: psutil.Process) -> None:
        if any(proc.pid == p.pid for proc in self.procs.values()):
            return  # Popen reaps its own
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(p.pid, os.WNOHANG)

    def stop(self, on_step: Callable[[str], None] | None = None) -> None:
        step = on_step or (lambda _msg: None)
        self.stopping.set()
        self.tree()  # record the tree before anything exits
        workers = [self.procs[n] for n in WORKERS if n in self.procs]
        step("stopping the scheduler, DAG processor and triggerer (running tasks get SIGTERM)")
        self._signal_groups(workers, signal.SIGTERM)
        self._wait(lambda: all(p.poll() is not None for p in workers), self.deployment.grace_s)
        self._signal_groups(workers, signal.SIGKILL)
        api = [p for n, p in self.procs.items() if n not in WORKERS]
        step("stopping the API server")
        self._signal_groups(api, signal.SIGTERM)
        self._wait(lambda: all(p.poll() is not None for p in api), 15.0)
        self._signal_groups(api, signal.SIGKILL)
        left = self.tree()
        if left:
            step(f"{len(left)} process(es) left in the tree: SIGTERM, then SIGKILL")
            self._send(left, signal.SIGTERM)
            self._wait(lambda: not self.tree(), 5.0)
            self._send(self.tree(), signal.SIGKILL)
            self._wait(lambda: not self.tree(), 5.0)
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
        for t in self._threads:
            t.join(timeout=2)

    @staticmethod
    def _signal_groups(procs: Iterable[subprocess.Popen[bytes]], sig: signal.Signals) -> None:
        for p in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, sig)  # each component leads its own process group

    @staticmethod
    def _send(procs: Iterable[psutil.Process], sig: signal.Signals) -> None:
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)

    def _wait(self, done: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self.procs.values():
                p.poll()
            if done():
                return
            time.sleep(0.2)


def data_centers() -> list[str]:
    """``PHOTON_DCS``, read as ``photon.airflow.dags.data_centers`` reads it (that module imports Airflow)."""
    return [d.strip() for d in os.environ.get("PHOTON_DCS", "dc-a,dc-b").split(",") if d.strip()]


class _Stop(Exception):
    """SIGINT, SIGTERM or SIGHUP arrived."""


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[threading.Event]:
    """SIGINT, SIGTERM and SIGHUP raise ``_Stop``, once: after the first, or once the returned event is set (the
    stopping has begun), they change nothing, so that nothing interrupts a stop half-way."""
    stopping = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        if not stopping.is_set():
            stopping.set()
            raise _Stop(signal.Signals(signum).name)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield stopping
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def run(deployment: LocalAirflow, *, say: Callable[[str], None], stopping: threading.Event) -> int:
    """Migrate, start the components, relay their output until ``_Stop`` (exit status 0) or until one exits on its
    own (its status, or 1); every process started is gone when this returns."""
    sup = Supervisor(deployment, deployment.environment())
    started = time.monotonic()
    status = 0
    try:
        if port_in_use(deployment.host, deployment.port):
            raise RuntimeError(f"port {deployment.port} on {deployment.host} is in use: choose another with --port")
        become_subreaper()
        say("migrating the metadata database (airflow db migrate)")
        sup.migrate()  # the first airflow command also writes AIRFLOW_HOME/airflow.cfg with Airflow's defaults
        write_config(deployment.config_file, deployment.options())
        sup.start()
        healthy_at: float | None = None
        ready = False
        while True:
            if gone := sup.exited():
                say(f"stopping: {', '.join(f'{n} exited with status {rc}' for n, rc in gone.items())}")
                status = next(iter(gone.values())) or 1
                break
            if healthy_at is None and is_healthy(health(deployment.url)):
                healthy_at = time.monotonic()
            now = time.monotonic()
            if (
                not ready
                and healthy_at is not None
                and (now - sup.last_output >= SETTLE_S or now - healthy_at >= SETTLE_MAX_S)
            ):
                ready = True  # last, once the components' start-up lines are out: the lines a newcomer looks for
                for line in ready_lines(deployment, healthy_at - started):
                    say(line)
            sup.tree()  # keep the record of descendants current, reap zombies
            time.sleep(0.25 if healthy_at is not None and not ready else 1.0)
    except _Stop as sig:
        say(f"{sig}: stopping every Airflow process")
    except RuntimeError as exc:
        say(f"error: {exc}")
        status = 2
    finally:
        stopping.set()
        t0 = time.monotonic()
        sup.stop(on_step=say)
        left = sup.tree()
        took = time.monotonic() - t0
        say(f"Airflow stopped in {took:.1f}s" + (f"; {len(left)} process(es) would not die" if left else ""))
    return status


def ready_lines(deployment: LocalAirflow, took_s: float) -> list[str]:
    """The ready message: URL, user and password on one line, framed so that it stands out."""
    try:
        password = str(json.loads(deployment.password_file.read_text())["admin"])
    except (OSError, ValueError, KeyError, TypeError):
        password = f"(see {deployment.password_file})"
    rule = "=" * 72
    if deployment.verbose:
        console = "  console: Airflow's own log levels (--verbose)"
    else:
        left_out = ([] if deployment.access_log else ["HTTP access log (--access-log)"]) + ["DAG-parse bookkeeping"]
        console = f"  quiet console, without: {', '.join(left_out)} (--verbose: Airflow's own levels)"
    return [
        rule,
        f"ready after {took_s:.1f}s: {deployment.url}  user admin  password {password}",
        f"  the password is kept in {deployment.password_file}",
        # `airflow` is not on a plain shell's PATH; `photon airflow-cli` is, as the README says, in the clone.
        "  other airflow commands: .venv/bin/photon airflow-cli ... (this home and environment)",
        console,
        rule,
    ]


def serve(
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    parallelism: int | None = None,
    metadata_db: str = "airflow",
    grace_s: float = 30.0,
    access_log: bool = False,
    verbose: bool = False,
    spark_connect: bool = True,
    say: Callable[[str], None] = lambda line: emit("photon", line),
) -> int:
    """``photon airflow``: the registry (initialised), Airflow's metadata database beside it, the components (with
    ``spark_connect``, a Spark Connect server for the backfill tasks); returns the exit status once everything it
    started has stopped, the embedded PostgreSQL included."""
    from photon.pg import EmbeddedPostgres, redact
    from photon.registry.admin import init_registry
    from photon.registry.client import servers_from_settings
    from photon.settings import load_settings

    settings = load_settings()
    embedded: EmbeddedPostgres | None = None
    with _stop_on_signals() as stopping:
        try:
            if settings.registry_dsn is None:
                embedded = EmbeddedPostgres(settings.home / "postgres")
                settings = settings.model_copy(update={"registry_dsn": embedded.start()})
            servers = servers_from_settings(settings)
            init_registry(servers)
            metadata = os.environ.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN") or sqlalchemy_url(
                metadata_database(embedded.admin_dsn if embedded is not None else servers["main"], metadata_db)
            )
            home = settings.home.resolve()
            airflow_home = Path(os.environ.get("AIRFLOW_HOME", str(home / "airflow"))).resolve()
            deployment = LocalAirflow(
                airflow_home=airflow_home,
                photon_home=home,
                metadata_url=metadata,
                registry=servers,
                host=host,
                port=port,
                parallelism=parallelism or default_parallelism(len(data_centers())),
                grace_s=grace_s,
                access_log=access_log,
                verbose=verbose,
                components=embedded_component_logins(airflow_home, embedded, servers),
                spark_connect_port=free_spark_connect_port() if spark_connect else None,
                # A free one: two deployments on one machine (the tests, a second AIRFLOW_HOME) never race for 8793.
                log_server_port=free_spark_connect_port(),
            )
            env = deployment.environment()
            say(f"registry: {redact(servers['main'])}")
            if not deployment.components and not any(k in env for k in component_connection_vars()):
                say(
                    "registry components run as this DSN's login: define the connections "
                    f"{', '.join(v.removeprefix('AIRFLOW_CONN_').lower() for v in component_connection_vars())} for "
                    "least privilege "
                    "(README: Deployment)"
                )
            say(f"metadata: {redact_url(metadata)}; LocalExecutor, parallelism {deployment.parallelism}")
            say(f"Airflow home: {deployment.airflow_home}; UI and API on {host}:{port}")
            say(f"logs: {env['AIRFLOW_VAR_PHOTON_LOGS']}  output: {env['AIRFLOW_VAR_PHOTON_OUT']}")
            return run(deployment, say=say, stopping=stopping)
        except _Stop as sig:
            say(f"{sig}: stopping before Airflow started")
            return 0
        except RuntimeError as exc:
            say(f"error: {exc}")
            return 2
        finally:
            stopping.set()
            if embedded is not None:
                embedded.stop()
                say(f"embedded PostgreSQL in {embedded.folder}: released (stopped unless another process holds it)")


def metadata_database(admin_dsn: str, name: str) -> str:
    """Airflow's metadata database on the registry's server, created if missing; its DSN."""
    from photon.pg import create_database, redact

    try:
        return create_database(admin_dsn, name)
    except psycopg2.Error as exc:
        raise RuntimeError(
            f"cannot create Airflow's metadata database {name!r} on {redact(admin_dsn)}: {str(exc).strip()}. Create it "
            "(or name another with --metadata-db), or set AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"
        ) from exc


def redact_url(url: str) -> str:
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # an unparsable URL is Airflow's to reject
        return "<sql_alchemy_conn>"


def airflow_cli(args: Sequence[str]) -> int:
    """``photon airflow-cli ARGS``: the ``airflow`` command beside this Python, run with ``ARGS`` against the
    deployment ``photon airflow`` runs, so that a plain shell needs neither the venv on ``PATH`` nor the right
    ``AIRFLOW_HOME``: that home (``AIRFLOW_HOME``, else ``PHOTON_HOME/airflow``, as ``serve`` picks it) and the
    environment the components get (connections, Variables, ``PYTHONPATH``). Its ``airflow.cfg``, which ``serve``
    wrote, decides every Airflow setting. Without ``PHOTON_REGISTRY_DSN`` the embedded PostgreSQL, which holds
    Airflow's metadata, is held while the command runs (started if ``photon airflow`` is not running), so that
    ``airflow dags test`` or ``airflow dags list-runs`` work on their own too. Returns the command's exit status."""
    from photon.pg import EmbeddedPostgres
    from photon.registry.client import servers_from_settings
    from photon.settings import load_settings

    settings = load_settings()
    home = settings.home.resolve()
    airflow_home = Path(os.environ.get("AIRFLOW_HOME", str(home / "airflow"))).resolve()
    if not (airflow_home / "airflow.cfg").is_file():
        raise RuntimeError(
            f"no Airflow in {airflow_home} yet (no airflow.cfg): start it once with `make airflow` (photon airflow), "
            "which writes its settings there"
        )
    embedded: EmbeddedPostgres | None = None
    try:
        if settings.registry_dsn is None:
            embedded = EmbeddedPostgres(home / "postgres")
            settings = settings.model_copy(update={"registry_dsn": embedded.start()})
        servers = servers_from_settings(settings)
        deployment = LocalAirflow(
            airflow_home=airflow_home,
            photon_home=home,
            metadata_url="",
            registry=servers,
            components=embedded_component_logins(airflow_home, embedded, servers),
        )
        # Airflow's own settings come from airflow.cfg (as serve wrote them: its port, its metadata database), not
        # from this deployment's defaults; the caller's AIRFLOW__* settings still win, as they would for `airflow`.
        env = {k: v for k, v in deployment.environment().items() if not k.startswith("AIRFLOW__") or k in os.environ}
        proc = subprocess.Popen([str(Path(sys.executable).parent / "airflow"), *args], env=env)
        with _forward_signals(proc):
            status = proc.wait()
        return status if status >= 0 else 128 - status  # killed by a signal: the shell's convention
    finally:
        if embedded is not None:
            embedded.stop()  # stops the server only if no other process (photon airflow) holds it


@contextlib.contextmanager
def _forward_signals(proc: subprocess.Popen[bytes]) -> Iterator[None]:
    """While ``proc`` runs: Ctrl-C reaches it from the terminal (same process group), so this process ignores SIGINT
    and waits for it to end; SIGTERM and SIGHUP sent to this process alone are passed on to it."""

    def forward(signum: int, _frame: Any) -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    previous = {
        signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
        signal.SIGTERM: signal.signal(signal.SIGTERM, forward),
        signal.SIGHUP: signal.signal(signal.SIGHUP, forward),
    }
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
