"""A local three-node registry cluster: one etcd and three Patroni nodes, each with its PostgreSQL, on 127.0.0.1.

For tests, benchmarks and a demo of failover on one machine. Patroni does all the failover work (leader election
in etcd, promotion, pg_rewind of a returning node); this module only writes its configuration, starts and stops
the processes, and waits until the cluster really acknowledges commits on a standby.

Everything lives under one folder: ``cluster.json`` (ports, passwords, pids), ``dsn`` (the multi-host DSN),
``pgpass`` (what the DSN's ``passfile`` names), ``etcd/``, ``nodeN/`` (Patroni's YAML, the data directory, the
socket) and ``logs/``.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import psycopg2
import psycopg2.extensions
import yaml

from photon.pg import SERVER_USER, server_user

SCOPE = "photon-registry"
NODES = ("node1", "node2", "node3")
SUPERUSER = "postgres"
REPLICATOR = "replicator"
DEBIAN_BIN_DIR = Path("/usr/lib/postgresql/15/bin")
# What `synchronous_standby_names` must look like before the cluster counts as up: a real ANY/FIRST list. Patroni
# 4.1.5 in quorum + strict mode can write `ANY None (*)` at bootstrap, which PostgreSQL rejects, leaving the primary
# acknowledging commits that no standby holds (issue 21, trap 1).
_SYNC_NAMES = re.compile(r"^(ANY|FIRST) [1-9][0-9]* \((?!None\b)[^()]+\)$")


class ClusterError(RuntimeError):
    """The local cluster could not be started, reached or stopped (one line for the operator)."""


@dataclass
class NodeStatus:
    name: str
    role: str
    state: str
    port: int
    lag: int | str | None
    sync_state: str | None


def bin_dir() -> Path:
    """PostgreSQL's binaries: the pgserver wheel's (initdb, pg_basebackup and pg_rewind included), else Debian's."""
    with contextlib.suppress(ImportError), warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset (as in photon.pg); only the package's folder is needed.
        warnings.simplefilter("ignore")
        import pgserver

        wheel = Path(pgserver.__file__).parent / "pginstall" / "bin"
        if (wheel / "pg_rewind").exists():
            return wheel
    if (DEBIAN_BIN_DIR / "pg_rewind").exists():
        return DEBIAN_BIN_DIR
    raise ClusterError("no PostgreSQL binaries: install the pgserver wheel (make setup) or postgresql-15")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _reachable_by_others(path: Path) -> bool:
    """Whether a user other than the owner can traverse to ``path`` and execute it (o+x all the way down)."""
    return all(p.stat().st_mode & 0o001 for p in [path, *path.parents])


def _python_for(user: pwd.struct_passwd | None) -> tuple[list[str], dict[str, str]]:
    """The interpreter Patroni runs on, and the environment it needs. Ours when the user can run it; as root the
    venv's Python often links into root's private home (pyenv), so then the system's Python of the same minor
    version, with the venv's packages on its path (their compiled parts are built for that minor version)."""
    if user is None or _reachable_by_others(Path(os.path.realpath(sys.executable))):
        return [sys.executable], {}
    system = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
    if not (system.exists() and _reachable_by_others(system.resolve())):
        raise ClusterError(
            f"{SERVER_USER} cannot run {sys.executable} (it lies in a private folder) and there is no {system}: "
            f"install python{sys.version_info.major}.{sys.version_info.minor} or a Python outside /root"
        )
    paths = [p for p in sys.path if p and Path(p).is_dir() and "site-packages" in p]
    # -S: without Debian's dist-packages, whose pyOpenSSL does not match the venv's cryptography.
    return [str(system), "-S"], {
        "PYTHONPATH": os.pathsep.join([os.environ.get("PYTHONPATH", ""), *paths]).strip(os.pathsep)
    }


class LocalCluster:
    """One etcd and three Patroni nodes under ``folder``. ``up()`` returns the multi-host DSN; ``down()`` stops
    everything it started. Another process can attach to a running cluster: the state is in ``cluster.json``."""

    def __init__(self, folder: Path | str):
        self.folder = Path(folder).resolve()
        self.state_path = self.folder / "cluster.json"
        self.state: dict[str, Any] = json.loads(self.state_path.read_text()) if self.state_path.exists() else {}

    # -- starting ------------------------------------------------------------------------------------------------

    def up(self, timeout: float = 120.0) -> str:
        """Start etcd and the three nodes (or what is not running of them) and wait until a primary accepts
        writes, both standbys stream and one acknowledges commits synchronously. Returns the DSN."""
        user = server_user()
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "logs").mkdir(exist_ok=True)
        if not self.state:
            self.state = {
                "etcd": {"client": _free_port(), "peer": _free_port()},
                "nodes": {n: {"pg": _free_port(), "api": _free_port()} for n in NODES},
                "superuser_password": secrets.token_urlsafe(18),
                "replication_password": secrets.token_urlsafe(18),
                "bin_dir": str(bin_dir()),
                "pids": {},
            }
            for name in NODES:
                self._write_patroni_config(name)
            self._write_pgpass()
        if user is not None:  # the processes write here as SERVER_USER
            for path in [self.folder, *self.folder.rglob("*")]:
                os.chown(path, user.pw_uid, user.pw_gid)
            for parent in self.folder.parents:  # and must reach it (as pgserver does: pytest's folders are 700)
                mode = parent.stat().st_mode
                if not mode & 0o001:
                    parent.chmod(mode | 0o001)
        self._save()
        if not self._alive("etcd"):
            self._start_etcd()
        for name in NODES:
            if not self._alive(name):
                self._start_node(name)
        self._wait_ready(timeout)
        dsn = self.dsn()
        (self.folder / "dsn").write_text(dsn + "\n")
        return dsn

    def _write_patroni_config(self, name: str) -> None:
        node = self.state["nodes"][name]
        home = self.folder / name
        home.mkdir(exist_ok=True)
        config = {
            "scope": SCOPE,
            "name": name,
            "restapi": {"listen": f"127.0.0.1:{node['api']}", "connect_address": f"127.0.0.1:{node['api']}"},
            "etcd3": {"hosts": [f"127.0.0.1:{self.state['etcd']['client']}"]},
            "bootstrap": {
                "dcs": {
                    # Patroni 4 refuses a ttl below 20 s: the leader key outlives a dead primary by up to that
                    # long, which is most of a failover's time.
                    "ttl": 20,
                    "loop_wait": 2,
                    # Must stay below ttl - loop_wait: a primary that cannot reach etcd for this long demotes
                    # itself before its key expires and another node is promoted.
                    "retry_timeout": 9,
                    # A standby further behind than this is not promoted (with quorum commit, one in the quorum
                    # holds every acknowledged commit, and Patroni promotes only from the quorum).
                    "maximum_lag_on_failover": 1048576,
                    # Every commit waits for one standby of the two (ANY 1), and strict: with no standby left
                    # the primary stops acknowledging rather than commit alone.
                    "synchronous_mode": "quorum",
                    "synchronous_mode_strict": True,
                    "synchronous_node_count": 1,
                    "postgresql": {
                        # A returning old primary is rewound to the new timeline instead of re-cloned.
                        "use_pg_rewind": True,
                        "use_slots": True,
                        "parameters": {
                            "synchronous_commit": "on",
                            "wal_level": "replica",
                            "hot_standby": "on",
                            "wal_log_hints": "on",  # pg_rewind needs it (or data checksums)
                            "max_wal_senders": 10,
                            "max_replication_slots": 10,
                            "wal_keep_size": "256MB",
                            "max_connections": 200,
                            "max_pred_locks_per_transaction": 256,
                            # English server messages: the client recognises a cancelled wait for a standby in
                            # autocommit mode by its warning's text (pg.py, "acknowledged means replicated").
                            "lc_messages": "C",
                        },
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"auth-host": "scram-sha-256"}, {"auth-local": "trust"}],
            },
            "postgresql": {
                "listen": f"127.0.0.1:{node['pg']}",
                "connect_address": f"127.0.0.1:{node['pg']}",
                "data_dir": str(home / "data"),
                "bin_dir": self.state["bin_dir"],
                "pgpass": str(home / "pgpass"),
                "authentication": {
                    "superuser": {"username": SUPERUSER, "password": self.state["superuser_password"]},
                    "replication": {"username": REPLICATOR, "password": self.state["replication_password"]},
                },
                "parameters": {
                    "unix_socket_directories": str(home),  # not /var/run/postgresql, which SERVER_USER cannot write
                    "shared_buffers": "64MB",
                },
                # Only 127.0.0.1, every login with a password (the project's roles and the replication user); the
                # socket, in a folder only SERVER_USER can enter, for Patroni's own local checks.
                "pg_hba": [
                    "local all all trust",
                    f"host replication {REPLICATOR} 127.0.0.1/32 scram-sha-256",
                    "host all all 127.0.0.1/32 scram-sha-256",
                ],
            },
            "tags": {"nofailover": False, "noloadbalance": False, "clonefrom": False, "nosync": False},
        }
        path = home / "patroni.yml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        path.chmod(0o600)  # it holds the passwords

    def _write_pgpass(self) -> None:
        path = self.folder / "pgpass"
        lines = [f"127.0.0.1:{n['pg']}:*:{SUPERUSER}:{self.state['superuser_password']}" for n in self._nodes()]
        path.write_text("\n".join(lines) + "\n")
        path.chmod(0o600)  # libpq ignores a passfile others can read

    def _spawn(self, key: str, argv: list[str], env_extra: dict[str, str] | None = None) -> None:
        user = server_user()
        log = open(self.folder / "logs" / f"{key}.log", "ab")  # noqa: SIM115 - the child keeps it
        extra: dict[str, Any] = {}
        if user is not None:
            extra = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
        env = {**os.environ, "HOME": str(self.folder), **(env_extra or {})}
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.folder,
                env=env,
                start_new_session=True,  # its own process group: a Ctrl-C of `up` does not reach it
                **extra,
            )
        finally:
            log.close()
        self.state["pids"][key] = proc.pid
        self._save()

    def _start_etcd(self) -> None:
        etcd = shutil.which("etcd") or "/usr/bin/etcd"
        if not Path(etcd).exists():
            raise ClusterError("etcd is missing: make setup installs it (apt-get install etcd-server)")
        e = self.state["etcd"]
        client, peer = f"http://127.0.0.1:{e['client']}", f"http://127.0.0.1:{e['peer']}"
        self._spawn(
            "etcd",
            [
                etcd,
                "--name=photon",
                f"--data-dir={self.folder / 'etcd'}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=photon={peer}",
                "--initial-cluster-state=new",
            ],
        )
        deadline = time.monotonic() + 20
        while not self._http_ok(f"{client}/health"):
            if time.monotonic() > deadline or not self._alive("etcd"):
                raise ClusterError(f"etcd did not start: see {self.folder / 'logs' / 'etcd.log'}")
            time.sleep(0.2)

    def _start_node(self, name: str) -> None:
        python, env = _python_for(server_user())
        self._spawn(name, [*python, "-m", "patroni", str(self.folder / name / "patroni.yml")], env)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        why = "no answer yet"
        while time.monotonic() < deadline:
            for name in ("etcd", *NODES):
                if not self._alive(name):
                    raise ClusterError(f"{name} exited: see {self.folder / 'logs' / (name + '.log')}")
            why = self._not_ready()
            if not why:
                return
            time.sleep(0.5)
        raise ClusterError(f"cluster not ready after {timeout:.0f} s: {why} (logs in {self.folder / 'logs'})")

    def _not_ready(self) -> str:
        """Why the cluster is not ready yet, or '' when a primary takes writes, both standbys stream, Patroni holds
        both in its quorum (so it can promote one) and a standby acknowledges commits (a valid quorum list and a
        'quorum' or 'sync' standby in pg_stat_replication)."""
        members = self._members()
        leader = [m for m in members if m.get("role") == "leader" and m.get("state") == "running"]
        if not leader:
            return "no running primary"
        streaming = [m for m in members if m.get("role") != "leader" and m.get("state") == "streaming"]
        if len(streaming) < len(NODES) - 1:
            return f"{len(streaming)} of {len(NODES) - 1} standbys streaming"
        # Patroni promotes only a standby its /sync key lists, which it writes a few seconds after PostgreSQL names
        # the quorum: a primary lost before that leaves the cluster without one for good.
        voters = [m for m in members if m.get("role") in ("quorum_standby", "sync_standby")]
        if len(voters) < len(NODES) - 1:
            return f"{len(voters)} of {len(NODES) - 1} standbys in Patroni's quorum (a failover could not promote them)"
        try:
            with contextlib.closing(psycopg2.connect(self.dsn(), connect_timeout=3)) as conn:
                conn.autocommit = True
                with conn.cursor() as cur:
                    cur.execute("SHOW synchronous_standby_names")
                    names = str(cur.fetchone()[0])
                    cur.execute("SELECT count(*) FROM pg_stat_replication WHERE sync_state IN ('quorum', 'sync')")
                    synced = int(cur.fetchone()[0])
        except psycopg2.Error as exc:
            return f"primary not writable: {str(exc).strip()}"
        if not _SYNC_NAMES.match(names):
            return f"synchronous_standby_names is {names!r}, not a valid ANY/FIRST list"
        if synced < 1:
            return "no standby in sync_state quorum or sync"
        return ""

    # -- looking -------------------------------------------------------------------------------------------------

    def _require(self) -> None:
        if not self.state:
            raise ClusterError(f"no cluster in {self.folder}: run `photon registry cluster up --dir {self.folder}`")

    def _nodes(self) -> list[dict[str, int]]:
        return [self.state["nodes"][n] for n in NODES]

    def dsn(self, *, user: str = SUPERUSER) -> str:
        """The multi-host DSN: libpq tries the nodes in turn and keeps the one that takes writes."""
        self._require()
        ports = ",".join(str(n["pg"]) for n in self._nodes())
        return (
            f"host={','.join(['127.0.0.1'] * len(NODES))} port={ports} dbname=postgres user={user} "
            f"passfile={self.folder / 'pgpass'} target_session_attrs=read-write connect_timeout=3"
        )

    def node_dsn(self, name: str) -> str:
        """One node's DSN (for reading a standby)."""
        return (
            f"host=127.0.0.1 port={self.state['nodes'][name]['pg']} dbname=postgres user={SUPERUSER} "
            f"passfile={self.folder / 'pgpass'} connect_timeout=3"
        )

    def _http_ok(self, url: str) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return bool(r.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def _members(self) -> list[dict[str, Any]]:
        """Patroni's view of the cluster (its REST API's /cluster), from the first node that answers."""
        self._require()
        for name in NODES:
            port = self.state["nodes"][name]["api"]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/cluster", timeout=2) as r:
                    return list(json.load(r).get("members", []))
            except (OSError, ValueError):
                continue
        return []

    def primary(self) -> str | None:
        """The name of the node Patroni holds as leader, or None during a failover."""
        for m in self._members():
            if m.get("role") == "leader":
                return str(m["name"])
        return None

    def status(self) -> list[NodeStatus]:
        members = {m["name"]: m for m in self._members()}
        sync: dict[str, str] = {}
        with (
            contextlib.suppress(psycopg2.Error),
            contextlib.closing(psycopg2.connect(self.dsn(), connect_timeout=3)) as conn,
            conn.cursor() as cur,
        ):
            cur.execute("SELECT application_name, sync_state FROM pg_stat_replication")
            sync = {str(a): str(s) for a, s in cur.fetchall()}
        out = []
        for name in NODES:
            m = members.get(name, {})
            out.append(
                NodeStatus(
                    name=name,
                    role=str(m.get("role", "down")),
                    state=str(m.get("state", "not in the cluster" if self._alive(name) else "stopped")),
                    port=int(self.state["nodes"][name]["pg"]),
                    lag=m.get("lag"),
                    sync_state=sync.get(name),
                )
            )
        return out

    def wait_replayed(self, timeout: float = 30.0) -> None:
        """Wait until every streaming standby has replayed the primary's WAL as of now, so that a database or login
        just made on the primary exists on every node: libpq's multi-host DSN stops at a standby that refuses a
        database or user name it does not know yet, before it reaches the primary."""
        with contextlib.closing(psycopg2.connect(self.dsn(), connect_timeout=3)) as conn:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute("SELECT pg_current_wal_lsn()::text")
                lsn = str(cur.fetchone()[0])
        standbys = [
            str(m["name"]) for m in self._members() if m.get("role") != "leader" and m.get("state") == "streaming"
        ]
        deadline = time.monotonic() + timeout
        for name in standbys:
            while True:
                with (
                    contextlib.suppress(psycopg2.Error),
                    contextlib.closing(psycopg2.connect(self.node_dsn(name), connect_timeout=3)) as conn,
                ):
                    conn.autocommit = True
                    with conn.cursor() as cur:
                        cur.execute("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (lsn,))
                        if cur.fetchone()[0]:
                            break
                if time.monotonic() > deadline:
                    raise ClusterError(f"{name} has not replayed the primary's WAL up to {lsn} after {timeout:.0f} s")
                time.sleep(0.1)

    def wait_streaming(self, name: str, timeout: float = 60.0) -> float:
        """Wait until ``name`` is a standby streaming from the primary and a candidate for its quorum (sync_state
        quorum, sync or potential): a returning old primary has been rewound and caught up. Returns the seconds
        waited."""
        started = time.monotonic()
        while True:
            node = next(n for n in self.status() if n.name == name)
            if self._streams(node):
                return time.monotonic() - started
            if time.monotonic() - started > timeout:
                raise ClusterError(f"{name} does not stream after {timeout:.0f} s: {node}")
            time.sleep(0.5)

    def streams(self, name: str) -> bool:
        """Whether ``name`` is, right now, what ``wait_streaming`` waits for."""
        return self._streams(next(n for n in self.status() if n.name == name))

    @staticmethod
    def _streams(node: NodeStatus) -> bool:
        return (
            node.role != "leader" and node.state == "streaming" and node.sync_state in ("quorum", "sync", "potential")
        )

    # -- configuration -------------------------------------------------------------------------------------------

    def set_synchronous(self, on: bool, timeout: float = 60.0) -> None:
        """Switch Patroni's synchronous mode in the cluster's dynamic configuration (its REST API's PATCH /config)
        and wait until the primary runs it. Off is plain asynchronous streaming with automatic failover, which
        acknowledges commits no standby holds: the replication guard's case. On is this cluster's own setting
        (quorum, strict), ready as ``up`` leaves it."""
        leader = self.primary()
        if leader is None:
            raise ClusterError("no primary to reconfigure")
        body = {"synchronous_mode": "quorum" if on else False, "synchronous_mode_strict": on}
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.state['nodes'][leader]['api']}/config",
            data=json.dumps(body).encode(),
            method="PATCH",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as r:
            if r.status != 200:
                raise ClusterError(f"Patroni refused the configuration change: HTTP {r.status}")
        deadline = time.monotonic() + timeout
        why = "no answer yet"
        while time.monotonic() < deadline:
            why = self._not_ready() if on else self._not_async()
            if not why:
                return
            time.sleep(0.5)
        raise ClusterError(f"synchronous mode {'on' if on else 'off'} not in effect after {timeout:.0f} s: {why}")

    def _not_async(self) -> str:
        """'' once the primary names no synchronous standby and both standbys stream asynchronously."""
        try:
            with contextlib.closing(psycopg2.connect(self.dsn(), connect_timeout=3)) as conn:
                conn.autocommit = True
                with conn.cursor() as cur:
                    cur.execute("SHOW synchronous_standby_names")
                    names = str(cur.fetchone()[0])
                    cur.execute(
                        "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming' AND sync_state = 'async'"
                    )
                    streaming = int(cur.fetchone()[0])
        except psycopg2.Error as exc:
            return f"primary not reachable: {str(exc).strip()}"
        if names.strip():
            return f"synchronous_standby_names is still {names!r}"
        if streaming < len(NODES) - 1:
            return f"{streaming} of {len(NODES) - 1} standbys streaming asynchronously"
        return ""

    # -- faults --------------------------------------------------------------------------------------------------

    def _postmaster(self, name: str) -> psutil.Process | None:
        pid_file = self.folder / name / "data" / "postmaster.pid"
        with contextlib.suppress(OSError, ValueError, psutil.Error):
            proc = psutil.Process(int(pid_file.read_text().splitlines()[0]))
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                return proc
        return None

    def kill_primary(self, name: str | None = None) -> str:
        """SIGKILL the primary's PostgreSQL and its Patroni (a machine lost); returns the node's name. Its backends
        too: a backend outlives its postmaster for a moment and could still acknowledge a commit. ``name``: the
        primary as found before (asking Patroni takes a moment that a caller timing the kill may not have)."""
        name = name or self.primary()
        if name is None:
            raise ClusterError("no primary to kill")
        procs: list[psutil.Process] = []
        for root in (self._postmaster(name), self._process(name)):
            if root is not None:
                with contextlib.suppress(psutil.Error):
                    procs += [root, *root.children(recursive=True)]
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(procs, timeout=5)
        return name

    def restart_node(self, name: str) -> None:
        """Start a node's Patroni again (after kill_primary, or stop it first if it runs): Patroni rewinds the old
        primary onto the new timeline and it streams again."""
        self._stop([name], timeout=15)
        self._start_node(name)

    # -- stopping ------------------------------------------------------------------------------------------------

    def down(self, timeout: float = 20.0) -> None:
        """SIGTERM every process the cluster started (Patroni stops its PostgreSQL), SIGKILL what is left after
        ``timeout``; nothing keeps running."""
        self._require()
        self._stop(list(NODES), timeout=timeout)
        self._stop(["etcd"], timeout=timeout)  # last: a Patroni stopping still talks to it

    def _process(self, key: str) -> psutil.Process | None:
        pid = self.state.get("pids", {}).get(key)
        if pid is None:
            return None
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            # A recycled pid is not ours: ours runs our config or our etcd folder.
            if proc.status() != psutil.STATUS_ZOMBIE and str(self.folder) in " ".join(proc.cmdline()):
                return proc
        return None

    def _alive(self, key: str) -> bool:
        return self._process(key) is not None

    def _stop(self, keys: list[str], timeout: float) -> None:
        procs: list[psutil.Process] = []
        for key in keys:
            root = self._process(key)
            if root is not None:
                with contextlib.suppress(psutil.Error):
                    procs += [root, *root.children(recursive=True)]
            if key in NODES:
                # Patroni starts the postmaster in a session of its own: found by its pid file.
                pm = self._postmaster(key)
                if pm is not None:
                    with contextlib.suppress(psutil.Error):
                        procs += [pm, *pm.children(recursive=True)]
        # Patroni first (it shuts its PostgreSQL down cleanly), then the rest.
        roots = [p for p in (self._process(k) for k in keys) if p is not None]
        for proc in roots or procs:
            with contextlib.suppress(psutil.Error):
                proc.terminate()
        _, left = psutil.wait_procs(procs, timeout=timeout)
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(left, timeout=5)
        for key in keys:
            self.state.get("pids", {}).pop(key, None)
        if self.state:
            self._save()

    def _save(self) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=2))
        tmp.chmod(0o600)
        tmp.replace(self.state_path)
