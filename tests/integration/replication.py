"""Plain PostgreSQL servers with streaming replication, for the replication guard and failover tests: a primary, a
standby made from it by pg_basebackup, and a lone server, from the pgserver wheel's binaries (initdb, pg_ctl,
pg_basebackup). As root they run as the user ``pgserver``, as pgserver itself runs them. No manager: a test
promotes a standby itself (the project's own cluster is Patroni's; these only stage what the client must survive).
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg2

from photon.pg import autocommit, server_user
from photon.registry.cluster import _free_port, bin_dir

# The cluster's own helpers: the same binaries, the same unprivileged user as root, a free port.
_USER = server_user()
_SYSTEM_USER = _USER.pw_name if _USER is not None else None


def _bin(name: str) -> str:
    return str(bin_dir() / name)


def _run(*args: str, timeout: float = 60) -> None:
    # Output to a file, not a pipe: a pg_ctl start holding the pipe through its postmaster would hang run().
    with open(os.devnull, "wb") as sink:
        result = subprocess.run(args, stdout=sink, stderr=subprocess.PIPE, user=_SYSTEM_USER, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {result.stderr.decode(errors='replace')[-2000:]}")


def _prepare(folder: Path) -> None:
    """A folder the server's user owns, under parents it can traverse (pytest's temp folders are 0700)."""
    import pgserver.utils

    folder.mkdir(parents=True, exist_ok=True)
    if _SYSTEM_USER is not None:
        assert _USER is not None
        pgserver.utils.ensure_prefix_permissions(folder)
        os.chown(folder, _USER.pw_uid, _USER.pw_gid)
    folder.chmod(0o700)


class Node:
    """One PostgreSQL server on 127.0.0.1 (socket in its own folder)."""

    def __init__(self, folder: Path, name: str):
        self.folder, self.name = folder, name
        self.data = folder / "data"
        self.port = _free_port()

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"

    def init(self, **conf: str) -> Node:
        _prepare(self.folder)
        _run(_bin("initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "--encoding=utf8", "--no-sync")
        self._configure(conf)
        return self

    def _configure(self, conf: dict[str, str]) -> None:
        lines = {
            "listen_addresses": "'127.0.0.1'",
            "port": str(self.port),
            "unix_socket_directories": f"'{self.folder}'",
            "fsync": "off",  # test servers: a crash of the machine loses nothing a test needs
            "shared_buffers": "32MB",
            "max_connections": "60",
            "wal_level": "replica",
            "max_wal_senders": "5",
            "hot_standby": "on",
            **conf,
        }
        with open(self.data / "postgresql.auto.conf", "a") as f:
            f.writelines(f"{k} = {v}\n" for k, v in lines.items())
        with open(self.data / "pg_hba.conf", "a") as f:
            f.write("host replication all 127.0.0.1/32 trust\n")

    def prepend_hba(self, *rules: str) -> None:
        """Rules before the default ones (which trust every login from 127.0.0.1): e.g. a password for one role.
        Read by the server at its start or the next reload."""
        hba = self.data / "pg_hba.conf"
        hba.write_text("".join(f"{rule}\n" for rule in rules) + hba.read_text())
        if (self.data / "postmaster.pid").exists():
            _run(_bin("pg_ctl"), "-D", str(self.data), "reload")

    def start(self) -> Node:
        _run(_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.folder / "log"), "-w", "-t", "30", "start")
        return self

    def stop(self, mode: str = "fast") -> None:
        if (self.data / "postmaster.pid").exists():
            _run(_bin("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def promote(self) -> None:
        _run(_bin("pg_ctl"), "-D", str(self.data), "-w", "promote")

    def standby(self, folder: Path, name: str) -> Node:
        """A streaming standby of this server, reporting ``name`` as its application_name."""
        node = Node(folder, name)
        _prepare(node.folder)
        _run(_bin("pg_basebackup"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-D", str(node.data),
             "-R", "-X", "stream", "--no-sync")  # fmt: skip
        node._configure(
            {
                "primary_conninfo": f"'host=127.0.0.1 port={self.port} user=postgres application_name={name}'",
                # The copy carries the primary's standby names; promoted, it would wait for itself for ever.
                "synchronous_standby_names": "''",
            }
        )
        return node.start()

    def set(self, name: str, value: str) -> None:
        """ALTER SYSTEM + reload (synchronous_standby_names and synchronous_commit need no restart)."""
        with autocommit(self.dsn, guard=False) as conn, conn.cursor() as cur:
            cur.execute(f"ALTER SYSTEM SET {name} = %s", (value,))
            cur.execute("SELECT pg_reload_conf()")
        time.sleep(0.3)  # the postmaster re-reads its files and signals the backends

    def wait_replayed_by(self, standby: Node, timeout: float = 20) -> None:
        """Until ``standby`` has replayed everything written here so far: a synchronous commit waits for the
        standby's flush, not for its replay, and a role or database the standby has not replayed does not exist
        there yet."""
        with autocommit(self.dsn, guard=False) as conn, conn.cursor() as cur:
            cur.execute("SELECT pg_current_wal_flush_lsn()::text")
            written = cur.fetchone()[0]
        deadline = time.monotonic() + timeout
        while True:
            with autocommit(standby.dsn, guard=False) as conn, conn.cursor() as cur:
                cur.execute("SELECT pg_wal_lsn_diff(pg_last_wal_replay_lsn(), %s::pg_lsn) >= 0", (written,))
                if cur.fetchone()[0]:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"standby {standby.name} has not replayed {written} after {timeout} s")
            time.sleep(0.02)

    def wait_sync_state(self, application_name: str, states: tuple[str, ...], timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with autocommit(self.dsn, guard=False) as conn, conn.cursor() as cur:
                cur.execute(
                    "SELECT sync_state FROM pg_stat_replication WHERE application_name = %s AND state = 'streaming'",
                    (application_name,),
                )
                row = cur.fetchone()
            if row is not None and row[0] in states:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"standby {application_name} not in {states} after {timeout} s (now {row})")
            time.sleep(0.1)


def wait_ready(dsn: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with autocommit(dsn, guard=False) as conn, conn.cursor() as cur:
                cur.execute("SELECT NOT pg_is_in_recovery()")
                if cur.fetchone()[0]:
                    return
        except (psycopg2.Error, RuntimeError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{dsn} not writable after {timeout} s")
        time.sleep(0.1)


@contextlib.contextmanager
def sync_pair(folder: Path) -> Iterator[tuple[Node, Node]]:
    """A primary acknowledging a commit only once its standby ``s1`` holds it (``ANY 1 (s1)``), and that standby."""
    primary = Node(folder / "primary", "primary").init(
        synchronous_standby_names="'ANY 1 (s1)'", synchronous_commit="on"
    )
    primary.start()
    standby = None
    try:
        standby = primary.standby(folder / "s1", "s1")
        primary.wait_sync_state("s1", ("quorum", "sync"))
        yield primary, standby
    finally:
        for node in (standby, primary):
            if node is not None:
                with contextlib.suppress(Exception):
                    node.stop("immediate")


class CuttingProxy:
    """A TCP proxy in front of one node that, once armed with markers, passes on the client's message holding the
    last of them (on a connection that sent the others first, in that order), waits for the server's answer to it
    (ReadyForQuery), then stops taking connections and cuts that client off without the answer: the statement (a
    COMMIT, or one statement in autocommit) took effect on the server, the client cannot know, and the server
    looks gone. A test then stops the node and promotes its standby, as Patroni would."""

    def __init__(self, node: Node):
        self._target = ("127.0.0.1", node.port)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.port = self._listener.getsockname()[1]
        self.markers: tuple[bytes, ...] = ()
        self.cut = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, *markers: bytes) -> None:
        self.markers = markers

    def close(self) -> None:
        # shutdown first: a close alone leaves an accept() blocked in another thread taking one more connection.
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            try:
                server = socket.create_connection(self._target, timeout=5)
            except OSError:
                client.close()
                continue
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()

    def _pump(self, client: socket.socket, server: socket.socket) -> None:
        seen = 0  # markers this connection has sent, in order
        try:
            while True:
                ready, _, _ = select.select([client, server], [], [], 1.0)
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        return
                    if s is server:
                        client.sendall(data)
                        continue
                    server.sendall(data)
                    if self.markers and not self.cut.is_set() and self.markers[seen] in data:
                        seen += 1
                        if seen == len(self.markers):
                            self._answer(server)
                            self.close()
                            self.cut.set()
                            return
        except OSError:
            return
        finally:
            client.close()
            server.close()

    @staticmethod
    def _answer(server: socket.socket) -> None:
        """Read the server's answer up to its ReadyForQuery: the statement is done (its commit too)."""
        server.settimeout(30)
        answer = b""
        while b"Z\x00\x00\x00\x05" not in answer:
            chunk = server.recv(65536)
            if not chunk:
                return
            answer += chunk
