"""Trap (2) of issue 21, staged exactly: a registration whose wait for its synchronous standby is cancelled (or whose
backend is terminated) leaves its row visible on the primary though no standby holds it; the other pipeline's
pre-filter and register then see the click as taken; the primary is lost before anything reaches the standby and the
standby is promoted without the row. Every answer a client was given (ours, registered, someone else's) must hold on
the promoted server, and exactly one pipeline may own the click: nothing joined twice, nothing dropped for good.

The standby is cut off by stopping the primary's WAL sender (SIGSTOP), so nothing it has not already sent can reach
the standby before the primary is killed (a paused standby would read what waits in its socket when resumed)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import psycopg2.extensions
import pytest
from psycopg2 import sql

from photon.logs.ids import make_id
from photon.pg import autocommit, create_database
from photon.registry.admin import init_registry
from photon.registry.client import IdRegistry, Outcome, RegistryOptions
from photon.registry.owners import create_owner
from tests.integration.replication import Node, sync_pair
from tests.integration.test_failover_client import rows_with_token

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def _login(admin: str, primary: Node, standby: Node) -> str:
    """A photon_joiner login on a multi-host DSN that follows the primary."""
    name = f"photon_t_{uuid.uuid4().hex[:8]}"
    with autocommit(admin, guard=False) as conn, conn.cursor() as cur:
        cur.execute(sql.SQL("CREATE ROLE {} LOGIN IN ROLE photon_joiner").format(sql.Identifier(name)))
    return psycopg2.extensions.make_dsn(
        admin,
        host="127.0.0.1,127.0.0.1",
        port=f"{primary.port},{standby.port}",
        user=name,
        target_session_attrs="read-write",
        connect_timeout="2",
    )


def _one(dsn: str, query: str, args: tuple[Any, ...] = ()) -> Any:
    with autocommit(dsn, guard=False) as conn, conn.cursor() as cur:
        cur.execute(query, args)
        row = cur.fetchone()
    return None if row is None else row[0]


def _wait_for(cond: Any, what: str, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class _Call(threading.Thread):
    """Runs ``fn`` and records its answer (or error) and when it came."""

    def __init__(self, fn: Any):
        super().__init__(daemon=True)
        self.fn = fn
        self.result: Any = None
        self.error: BaseException | None = None
        self.done_at: float | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:  # reported by the test
            self.error = exc
        self.done_at = time.monotonic()


def _kill_server(node: Node) -> None:
    """SIGKILL the postmaster and every backend (the stopped WAL sender too: SIGKILL needs no SIGCONT)."""
    pid = int((node.data / "postmaster.pid").read_text().split()[0])
    postmaster = psutil.Process(pid)
    for proc in [postmaster, *postmaster.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()


# A pipeline's joiner process registering one click and saying what it was told; killed by the test when it dies.
_REGISTER = """
import sys
from photon.registry.client import IdRegistry, Outcome, RegistryOptions
from photon.registry.owners import Token
with IdRegistry({"main": sys.argv[1]}, RegistryOptions(failover_s=40)) as reg:
    reg.lookup([sys.argv[2]])  # its connection first
    print("ready", flush=True)
    sys.stdin.readline()
    print(Outcome(reg.register([sys.argv[2]], Token.from_value(int(sys.argv[3]))).outcomes[0]).name, flush=True)
"""


@pytest.mark.parametrize(
    ("interrupt", "a_dies"),
    [("pg_cancel_backend", False), ("pg_terminate_backend", False), ("pg_cancel_backend", True)],
    ids=["cancelled", "terminated", "cancelled-then-A-dies"],
)
def test_a_cancelled_wait_for_the_standby_neither_duplicates_nor_loses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, interrupt: str, a_dies: bool
) -> None:
    """``a_dies``: pipeline A's process is killed after the interruption, before it could publish or retry: only B
    can join the click, and B's pre-filter must not drop it on the strength of A's unreplicated row."""
    # Two servers: the promoted one has no standby left, which the guard would refuse; the guard has its own tests.
    monkeypatch.setenv("PHOTON_REGISTRY_REPLICATION", "single")
    with sync_pair(tmp_path) as (primary, standby):
        admin = create_database(primary.dsn, "photon_trap")
        init_registry({"main": admin}, num_shards=1)
        dsn_a, dsn_b = _login(admin, primary, standby), _login(admin, primary, standby)
        tok_a, tok_b = create_owner(dsn_a, "dc-a").token(1), create_owner(dsn_b, "dc-b").token(1)
        now = int(time.time() * 1e6)
        click, warm = make_id("10.9.9.9", 7, now), make_id("10.9.9.9", 7, now + 1)
        options = RegistryOptions(failover_s=40)
        with IdRegistry({"main": dsn_a}, options) as reg_a, IdRegistry({"main": dsn_b}, options) as reg_b:
            # Connections, the batch table and the click's partition exist before the standby is cut off.
            reg_a.register([warm], tok_a)
            reg_b.lookup([warm])
            process = None
            user_a = psycopg2.extensions.parse_dsn(dsn_a)["user"]
            if a_dies:
                dsn_p = _login(admin, primary, standby)  # A's process: its own login, so its backend is told apart
                user_a = psycopg2.extensions.parse_dsn(dsn_p)["user"]
                env = {**os.environ, "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}"}
                process = subprocess.Popen(
                    [sys.executable, "-c", _REGISTER, dsn_p, click, str(tok_a.value)],
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                assert process.stdout is not None and process.stdin is not None
                assert process.stdout.readline().strip() == "ready"

            # 1. The standby is cut off: a COMMIT now waits for it for ever.
            sender = _one(primary.dsn, "SELECT pid FROM pg_stat_replication")
            os.kill(int(sender), signal.SIGSTOP)

            # 2. Pipeline A registers the click; its COMMIT waits for the standby; the wait is interrupted.
            a = _Call(lambda: Outcome(reg_a.register([click], tok_a).outcomes[0]))
            if process is None:
                a.start()
            else:
                process.stdin.write("go\n")  # type: ignore[union-attr]
                process.stdin.flush()  # type: ignore[union-attr]
            waiting = "SELECT pid FROM pg_stat_activity WHERE usename = %s AND wait_event = 'SyncRep'"
            backend = _wait_for(lambda: _one(primary.dsn, waiting, (user_a,)), "A's COMMIT to wait for the standby")
            assert _one(primary.dsn, f"SELECT {interrupt}(%s)", (backend,))
            # The row is now visible on the primary, committed locally and never replicated.
            if process is None:
                a.join(1.5)
            else:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(1.5)
                told = process.stdout.read() if process.poll() is not None else ""  # type: ignore[union-attr]
                process.kill()  # A dies: no retry, no output
                process.wait()
                a.result = Outcome[told.strip()] if told.strip() else None
                a.done_at = time.monotonic() if told.strip() else None

            # 3. Pipeline B: its dispatcher's pre-filter, then its register.
            seen: dict[str, bool] = {}  # B's pre-filter answer, kept even if its register runs again later

            def pipeline_b() -> Outcome:
                seen["registered"] = bool(reg_b.lookup([click]).registered[0])
                seen["before_failover"] = not failed_over.is_set()
                return Outcome(reg_b.register([click], tok_b).outcomes[0])

            failed_over = threading.Event()
            b = _Call(pipeline_b)
            b.start()
            b.join(1.5)
            before = {"a": a.done_at is not None, "b": b.done_at is not None, "b_lookup": "registered" in seen}

            # 4. The primary is lost before its standby saw the click; the standby is promoted.
            failed_over.set()
            _kill_server(primary)
            standby.promote()
            if process is None:
                a.join(60)
            b.join(60)
            assert a.error is None and b.error is None, (a.error, b.error)

            # 5. After the failover, pipeline B meets the click again (a retry, a re-run batch).
            again = Outcome(reg_b.register([click], create_owner(dsn_b, "dc-b").token(2)).outcomes[0])

        held = rows_with_token(psycopg2.extensions.make_dsn(admin, port=standby.port))
        owner = next((tok for (ts, _src), tok in held.items() if ts == now), None)
        a_ours = a.result in (Outcome.WON, Outcome.WON_AGAIN)
        b_registered, b_outcome = seen["registered"], b.result
        b_ours = b_outcome in (Outcome.WON, Outcome.WON_AGAIN)
        story = (
            f"answered before the failover: {before}; A {a.result}, B registered={b_registered} {b_outcome.name}, "
            f"held by {owner} (A {tok_a.value}, B {tok_b.value})"
        )
        # Every answer a client was given holds on the promoted server.
        assert not a_ours or owner == tok_a.value, (
            f"A was told the click is its own, the new primary forgot it ({story})"
        )
        assert not b_registered or owner is not None, f"B's pre-filter dropped a click the new primary forgot ({story})"
        assert b_outcome != Outcome.LOST or owner not in (None, tok_b.value), story
        assert not b_ours or owner == tok_b.value, story
        # Exactly one pipeline owns it (a dead A owns nothing it was not told), and meeting it again changes nothing.
        assert a_ours != b_ours, f"owned by {'both' if a_ours else 'neither'} ({story})"
        assert again == Outcome.LOST, story


def test_every_commit_path_takes_a_cancelled_wait_for_an_unknown_outcome(tmp_path: Path) -> None:
    """The connection every component uses: an explicit COMMIT and an autocommit statement whose wait for the standby
    is cancelled raise CommitNotReplicatedError (a lost answer to every retry policy), and sync_barrier makes a
    transaction that wrote nothing wait for the standby like one that did."""
    from photon.pg import CommitNotReplicatedError, connect, is_connection_error, sync_barrier

    with sync_pair(tmp_path) as (primary, _standby):
        with autocommit(primary.dsn, guard=False) as conn, conn.cursor() as cur:
            cur.execute("CREATE TABLE t (v int)")
        sender = _one(primary.dsn, "SELECT pid FROM pg_stat_replication")
        os.kill(int(sender), signal.SIGSTOP)

        def interrupted(body: Any, app: str) -> _Call:
            call = _Call(body)
            call.start()
            waiting = "SELECT pid FROM pg_stat_activity WHERE application_name = %s AND wait_event = 'SyncRep'"
            backend = _wait_for(lambda: _one(primary.dsn, waiting, (app,)), f"{app} to wait for the standby")
            assert _one(primary.dsn, "SELECT pg_cancel_backend(%s)", (backend,))
            call.join(10)
            assert call.done_at is not None, f"{app} still waiting after the cancel"
            return call

        def explicit() -> None:
            conn = connect(primary.dsn, application_name="explicit", guard=False)
            with conn.cursor() as cur:
                cur.execute("INSERT INTO t VALUES (1)")
            conn.commit()

        def one_statement() -> None:
            conn = connect(primary.dsn, application_name="autocommit", guard=False)
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute("INSERT INTO t VALUES (2)")

        def read_only() -> None:
            conn = connect(primary.dsn, application_name="barrier", guard=False)
            with conn.cursor() as cur:
                cur.execute("SELECT count(*) FROM t")
                sync_barrier(cur)
            conn.commit()

        for body, app in ((explicit, "explicit"), (one_statement, "autocommit"), (read_only, "barrier")):
            call = interrupted(body, app)
            assert isinstance(call.error, CommitNotReplicatedError), (app, call.error)
            assert is_connection_error(call.error), app  # retried as a lost answer, everywhere
            assert "might not have been replicated" in str(call.error), call.error
