"""Test helpers that run in child processes (spawned, so importable at top level) and a connection-cutting proxy."""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psycopg2.extensions

from photon.logs.ids import EventKeys
from photon.registry.client import IdRegistry, RegistryOptions
from photon.registry.owners import create_owner
from photon.storage import open_store


def keys_from(ts: np.ndarray, src: np.ndarray) -> EventKeys:
    return EventKeys(np.ascontiguousarray(ts, dtype=np.int64), np.ascontiguousarray(src, dtype=np.int64))


def race_worker(
    servers: dict[str, str],
    name: str,
    ts: np.ndarray,
    src: np.ndarray,
    positions: np.ndarray,
    batch: int,
    seed: int,
    fast_path: bool,
    start: Any,
    out: Any,
) -> None:
    """Register the ids at ``positions`` in shuffled batches; report (name, owner_id, positions, outcomes)."""
    keys = keys_from(ts, src)
    order = np.random.default_rng(seed).permutation(positions)
    with IdRegistry(servers, RegistryOptions(max_attempts=50, backoff_max_s=0.5, fast_path=fast_path)) as reg:
        owner = create_owner(servers["main"], name)
        start.wait()
        got_pos, got_out = [], []
        for seq, lo in enumerate(range(0, len(order), batch)):
            pos = order[lo : lo + batch]
            res = reg.register(keys.take(pos), owner.token(seq))
            got_pos.append(pos)
            got_out.append(res.outcomes)
            if seq == 1:  # a retry of an earlier batch with the same token: ours again, nothing new
                again = reg.register(keys.take(got_pos[0]), owner.token(0))
                got_pos.append(got_pos[0])
                got_out.append(np.where(again.outcomes == 1, 100, again.outcomes))  # 100 marks "won again"
        out.put((name, owner.owner_id, np.concatenate(got_pos), np.concatenate(got_out)))


def spread_worker(
    servers: dict[str, str], name: str, ts: np.ndarray, src: np.ndarray, batch: int, seed: int, start: Any, out: Any
) -> None:
    keys = keys_from(ts, src)
    order = np.random.default_rng(seed).permutation(len(ts))
    counts = np.zeros(4, dtype=np.int64)
    with IdRegistry(servers, RegistryOptions(max_attempts=50, backoff_max_s=0.5)) as reg:
        owner = create_owner(servers["main"], name)
        start.wait()
        for seq, lo in enumerate(range(0, len(order), batch)):
            res = reg.register(keys.take(order[lo : lo + batch]), owner.token(seq))
            counts += np.bincount(res.outcomes.astype(np.int64), minlength=4)
    out.put((name, counts))


def server_address(dsn: str) -> tuple[int, Any]:
    """(socket family, address) of a DSN's server, for a proxy in front of it: the embedded server (no DSN, as in
    CI) listens on a Unix socket only, a server on the machine on TCP."""
    params = psycopg2.extensions.parse_dsn(dsn)
    host, port = params.get("host", "127.0.0.1"), int(params.get("port", 5432))
    return (socket.AF_UNIX, f"{host}/.s.PGSQL.{port}") if host.startswith("/") else (socket.AF_INET, (host, port))


class CommitCuttingProxy:
    """A TCP proxy to a real PostgreSQL that, once armed, lets the next COMMIT reach the server, waits for the
    server to answer, and then drops the client's connection without passing the answer on: the commit happened,
    but the client cannot know."""

    def __init__(self, dsn: str):
        self._target = server_address(dsn)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.port = self._listener.getsockname()[1]
        self.dsn = psycopg2.extensions.make_dsn(dsn, host="127.0.0.1", port=str(self.port), sslmode="disable")
        self.armed = threading.Event()
        self.cut = threading.Event()
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._stop = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.socket(self._target[0], socket.SOCK_STREAM)
            server.connect(self._target[1])
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()

    def _pump(self, client: socket.socket, server: socket.socket) -> None:
        try:
            while True:
                ready, _, _ = select.select([client, server], [], [], 1.0)
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        return
                    if s is client:
                        server.sendall(data)
                        if self.armed.is_set() and b"COMMIT\x00" in data:
                            self.armed.clear()
                            time.sleep(0.5)  # the server commits and answers; the answer is never passed on
                            self.cut.set()
                            return
                    else:
                        client.sendall(data)
        except OSError:
            return
        finally:
            client.close()
            server.close()


def to_bucket(folder: Path, url: str) -> None:
    """Every file under ``folder`` as an object under ``url``, at the same relative key."""
    store = open_store(url)
    for top, _, names in os.walk(folder, followlinks=True):  # a data center's folder may be a link
        for name in sorted(names):
            path = Path(top) / name
            store.put(path.relative_to(folder).as_posix(), path.read_bytes())
