"""Second adversarial review of the hand-over fix (e567ebd): the bounded hold, the standbys' calls off the
standby's path, the SECURITY DEFINER functions on photon.standbys.

Breaks (fail on e567ebd):
- the bound rests on the *server's* timeouts only (statement_timeout, lock_timeout) plus libpq's connect_timeout:
  a standbys query whose answer never comes (a flow dropped by the network or a middlebox, a stuck pooler, a
  frozen server: the server's clock never runs the timeout) blocks the lease inside ``successor()`` with no bound at
  all, heartbeating, so nobody fences it; a connect that hangs holds it a whole connect_timeout (2 s per address,
  DNS not bounded at all) past the bound;
- sql/0009_standbys.sql was edited in place after c4a6e0d applied it: a registry migrated at c4a6e0d can no longer
  be migrated (checksum refused), so it never gets the functions (every announcement fails: no hand-over waits).

Guards (pass): the standby's start, ready and take-over are not held up by standbys statements that never answer;
a last announcement in flight at the exit is followed by the withdrawal (no stale 'ready' row); the functions'
search_path, CHECKs and parameters; the joiner can lock photon.standbys in ACCESS SHARE mode only."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import psycopg2
import psycopg2.extensions
import pytest

from photon.joiner.state import PipelineState
from photon.pg import autocommit
from photon.registry.admin import init_registry
from photon.registry.migrations import MigrationError, apply_migrations, discover
from tests.integration.helpers import server_address
from tests.integration.test_adversary_handover import joiner
from tests.integration.test_handover_wait import standby

pytestmark = pytest.mark.integration


class Proxy:
    """A TCP proxy in front of the registry server. ``freeze``: a simple query that names a standby (the
    photon.standbys SELECT, announce_standby, withdraw_standby) is held, not forwarded, until ``thaw``: the client
    waits for an answer that the server never got (its kernel has ACKed the bytes: no TCP error ever comes).
    ``blackhole``: a connection whose startup names application photon-standby-* is accepted and never answered."""

    def __init__(self, dsn: str):
        self.upstream = server_address(dsn)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        port = self.listener.getsockname()[1]
        self.dsn = psycopg2.extensions.make_dsn(
            dsn, host="127.0.0.1", port=port, sslmode="disable", gssencmode="disable"
        )
        self.freeze, self.thaw, self.blackhole = threading.Event(), threading.Event(), threading.Event()
        self.closed = False
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                continue
            self.socks.append(client)
            threading.Thread(target=self._handle, args=(client,), daemon=True).start()

    def _connect_upstream(self) -> socket.socket:
        server = socket.socket(self.upstream[0], socket.SOCK_STREAM)
        server.connect(self.upstream[1])
        return server

    @staticmethod
    def _read(sock: socket.socket, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return buf

    def _answers(self, startup: bytes) -> bool:
        """Whether a connection with this startup message is served at all."""
        return not (self.blackhole.is_set() and b"photon-standby" in startup)

    def _before_forward(self, header: bytes, body: bytes) -> None:
        """Called with each message from the client before it goes to the server (a subclass may hold it)."""
        # The standby's own statements only: others name a standby too (every registry read's sync barrier asks
        # for synchronous_standby_names), and a joiner's lease start must not hang with them.
        standbys = (b"photon.announce_standby(", b"photon.withdraw_standby(", b"photon.standbys")
        if header[:1] == b"Q" and any(s in body for s in standbys) and self.freeze.is_set():
            self.thaw.wait()

    def _handle(self, client: socket.socket) -> None:
        try:
            head = self._read(client, 4)
            startup = head + self._read(client, struct.unpack("!I", head)[0] - 4)
            if not self._answers(startup):
                return  # accepted, never answered (the socket stays open in self.socks)
            server = self._connect_upstream()
            self.socks.append(server)
            server.sendall(startup)
            threading.Thread(target=self._copy, args=(server, client), daemon=True).start()
            while True:
                header = self._read(client, 5)
                body = self._read(client, struct.unpack("!I", header[1:])[0] - 4)
                self._before_forward(header, body)
                server.sendall(header + body)
        except (EOFError, OSError):
            pass

    @staticmethod
    def _copy(src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        except OSError:
            pass

    def close(self) -> None:
        self.thaw.set()
        self.closed = True
        time.sleep(0.3)
        for s in [self.listener, *self.socks]:
            with suppress(OSError):
                s.close()


@contextmanager
def proxy_for(dsn: str) -> Iterator[Proxy]:
    p = Proxy(dsn)
    try:
        yield p
    finally:
        p.close()


def lease_in_thread(j: Any, run_for_s: float, wait_s: float) -> tuple[threading.Thread, threading.Event]:
    done = threading.Event()

    def run() -> None:
        try:
            j.run(run_for_s=run_for_s, hand_over_wait_s=wait_s)
        finally:
            done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, done


# -- the bound: term + hand_over_wait_s --------------------------------------------------------------------------


def test_a_standbys_query_that_is_never_answered_never_keeps_a_lease_past_term_plus_wait(
    tmp_path: Path, servers: dict[str, str]
) -> None:
    """Break. The lease holds (its standby is starting); then the registry stops answering the standbys query
    (a stuck flow: the client's bytes are ACKed, nothing comes back). statement_timeout is the server's: it never
    fires for a query the server never runs, and nothing bounds the wait on the client. The lease sits in
    successor() indefinitely (in production: until TCP gives up, ~15 min, or never behind a pooler), heartbeating
    through its other connections, so no standby takes over before its patience (term + 600 s) fences it."""
    with proxy_for(servers["main"]) as proxy:
        j = joiner(tmp_path, {"main": proxy.dsn})
        j.start()
        with standby(PipelineState(servers["main"], "dc-a")):  # starting, never ready; announced directly
            t0 = time.monotonic()
            thread, done = lease_in_thread(j, 1.0, 1.5)
            while not j.term.holding and not done.is_set() and time.monotonic() - t0 < 5:
                time.sleep(0.02)
            assert j.term.holding, "the lease should hold for its starting standby"
            proxy.freeze.set()  # from now on, no standbys query is answered
            ended = done.wait(max(0.0, t0 + 1.0 + 1.5 + 3.0 - time.monotonic()))  # + a connect_timeout and more
            took = time.monotonic() - t0
            proxy.thaw.set()
            thread.join(15)
    assert ended, f"held the pipeline {took:.1f}s+ (term 1 s + wait 1.5 s): stuck in successor()"


def test_a_connect_that_hangs_never_keeps_a_lease_past_term_plus_wait(tmp_path: Path, servers: dict[str, str]) -> None:
    """Break (smaller). Just before the bound, the registry stops completing new standbys connections (accepted,
    never answered: a SYN backlog of a loaded server, a dead pooler). The last poll before the bound blocks for a
    whole connect_timeout (2 s; libpq applies it per address, so 2 s per address of a name or of a multi-host DSN;
    a DNS lookup is not bounded by it at all) and the lease ends that long past term + wait, not "at once"."""
    with proxy_for(servers["main"]) as proxy:
        j = joiner(tmp_path, {"main": proxy.dsn})
        j.start()
        with standby(PipelineState(servers["main"], "dc-a")):
            term, wait = 1.0, 1.5
            t0 = time.monotonic()
            thread, done = lease_in_thread(j, term, wait)
            time.sleep(term + wait - 0.45)  # the hold's polls run every 0.25 s: one starts in the next 0.25 s
            assert j.term.holding
            proxy.blackhole.set()
            done.wait(10)
            took = time.monotonic() - t0
            thread.join(10)
    assert took < term + wait + 1.0, f"held the pipeline {took:.1f}s: term {term} s + wait {wait} s"


# -- the standby's path ------------------------------------------------------------------------------------------


def test_standbys_statements_that_never_answer_never_hold_up_a_standby_or_its_take_over(
    tmp_path: Path, servers: dict[str, str]
) -> None:
    """Guard. Every standbys statement of the standby hangs (not an error, not a timeout: no answer). It still
    enters at once, takes over a dead lease once stale, and leaves the block within the 1 s join."""
    with proxy_for(servers["main"]) as proxy:
        proxy.freeze.set()
        joiner(tmp_path / "a", servers).start()  # a lease that dies at once
        s = joiner(tmp_path / "a", {"main": proxy.dsn})
        t: dict[str, Any] = {"t0": time.monotonic()}
        with PipelineState(proxy.dsn, "dc-a").standing_by() as announcement:
            t["entered"] = time.monotonic()
            announcement.ready()
            t["why"] = s.take_over(stale_s=1.0, timeout_s=600.0)
            t["took_over"] = time.monotonic()
        t["left"] = time.monotonic()
        assert not announcement.announced.is_set()  # nothing ever reached the registry
    assert t["entered"] - t["t0"] < 0.5
    assert t["why"] == "stale" and t["took_over"] - t["t0"] < 5.0
    assert t["left"] - t["took_over"] < 1.3


def test_a_last_announcement_in_flight_at_the_exit_is_followed_by_the_withdrawal(servers: dict[str, str]) -> None:
    """Guard. The standby's 'ready' announcement is stuck in flight when the block ends (the 1 s join gives up);
    when the server finally runs it (stamped then: fresh), the withdrawal comes after it on the same connection, so
    no stale 'ready' row is left to end the next lease early."""
    direct = PipelineState(servers["main"], "dc-a")
    with proxy_for(servers["main"]) as proxy:
        with PipelineState(proxy.dsn, "dc-a").standing_by(every_s=0.2) as announcement:
            assert announcement.announced.wait(5)
            proxy.freeze.set()
            announcement.ready()  # its announcement is held
            time.sleep(0.5)
        time.sleep(0.5)
        proxy.thaw.set()  # the held 'ready' reaches the server now, after the block ended
        seen = set()
        for _ in range(30):
            time.sleep(0.1)
            seen.add(direct.successor())
        assert direct.successor() is None, seen


# -- the SECURITY DEFINER functions ------------------------------------------------------------------------------


def test_standbys_functions_are_safe_and_the_joiner_can_only_take_access_share(
    make_db: Callable[[], str], login_as: Callable[[str, str], str]
) -> None:
    """Guard. search_path pinned to pg_catalog, photon (the joiner has no CREATE on either, and every relation is
    schema-qualified, so a temp table cannot shadow it); bad pipeline or phase values (injection attempts) are
    refused by the CHECKs; the joiner can lock the table in ACCESS SHARE only (which blocks no write), and cannot
    take row locks."""
    dsn = make_db()
    init_registry({"main": dsn}, num_shards=2)
    with autocommit(dsn) as conn, conn.cursor() as cur:
        cur.execute(
            "SELECT p.proname, p.prosecdef, p.proconfig, pg_get_userbyid(p.proowner) = pg_get_userbyid(c.relowner)"
            " FROM pg_proc p, pg_class c WHERE p.pronamespace = 'photon'::regnamespace"
            " AND p.proname IN ('announce_standby', 'withdraw_standby') AND c.oid = 'photon.standbys'::regclass"
        )
        rows = cur.fetchall()
    assert len(rows) == 2
    for name, secdef, config, same_owner in rows:
        assert secdef and same_owner and config == ["search_path=pg_catalog, photon"], (name, config)
    jdsn = login_as(dsn, "photon_joiner")
    conn = psycopg2.connect(jdsn)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT has_schema_privilege('photon', 'CREATE'), has_schema_privilege('pg_catalog', 'CREATE')")
            assert cur.fetchone() == (False, False)
            cur.execute("CREATE TEMP TABLE standbys (pipeline text, holder text, phase text, seen_at timestamptz)")
            cur.execute("SELECT photon.announce_standby('dc-a', 'h:1', 'starting')")
            cur.execute("SELECT count(*) FROM pg_temp.standbys")
            assert cur.fetchone() == (0,)
        conn.commit()
        for args in (
            ("dc-a'); DELETE FROM photon.standbys; --", "h:2", "ready"),
            ("DC-A", "h:2", "ready"),
            ("dc-a", "h:2", "ready'); DELETE FROM photon.standbys; --"),
            ("dc-a", "h:2", None),
            (None, "h:2", "ready"),
            ("dc-a", None, "ready"),
        ):
            with (
                conn.cursor() as cur,
                pytest.raises((psycopg2.errors.CheckViolation, psycopg2.errors.NotNullViolation)),
            ):
                cur.execute("SELECT photon.announce_standby(%s, %s, %s)", args)
            conn.rollback()
        modes = ["ROW SHARE", "ROW EXCLUSIVE", "SHARE UPDATE EXCLUSIVE", "SHARE", "SHARE ROW EXCLUSIVE"]
        for stmt in [f"LOCK TABLE photon.standbys IN {m} MODE" for m in [*modes, "EXCLUSIVE", "ACCESS EXCLUSIVE"]] + [
            f"SELECT * FROM photon.standbys FOR {m}" for m in ("UPDATE", "NO KEY UPDATE", "SHARE", "KEY SHARE")
        ]:
            with conn.cursor() as cur, pytest.raises(psycopg2.errors.InsufficientPrivilege):
                cur.execute(stmt)
            conn.rollback()
        with conn.cursor() as cur:
            cur.execute("LOCK TABLE photon.standbys IN ACCESS SHARE MODE")  # allowed; conflicts with no write
            with autocommit(jdsn, statement_timeout_ms=1000) as other, other.cursor() as c2:
                c2.execute("SELECT photon.announce_standby('dc-a', 'h:3', 'ready')")
                c2.execute("SELECT photon.withdraw_standby('dc-a', 'h:3')")
        conn.rollback()
        with conn.cursor() as cur:
            cur.execute("SELECT pipeline, holder, phase FROM photon.standbys")
            assert cur.fetchall() == [("dc-a", "h:1", "starting")]
    finally:
        conn.close()


# -- migrations --------------------------------------------------------------------------------------------------


def test_a_registry_migrated_before_the_fix_gets_the_standbys_functions(
    tmp_path: Path, make_db: Callable[[], str]
) -> None:
    """Break. e567ebd rewrote sql/0009_standbys.sql, which c4a6e0d had shipped and applied. A registry migrated at
    c4a6e0d (0009 as it was then) is refused by `photon init` ("changed after it was applied") and never gets
    photon.announce_standby: every standby's announcement then fails (UndefinedFunction, a warning a second), no
    lease ever waits for its standby, and the joiner keeps its table-wide UPDATE/DELETE (the lock the fix removed)."""
    old = tmp_path / "sql"
    old.mkdir()
    for mig in discover():
        if mig.version <= 9:  # 0009 as c4a6e0d committed it (restored byte for byte since)
            (old / mig.path.name).write_bytes(mig.path.read_bytes())
    dsn = make_db()
    apply_migrations(dsn, old)  # the registry as c4a6e0d left it
    error = None
    try:
        apply_migrations(dsn)  # upgrade to this code
    except MigrationError as exc:
        error = exc
    with autocommit(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT to_regprocedure('photon.announce_standby(text, text, text)') IS NOT NULL")
        has_function = cur.fetchone()[0]
    assert error is None and has_function, f"upgrade refused: {error}; announce_standby exists: {has_function}"
