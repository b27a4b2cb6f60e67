"""``photon airflow`` for real, as a subprocess: Airflow's metadata on PostgreSQL (the embedded server under a
temporary PHOTON_HOME, or a database of its own on the test server), the LocalExecutor, the UI and API on 127.0.0.1
only, and SIGTERM or SIGINT to its PID leaving no process, no listening port and no embedded server behind. Then a
backfill with ``airflow backfill create`` against the running scheduler while a joiner lease runs, its runs
succeeding, its pipelines' output audited and wasting under 5% of its joins, and the whole tree stopped mid-lease."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from configparser import ConfigParser
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psutil
import psycopg2
import psycopg2.errors
import pytest
from deltalake import DeltaTable

from photon.airflow.standalone import default_parallelism, registry_connection
from photon.pg import autocommit, drop_database
from photon.registry.admin import init_registry
from photon.tools.audit import audit
from tests.integration.spark_server import free_port
from tests.readme_blocks import block_after

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
WILDCARD = {"0.0.0.0", "::", ""}


def photon_env(home: Path, **extra: str) -> dict[str, str]:
    """The caller's environment without this test session's own Airflow settings (conftest points AIRFLOW_HOME at a
    throwaway SQLite home for the in-process tests): ``photon airflow`` sets up its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env |= {"PHOTON_HOME": str(home), "PYTHONPATH": os.pathsep.join([str(ROOT / "plugins"), str(ROOT)])}
    env["PHOTON_TASK_RETRIES"] = "0"  # a failing task fails the test at once
    # The DAG files never change while a test runs: parsed once at the start, not again every 30 s (each pass forks a
    # process per file that imports the project again, about 0.8 CPU-s a file).
    env["AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL"] = "3600"
    return env | extra


class PhotonAirflow:
    """``python -m photon airflow`` started as a subprocess; every process of its tree is recorded while it runs."""

    def __init__(self, home: Path, env: dict[str, str], *args: str):
        self.home = home
        self.port = free_port()
        self.log = home.parent / f"photon-airflow-{self.port}.log"
        home.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "photon", "airflow", "--port", str(self.port), *args],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=open(self.log, "wb"),  # noqa: SIM115 - closed with the process
            stderr=subprocess.STDOUT,
        )
        self.seen: dict[int, tuple[float, str]] = {self.proc.pid: (psutil.Process(self.proc.pid).create_time(), "")}
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._record, daemon=True)
        self._watch.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _record(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(psutil.Error):
                for p in psutil.Process(self.proc.pid).children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        self.seen.setdefault(p.pid, (p.create_time(), " ".join(p.cmdline())[:150]))
            self._stop.wait(0.5)

    def tail(self, n: int = 6000) -> str:
        return self.log.read_bytes()[-n:].decode("utf-8", "replace")

    def wait_ready(self, timeout: float = 240.0) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"photon airflow exited with {self.proc.returncode}:\n{self.tail()}"
            if "ready after" in self.log.read_text(errors="replace"):
                return time.monotonic() - self.started
            time.sleep(1)
        raise AssertionError(f"not ready after {timeout}s:\n{self.tail()}")

    def alive(self) -> list[psutil.Process]:
        """Recorded processes still running (a reused pid is told apart by its start time; zombies are dead)."""
        left = []
        for pid, (created, _) in self.seen.items():
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(p)
        return left

    def listeners(self) -> list[Any]:
        pids = {p.pid for p in self.alive()}
        return [c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.pid in pids]

    def stop(self, sig: signal.Signals, timeout: float = 120.0) -> float:
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=timeout)
        finally:
            self._stop.set()
        return time.monotonic() - t0

    def kill(self) -> None:
        """Teardown: whatever survived a failed test."""
        self._stop.set()
        for p in [*self.alive()]:
            with contextlib.suppress(psutil.Error):
                p.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


@pytest.fixture
def started() -> Iterator[list[PhotonAirflow]]:
    made: list[PhotonAirflow] = []
    yield made
    for af in made:
        af.kill()


def postmaster(home: Path) -> tuple[int, str] | None:
    """The embedded server's postmaster pid and socket folder, from its postmaster.pid."""
    path = home / "postgres" / "postmaster.pid"
    if not path.exists():
        return None
    lines = path.read_text().splitlines()
    return int(lines[0]), lines[4]


def config(home: Path) -> ConfigParser:
    cfg = ConfigParser(interpolation=None)
    cfg.read(home / "airflow" / "airflow.cfg")
    return cfg


def refused(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return False
    except OSError:
        return True


def outside_address() -> str | None:
    """An IPv4 address of this machine other than loopback, if it has one."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return str(a.address)
    return None


def assert_serves_on_loopback_only(af: PhotonAirflow) -> None:
    mine = [c for c in af.listeners() if c.laddr.port == af.port]
    assert mine and {c.laddr.ip for c in mine} == {"127.0.0.1"}, mine
    wildcard = [(c.laddr, af.seen[c.pid][1]) for c in af.listeners() if c.laddr.ip in WILDCARD]
    assert not wildcard, f"listening on every interface: {wildcard}"
    if (ip := outside_address()) is not None:
        assert refused(ip, af.port), f"the API answers on {ip}"
    with urllib.request.urlopen(f"{af.url}/api/v2/monitor/health", timeout=5) as r:
        report = json.load(r)
    assert report["metadatabase"]["status"] == "healthy", report


def assert_ready_message_comes_after_the_start(af: PhotonAirflow, home: Path) -> None:
    """URL, user and password on one line, framed, after every component's first lines and the API server's start."""
    lines = af.log.read_text(errors="replace").splitlines()
    ready = next(i for i, line in enumerate(lines) if "| ready after " in line)
    password = json.loads((home / "airflow" / "simple_auth_manager_passwords.json.generated").read_text())["admin"]
    assert lines[ready].endswith(f"{af.url}  user admin  password {password}"), lines[ready]
    assert lines[ready - 1].endswith("=" * 72), lines[ready - 1]
    started = [i for i, line in enumerate(lines) if "Uvicorn running on" in line]
    assert started and started[0] < ready, lines[: ready + 1]
    for component in ("api-server", "scheduler", "dag-processor", "triggerer"):
        assert any(line.startswith(component) for line in lines[:ready]), (component, lines[: ready + 1])


# Airflow's per-task lines, which the console leaves out (QUIET_LOGGERS).
BOOKKEEPING = (
    "Worker starting up",
    "Task instance state updated",
    "::group::",
    "::endgroup::",
    "Filling up the DagBag",
    "Secrets backends loaded",
    "Using Public CAs",
    "tasks up for execution",
    "Trying to enqueue tasks",
    "Received executor event",
)


def component_connections(af: PhotonAirflow) -> dict[str, str]:
    """The registry components' connections as the scheduler (which runs the tasks) has them."""
    scheduler = next(p for p in af.alive() if p.ppid() == af.proc.pid and "scheduler" in " ".join(p.cmdline()))
    env = scheduler.environ()
    return {k: v for k, v in env.items() if k.startswith("AIRFLOW_CONN_PHOTON_REGISTRY_")}


def assert_components_run_as_their_logins(af: PhotonAirflow, home: Path, socket_dir: str) -> None:
    """On the embedded registry every component has its own connection, to a login holding only its role (a task
    that needed the owner's rights would fail here as in production), its password kept in a file only the user
    reads."""
    conns = component_connections(af)
    assert sorted(conns) == [f"AIRFLOW_CONN_PHOTON_REGISTRY_{c}" for c in ("GC", "JOINER", "RESHARD", "VERIFIER")]
    assert (home / "airflow" / "registry_logins.json").stat().st_mode & 0o777 == 0o600
    joiner = json.loads(conns["AIRFLOW_CONN_PHOTON_REGISTRY_JOINER"])
    assert joiner["login"] == "photon_joiner_login" and joiner["schema"] == "photon"
    with (
        psycopg2.connect(host=socket_dir, dbname="photon", user=joiner["login"], password=joiner["password"]) as conn,
        conn.cursor() as cur,
    ):
        cur.execute(
            "SELECT rolsuper, pg_has_role(current_user, 'photon_joiner', 'member') FROM pg_roles "
            "WHERE rolname = current_user"
        )
        assert cur.fetchone() == (False, True)
        cur.execute("SELECT count(*) FROM photon.shard_config")  # what a joiner reads
        with pytest.raises(psycopg2.errors.InsufficientPrivilege):
            cur.execute("DELETE FROM photon.owners")  # what only the verifier's fence may do


def assert_all_gone(af: PhotonAirflow) -> None:
    deadline = time.monotonic() + 10  # orphans re-parented to init are reaped there
    while af.alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not af.alive(), [(p.pid, af.seen[p.pid][1]) for p in af.alive()]
    assert len(af.seen) > 8, af.seen  # the tree was recorded: api-server, scheduler, its workers, ...
    # Nothing of this deployment listens any more. Other tests run beside this one: a pid recorded here may already
    # be another test's server, so a listener counts as ours by start time or by naming this deployment's folder (a
    # server that detached from the tree, as a postmaster or a JVM may, is never recorded).
    held = [(c.laddr, ours) for c in psutil.net_connections(kind="inet") if (ours := owned(af, c))]
    assert not held, held
    assert refused("127.0.0.1", af.port)


def owned(af: PhotonAirflow, conn: Any) -> str | None:
    """The command line of the listening socket's process if that process is this deployment's."""
    if conn.status != psutil.CONN_LISTEN or conn.pid is None:
        return None
    with contextlib.suppress(psutil.Error):
        p = psutil.Process(conn.pid)
        line = " ".join(p.cmdline())
        recorded = conn.pid in af.seen and p.create_time() == af.seen[conn.pid][0]
        return line[:150] if recorded or str(af.home) in line else None
    return None


def gone(pid: int, timeout: float = 10.0) -> bool:
    """The process has exited (a zombie waiting for init to reap it counts as exited)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def metadata_sessions(admin_dsn: str, dbname: str) -> int:
    with autocommit(admin_dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (dbname,))
        return int(cur.fetchone()[0])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm-embedded", "sigint-on-a-server"])
def test_photon_airflow_runs_on_postgres_on_loopback_and_stops_entirely(
    sig: signal.Signals,
    tmp_path: Path,
    started: list[PhotonAirflow],
    make_db: Callable[[], str],
    pg_admin_dsn: str,
) -> None:
    """SIGTERM case: no PHOTON_REGISTRY_DSN, so the embedded PostgreSQL under PHOTON_HOME holds the registry and
    Airflow's metadata (database ``airflow``), and must be stopped afterwards; a quiet console. SIGINT case: the
    registry on the test server, Airflow's metadata in a database of its own that ``photon airflow`` creates there;
    the HTTP access log asked for. Either way the ready message (URL, user, password on one line) comes once the
    components' start-up lines are out."""
    home = tmp_path / "home"
    metadata_db = f"photon_t_af_{uuid.uuid4().hex[:10]}"
    if sig == signal.SIGTERM:
        env = photon_env(home)
        env.pop("PHOTON_REGISTRY_DSN", None)
        args: tuple[str, ...] = ()
    else:
        env = photon_env(home, PHOTON_REGISTRY_DSN=make_db())
        args = ("--metadata-db", metadata_db, "--access-log")
    af = PhotonAirflow(home, env, *args)
    started.append(af)
    try:
        took = af.wait_ready()
        cfg = config(home)
        assert cfg["database"]["sql_alchemy_conn"].startswith("postgresql+psycopg2://")
        assert cfg["core"]["executor"] == "LocalExecutor"
        assert int(cfg["core"]["parallelism"]) == default_parallelism(2) >= 10
        assert_serves_on_loopback_only(af)
        assert_ready_message_comes_after_the_start(af, home)
        for _ in range(3):  # what a browser's polling does: each is one access-log line, when asked for
            with contextlib.suppress(urllib.error.HTTPError):
                urllib.request.urlopen(f"{af.url}/api/v2/dags", timeout=10).close()
        workers = [c for _, c in af.seen.values() if "LocalExecutor" in c]
        assert workers, af.seen
        pm = postmaster(home)
        if sig == signal.SIGTERM:
            assert pm is not None, "the embedded PostgreSQL is not running"
            with psycopg2.connect(host=pm[1], dbname="airflow", user="postgres") as conn, conn.cursor() as cur:
                cur.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = 'dag_run'")
                assert cur.fetchone()[0] == 1  # Airflow's schema, in its own database beside the registry's
            assert_components_run_as_their_logins(af, home, pm[1])
        else:
            assert pm is None  # nothing embedded when a server is named
            assert metadata_sessions(pg_admin_dsn, metadata_db) > 0
            # A server someone else runs: its roles are theirs; said once, at the start.
            assert component_connections(af) == {}
            said = [line for line in af.log.read_text().splitlines() if "define the connections" in line]
            assert len(said) == 1 and "photon_registry_joiner" in said[0], said

        stop_s = af.stop(sig)
        print(f"{sig.name}: ready after {took:.1f}s, stopped in {stop_s:.1f}s, {len(af.seen)} processes")
        assert af.proc.returncode == 0, af.tail()
        accessed = [line for line in af.log.read_text().splitlines() if "/api/v2/dags" in line]
        if sig == signal.SIGTERM:
            assert accessed == [], accessed  # quiet by default
        else:
            assert len(accessed) >= 3 and all("request finished" in line for line in accessed), accessed
        assert_all_gone(af)
        if sig == signal.SIGTERM:
            assert pm is not None and gone(pm[0]), "the embedded PostgreSQL still runs"
            assert postmaster(home) is None
        else:
            assert metadata_sessions(pg_admin_dsn, metadata_db) == 0
    finally:
        if sig == signal.SIGINT:
            drop_database(pg_admin_dsn, metadata_db)


class Api:
    """The REST API as the admin user."""

    def __init__(self, af: PhotonAirflow):
        self.url = af.url
        password = json.loads((af.home / "airflow" / "simple_auth_manager_passwords.json.generated").read_text())
        token = self._call("POST", "/auth/token", {"username": "admin", "password": password["admin"]}, None)
        self.token = token["access_token"]

    def _call(self, method: str, path: str, body: Any, token: str | None) -> Any:
        req = urllib.request.Request(
            f"{self.url}{path}", method=method, data=json.dumps(body).encode() if body else None
        )
        req.add_header("Content-Type", "application/json")
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.load(r)

    def __call__(self, method: str, path: str, body: Any = None) -> Any:
        return self._call(method, path, body, self.token)

    def runs(self, dag_id: str) -> list[dict[str, Any]]:
        return list(self("GET", f"/api/v2/dags/{dag_id}/dagRuns?limit=100")["dag_runs"])

    def task_states(self, dag_id: str, run_id: str) -> dict[str, str | None]:
        tis = self("GET", f"/api/v2/dags/{dag_id}/dagRuns/{urllib.parse.quote(run_id)}/taskInstances")
        return {t["task_id"]: t["state"] for t in tis["task_instances"]}


def wait_for(what: str, check: Callable[[], Any], timeout: float, af: PhotonAirflow) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert af.proc.poll() is None, f"photon airflow exited:\n{af.tail()}"
        with contextlib.suppress(urllib.error.URLError, OSError, KeyError):
            if result := check():
                return result
        time.sleep(2)
    raise AssertionError(f"{what}: not within {timeout:.0f}s\n{af.tail(12000)}")


def photon_cli(*args: str, env: dict[str, str]) -> str:
    r = subprocess.run([sys.executable, "-m", "photon", *args], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r.stdout


def run_readme_block(marker: str, home: Path, registry: str, now: datetime) -> subprocess.CompletedProcess[str]:
    """The README's code block after the line holding ``marker``, pasted into a fresh shell in the clone: ``bash``
    with no venv on PATH and no Airflow settings. Its dates are what `date` prints at ``now`` (the test's start: the
    hours it backfills are the README's), and ``.photon`` is this test's home (PHOTON_HOME) on this test's registry;
    PYTHONPATH makes `.venv/bin/photon` import this clone."""
    script = "\n".join(c.at(now).text for c in block_after(marker))
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/"), "PHOTON_HOME": str(home)}
    env |= {"PHOTON_REGISTRY_DSN": registry, "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}"}
    r = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180
    )
    assert r.returncode == 0, f"{script}\n{r.stdout[-3000:]}{r.stderr[-3000:]}"
    return r


def joined_ids(folder: Path) -> list[str]:
    if not DeltaTable.is_deltatable(str(folder / "joined")):
        return []
    return DeltaTable(str(folder / "joined")).to_pyarrow_table(columns=["click_id"])["click_id"].to_pylist()


# Three hours of history with late clicks, six spark-submit tasks and a live lease beside them: 443-543 s on a loaded
# 2-core machine, 600 s when the other pytest worker runs Spark too.
# 395 s in a full run here, about 900 s in CI's (a machine twice as slow): room for a slower one still
@pytest.mark.timeout(1800)
def test_backfill_while_a_joiner_lease_runs(
    tmp_path: Path,
    started: list[PhotonAirflow],
    make_db: Callable[[], str],
    login_as: Callable[[str, str], str],
    pg_admin_dsn: str,
) -> None:
    """History for dc-a and dc-b over three past hours, on the generator's default settings (late clicks, up to an
    hour after their query, and late query files included), live logs for dc-a joined by photon_join_dc_a's lease;
    meanwhile ``airflow backfill create --from-date H0 --to-date H2`` (both inclusive: three hourly runs) on the
    paused-by-default deployment, with nothing unpaused but the joiner. Each component reaches the registry as its own
    login only. Every late click is joined although its query is in an earlier hour (the shared query index)."""
    from photon.airflow.hooks import COMPONENT_ROLES, IdRegistryHook, component_conn_id

    t_start = time.monotonic()
    home, logs, out = tmp_path / "home", tmp_path / "logs", tmp_path / "out"
    registry = make_db()
    init_registry({"main": registry}, num_shards=4)
    env = photon_env(home, PHOTON_REGISTRY_DSN=registry)
    env |= {"AIRFLOW_VAR_PHOTON_LOGS": str(logs), "AIRFLOW_VAR_PHOTON_OUT": str(out)}
    for component, role in COMPONENT_ROLES.items():
        conn_id = component_conn_id(IdRegistryHook.default_conn_name, component)
        env[f"AIRFLOW_CONN_{conn_id.upper()}"] = registry_connection({"main": login_as(registry, role)})
    # photon_registry itself names a login that does not exist: a DAG falling back to it would fail.
    nobody = psycopg2.extensions.make_dsn(registry, user="photon_no_such_login", password="x")
    env["AIRFLOW_CONN_PHOTON_REGISTRY"] = registry_connection({"main": nobody})
    metadata_db = f"photon_t_af_{uuid.uuid4().hex[:10]}"

    now = datetime.now(UTC)  # the README's blocks are pasted "at" this time: their hours are this test's
    h0 = now.replace(minute=0, second=0, microsecond=0) - timedelta(hours=4)
    hours = [h0 + timedelta(hours=i) for i in range(3)]
    history = (h0 + timedelta(minutes=30)).isoformat()  # two hours across the three: late clicks cross both bounds
    manifest = tmp_path / "history-manifest"
    live_args = ("--mode", "live", "--duration", "400", "--rate", "300", "--dcs", "dc-a", "--seed", "12")
    live = subprocess.Popen(
        [sys.executable, "-m", "photon", "generate", "--logs", str(logs), *live_args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        af = PhotonAirflow(home, env, "--metadata-db", metadata_db)
        started.append(af)
        ready_s = af.wait_ready()
        api = Api(af)

        def all_dags() -> list[dict[str, Any]] | None:
            found = api("GET", "/api/v2/dags?limit=50")["dags"]
            # The DAG processor writes the DAGs one by one: wait for the two this test uses, not for a count.
            return found if {"photon_backfill", "photon_join_dc_a"} <= {d["dag_id"] for d in found} else None

        dags = wait_for("the DAGs parsed", all_dags, 120, af)
        paused = {d["dag_id"]: d["is_paused"] for d in dags}
        assert paused.get("photon_backfill") is False, paused  # no schedule of its own: created unpaused

        # A live joiner lease: unpause photon_join_dc_a; its lease (300 s by default) runs through the backfill.
        wait_for("unpause", lambda: api("PATCH", "/api/v2/dags/photon_join_dc_a", {"is_paused": False}), 60, af)

        def lease_running() -> dict[str, Any] | None:
            running = [r for r in api.runs("photon_join_dc_a") if r["state"] == "running"]
            states = [api.task_states("photon_join_dc_a", r["dag_run_id"]) for r in running]
            # The lease, and its standby (warm, waiting for its turn) once the scheduler has started it.
            ok = running and all(st == {"joiner_lease": "running"} for st in states)
            return running[0] if ok else None

        wait_for("a joiner lease running", lease_running, 90, af)
        # History of both data centers, which arrived hours ago (in sealed partitions the live lease, past its first
        # batch, never lists again): the backfill's.
        # (The lease's Spark session and warm-up take two minutes and more on a loaded 2-core machine.)
        wait_for("a live batch", lambda: joined_ids(out / "dc-a"), 300, af)
        # A running task's log, read as the UI reads it: the API server asks the log server of the task's host (it
        # always does for a running task), which answers on loopback, and the console shows no connection error.
        run_id = urllib.parse.quote(lease_running()["dag_run_id"])  # type: ignore[index]
        ti = api("GET", f"/api/v2/dags/photon_join_dc_a/dagRuns/{run_id}/taskInstances/joiner_lease")
        task_log = json.dumps(
            api(
                "GET",
                f"/api/v2/dags/photon_join_dc_a/dagRuns/{run_id}/taskInstances/joiner_lease/logs/{ti['try_number']}",
            )
        )
        assert "http://127.0.0.1:" in task_log and "Could not read served logs" not in task_log, task_log[-3000:]
        photon_cli(
            *("generate", "--logs", str(logs), "--mode", "historical", "--start", history, "--duration", "7200"),
            *("--rate", "6", "--dcs", "dc-a,dc-b", "--rotate", "60", "--seed", "11"),
            env=env,
        )
        shutil.copytree(logs / "_manifest", manifest, ignore=shutil.ignore_patterns("live-*"))

        # The backfill's tasks take the Spark Connect server once it is warm (before, they start their own Spark).
        wait_for("the Spark Connect server", lambda: (home / "spark-connect" / "url").exists(), 180, af)
        t_backfill = time.monotonic()
        # The README's command, as pasted at the test's start (from 4 to 2 hours back: the test's three hours).
        run_readme_block("**Backfill history**", home, registry, now)

        def backfill_done() -> list[dict[str, Any]] | None:
            runs = [x for x in api.runs("photon_backfill") if x["run_type"] == "backfill"]
            failed = [x for x in runs if x["state"] == "failed"]
            assert not failed, f"{failed}\n{af.tail(12000)}"
            return runs if len(runs) == 3 and all(x["state"] == "success" for x in runs) else None

        runs = wait_for("the backfill's runs succeed", backfill_done, 900, af)
        backfill_s = time.monotonic() - t_backfill
        assert sorted(x["data_interval_start"][:19] for x in runs) == [h.strftime("%Y-%m-%dT%H:%M:%S") for h in hours]
        for x in runs:
            assert set(api.task_states("photon_backfill", x["dag_run_id"]).values()) == {"success"}
        # Every backfill task joined on the Spark Connect server photon airflow keeps warm, not with a Spark of its own.
        task_logs = sorted((home / "airflow" / "logs" / "dag_id=photon_backfill").rglob("attempt=*.log"))
        assert len(task_logs) == 6, task_logs
        for task_log in task_logs:
            assert "joining on the warm Spark Connect server" in task_log.read_text(errors="replace"), task_log
        # The console during the backfill: the tasks' own lines and each run's end, not Airflow's per-task
        # bookkeeping (about 25 lines a task before).
        console = af.log.read_text(errors="replace").splitlines()
        bookkeeping = [line for line in console if any(b in line for b in BOOKKEEPING)]
        assert bookkeeping == [], bookkeeping[:20]
        assert sum("Marking run <DagRun photon_backfill" in line for line in console) == 3, af.tail(6000)
        # The lease ran all along and joined live clicks; the scheduler made no run of photon_backfill by itself.
        assert lease_running() is not None  # a lease (this one, or its standby that took over) runs on
        wait_for("a live batch", lambda: joined_ids(out / "dc-a"), 60, af)
        assert all(x["run_type"] == "backfill" for x in api.runs("photon_backfill"))

        pipelines = [f"backfill-{dc}-{h:%Y%m%d%H%M}" for h in hours for dc in ("dc-a", "dc-b")]
        view = tmp_path / "backfill-view"  # the auditor reads every pipeline folder under its --out
        view.mkdir()
        for name in pipelines:  # dc-a's task runs first and joins the hour; dc-b's pre-filter drops what it joined
            assert joined_ids(out / name) or name.startswith("backfill-dc-b-"), f"{name} joined nothing"
            (view / name).symlink_to(out / name)
        report = audit(view, manifest=manifest)
        assert report.ok, (report.failures(), report.unjoinable_by_reason)
        assert report.lost == 0 and report.duplicate_clicks == 0
        every = [cid for folder in out.iterdir() if not folder.name.startswith("_") for cid in joined_ids(folder)]
        assert len(every) == len(set(every)), "a click joined twice"
        # Each click of a backfilled hour is joined once, not by both data centers' tasks with one of them throwing
        # its work away at registration: the tasks run one after the other and the second one's pre-filter drops
        # what the first joined.
        with autocommit(registry) as conn, conn.cursor() as cur:
            cur.execute(
                "SELECT sum(wasted), sum(clicks), sum(prefiltered) FROM photon.batch_metrics WHERE pipeline = ANY(%s)",
                (pipelines,),
            )
            wasted, clicks, prefiltered = (int(v or 0) for v in cur.fetchone())
        assert clicks > 0 and wasted / clicks < 0.05, (wasted, clicks, prefiltered)

        # The README's data-quality check of one hour, as pasted at the test's start (3 hours back: the middle
        # backfilled one): the run passes, and its Data Docs are written.
        t_quality = time.monotonic()
        run_readme_block("To check one hour now", home, registry, now)

        def quality_done() -> list[dict[str, Any]] | None:
            runs = api.runs("photon_data_quality")
            failed = [
                (x, api.task_states("photon_data_quality", x["dag_run_id"])) for x in runs if x["state"] == "failed"
            ]
            assert not failed, f"{failed}\n{af.tail(12000)}"
            return runs if len(runs) == 1 and runs[0]["state"] == "success" else None

        runs = wait_for("the README's data-quality run", quality_done, 300, af)
        assert runs[0]["run_type"] == "manual" and runs[0]["conf"] == {"hour": f"{hours[1]:%Y-%m-%dT%H}"}, runs
        assert (out / "_quality" / "data_docs" / "index.html").is_file()
        quality_s = time.monotonic() - t_quality

        # (Re-running an hour writes nothing new: test_airflow.py's backfill test runs each interval twice.)

        # Stopped mid-lease, as a service manager would: nothing survives.
        stop_s = af.stop(signal.SIGTERM)
        assert af.proc.returncode == 0, af.tail()
        assert_all_gone(af)
        assert metadata_sessions(pg_admin_dsn, metadata_db) == 0
        console = af.tail(10**7)
        for noise in (":8793/", "ConnectError", "Could not read served logs", "HMAC key"):
            assert noise not in console, (noise, console[-5000:])
        # The tasks' lines without Airflow's context fields (the task log keeps them), and a quiet stop.
        lines = console.splitlines()
        assert not [line for line in lines if "ti_id=" in line or "try_number=" in line], console[-5000:]
        assert any("photon_join_dc_a.joiner_lease: dc-a batch" in line for line in lines), console[-5000:]
        stop = next(i for i, line in enumerate(lines) if "stopping the scheduler" in line)
        # (The whole lines: pytest's repr of a list elides the middle of a long one, which names the task.)
        assert not [line for line in lines[stop:] if "[error" in line], "\n".join(lines[stop:])
        print(
            f"ready after {ready_s:.1f}s; backfill of 3 hours beside the lease {backfill_s:.1f}s, wasted {wasted:,} of "
            f"{clicks:,} clicks read ({prefiltered:,} pre-filtered); the README's data-quality run {quality_s:.1f}s; "
            "stopped mid-lease in "
            f"{stop_s:.1f}s; {len(af.seen)} processes; whole test {time.monotonic() - t_start:.0f}s"
        )
    finally:
        live.kill()
        live.wait()
        for af in started:
            af.kill()
        drop_database(pg_admin_dsn, metadata_db)
