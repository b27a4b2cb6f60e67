"""Adversarial review of the lease hand-over (photon.standbys, the hold past a lease's term, the warm-up dry batch).

Breaks (each test fails on the code it was written against):
- the hold outlasts ``term + hand_over_wait_s`` by up to a whole trigger interval (it decides to hold without asking
  whether the next trigger is still inside the bound);
- nothing bounds the time a query on ``photon.standbys`` may take: a lock on that table (which any photon_joiner
  session may take, its grants being table-wide UPDATE and DELETE) keeps a lease past its term indefinitely, and stops
  every standby at its very first announcement, so a lease that dies is never replaced.

Guards (they pass): the grants on ``photon.standbys``; fake, future-dated rows only ever bound the hold; a warm-up
dry batch, left behind by a crash or run beside a live lease's batches, registers nothing and never reaches the
output."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg2
import pytest
from psycopg2 import sql

from photon.joiner.common import JoinSettings
from photon.joiner.lease import Joiner
from photon.joiner.state import PipelineState
from photon.pg import autocommit
from photon.registry.admin import init_registry
from photon.storage import LocalStore
from tests.integration import output
from tests.integration.test_handover_wait import standby

pytestmark = pytest.mark.integration
US = 1_000_000


def joiner(root: Path, servers: dict[str, str], trigger_s: float = 0.1, spark: Any = None) -> Joiner:
    for kind in ("queries", "clicks"):
        (root / "logs" / "dc-a" / kind).mkdir(parents=True, exist_ok=True)
    settings = JoinSettings(parallelism=1, trigger_interval_s=trigger_s, heartbeat_s=0.5)
    return Joiner("dc-a", root / "logs", root / "out", servers, spark, settings)


@contextmanager
def standbys_locked(joiner_dsn: str, admin_dsn: str) -> Iterator[str]:
    """An ACCESS EXCLUSIVE lock on photon.standbys, held until the block ends: taken by a photon_joiner session (any
    pipeline's joiner can), or, should that role no longer be able to, by the owner (a migration's ALTER TABLE, a
    VACUUM FULL). Yields who holds it."""
    conn, holder = None, ""
    for who, dsn in (("photon_joiner", joiner_dsn), ("owner", admin_dsn)):
        conn = psycopg2.connect(dsn)
        try:
            with conn.cursor() as cur:
                cur.execute("LOCK TABLE photon.standbys IN ACCESS EXCLUSIVE MODE")
            holder = who
            break
        except psycopg2.errors.InsufficientPrivilege:
            conn.close()
            conn = None
    assert conn is not None
    try:
        yield holder
    finally:
        conn.rollback()
        conn.close()


# -- guarantee 2: a lease never holds the pipeline beyond term + hand_over_wait_s ---------------------------------


def test_the_hold_never_outlasts_term_plus_wait_by_a_trigger_interval(tmp_path: Path, servers: dict[str, str]) -> None:
    """Break. ``Term.lease_over`` holds whenever ``now < deadline + wait_s``, then sleeps a whole trigger interval and
    checks again: with a 3 s trigger, a 3 s term and 0.5 s of wait, the lease held the pipeline until 6 s (twice
    its term, 2.5 s past the bound); with the DAG's own bounds (trigger_interval_s up to 60 s) up to a minute past
    it, idle, the pipeline unavailable to anyone else."""
    j = joiner(tmp_path, servers, trigger_s=3.0)
    j.start()
    with standby(PipelineState(servers["main"], "dc-a")):  # starting, never ready
        t0 = time.monotonic()
        j.run(run_for_s=3.0, hand_over_wait_s=0.5)
        took = time.monotonic() - t0
    assert took < 3.0 + 0.5 + 1.0, f"held the pipeline {took:.1f}s: term 3 s + wait 0.5 s"


def test_a_lock_on_the_standbys_table_never_keeps_a_lease_past_term_plus_wait(
    tmp_path: Path, make_db: Callable[[], str], login_as: Callable[[str, str], str]
) -> None:
    """Break. ``successor()`` (asked once the term is over) has neither a lock nor a statement timeout: while
    photon.standbys is locked the lease blocks in it, heartbeating, so no standby takes it for dead; it held the
    pipeline until the lock went, here > 8 s for a 1 s term and 2 s of wait (in production: until the standby's
    patience, term + 600 s, fences it). Any photon_joiner session can take that lock (table-wide UPDATE/DELETE), so
    one pipeline's joiner can do this to every pipeline."""
    dsn = make_db()
    init_registry({"main": dsn}, num_shards=2)
    servers = {"main": login_as(dsn, "photon_joiner")}
    j = joiner(tmp_path, servers)
    j.start()
    done = threading.Event()

    def lease() -> None:
        j.run(run_for_s=1.0, hand_over_wait_s=2.0)
        done.set()

    with standbys_locked(login_as(dsn, "photon_joiner"), dsn) as who:
        t0 = time.monotonic()
        thread = threading.Thread(target=lease, daemon=True)
        thread.start()
        ended = done.wait(1.0 + 2.0 + 5.0)  # a generous slack: one connect_timeout and more
        took = time.monotonic() - t0
    thread.join(30)
    assert ended, f"lock held by {who}: the lease held the pipeline {took:.1f}s+ (term 1 s, wait 2 s)"


def test_a_lock_on_the_standbys_table_never_stops_a_standby_from_replacing_a_dead_lease(
    tmp_path: Path, make_db: Callable[[], str], login_as: Callable[[str, str], str]
) -> None:
    """Break (guarantee 3). A standby announces itself synchronously when ``standing_by()`` is entered, before its
    Spark session starts, without any timeout ("the announcement only ever shortens a gap"): while photon.standbys
    is locked it never gets past that line, so the lease that died is never replaced and the pipeline stops. Its
    exit (joining the heartbeat thread, then the withdrawal) blocks the same way, after the take-over, before the
    new lease joins or heartbeats."""
    dsn = make_db()
    init_registry({"main": dsn}, num_shards=2)
    servers = {"main": login_as(dsn, "photon_joiner")}
    joiner(tmp_path / "a", servers).start()  # a lease that dies at once: no heartbeat, no release
    s = joiner(tmp_path / "a", servers)
    state = PipelineState(servers["main"], "dc-a")
    took: dict[str, Any] = {}

    def standby_process() -> None:  # join_cmd --standby, less its Spark session and warm-up
        with state.standing_by() as announcement:
            took["entered"] = time.monotonic()
            announcement.ready()
            took["why"] = s.take_over(stale_s=1.0, timeout_s=600.0)
        took["joining"] = time.monotonic()  # join_cmd runs the lease's batches from here

    with standbys_locked(login_as(dsn, "photon_joiner"), dsn) as who:
        t0 = time.monotonic()
        thread = threading.Thread(target=standby_process, daemon=True)
        thread.start()
        thread.join(15.0)  # stale after 1 s; the rest is slack for timeouts a fix may add
        seen = dict(took)
    thread.join(30)
    assert "joining" in seen, f"lock held by {who}: after 15 s the standby got only as far as {sorted(seen)}"
    assert seen["why"] == "stale" and seen["joining"] - t0 < 15.0


# -- guarantee 4: least privilege on photon.standbys, and fake rows ----------------------------------------------


def grants(dsn: str) -> set[tuple[str, str, str | None]]:
    """(grantee, privilege, column or None) on photon.standbys, its owner left out; PUBLIC is 'PUBLIC'."""
    with autocommit(dsn) as conn, conn.cursor() as cur:
        cur.execute(
            "SELECT coalesce(g.rolname, 'PUBLIC'), a.privilege_type, NULL FROM pg_class c,"
            " aclexplode(c.relacl) a LEFT JOIN pg_roles g ON g.oid = a.grantee"
            " WHERE c.oid = 'photon.standbys'::regclass AND a.grantee <> c.relowner"
            " UNION ALL"
            " SELECT coalesce(g.rolname, 'PUBLIC'), a.privilege_type, t.attname FROM pg_attribute t,"
            " aclexplode(t.attacl) a LEFT JOIN pg_roles g ON g.oid = a.grantee"
            " WHERE t.attrelid = 'photon.standbys'::regclass AND t.attacl IS NOT NULL"
        )
        return {(str(r), str(p), c) for r, p, c in cur.fetchall()}


def test_standbys_grants_are_least_privilege_and_fake_rows_only_bound_the_hold(
    tmp_path: Path, make_db: Callable[[], str], login_as: Callable[[str, str], str]
) -> None:
    """Guard. A joiner reads photon.standbys and writes it only through photon.announce_standby and
    photon.withdraw_standby, which stamp rows with the server's time: it can neither date a row ahead (it would never
    go stale) nor lock the table; no other role has anything. A row another pipeline's joiner keeps announcing for
    dc-a delays a lease of dc-a by at most its hand_over_wait_s. (Was: table-wide INSERT, UPDATE (phase, seen_at)
    and DELETE for the joiner, enough to date rows a day ahead and to lock the table; SELECT for the verifier and
    GC, which never read it.)"""
    dsn = make_db()
    init_registry({"main": dsn}, num_shards=2)
    assert grants(dsn) == {("photon_joiner", "SELECT", None)}
    joiner_dsn = login_as(dsn, "photon_joiner")
    conn = psycopg2.connect(joiner_dsn)  # a transaction per statement: LOCK TABLE needs one
    try:
        for stmt in (
            "INSERT INTO photon.standbys VALUES ('dc-a', 'dc-b-host:1', 'starting', now() + interval '1 day')",
            "UPDATE photon.standbys SET seen_at = now() + interval '1 day'",
            "DELETE FROM photon.standbys",
            "TRUNCATE photon.standbys",
            "LOCK TABLE photon.standbys IN ACCESS EXCLUSIVE MODE",
            "LOCK TABLE photon.standbys IN SHARE MODE",  # the weakest mode that would block the announcements
        ):
            with conn.cursor() as cur, pytest.raises(psycopg2.errors.InsufficientPrivilege):
                cur.execute(stmt)
            conn.rollback()
    finally:
        conn.close()
    with autocommit(joiner_dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT photon.announce_standby('dc-a', 'dc-b-host:1', 'starting')")
        cur.execute("SELECT seen_at <= now() FROM photon.standbys")
        assert cur.fetchone() == (True,)
    for role in ("photon_verifier", "photon_gc", "photon_reshard"):
        with autocommit(login_as(dsn, role)) as conn, conn.cursor() as cur:
            for stmt in (
                "SELECT * FROM photon.standbys",
                "SELECT photon.announce_standby('dc-a', 'h:2', 'ready')",
                "SELECT photon.withdraw_standby('dc-a', 'dc-b-host:1')",
            ):
                with pytest.raises(psycopg2.errors.InsufficientPrivilege):
                    cur.execute(stmt)
    servers = {"main": joiner_dsn}
    j = joiner(tmp_path, servers)
    j.start()
    stop = threading.Event()

    def faker() -> None:  # another pipeline's joiner, refreshing the fake row
        while not stop.wait(0.3):
            PipelineState(joiner_dsn, "dc-a").announce_standby("starting", holder="dc-b-host:1")

    thread = threading.Thread(target=faker, daemon=True)
    thread.start()
    try:
        assert PipelineState(joiner_dsn, "dc-a").successor() == "starting"
        t0 = time.monotonic()
        j.run(run_for_s=1.0, hand_over_wait_s=1.5)
        took = time.monotonic() - t0
    finally:
        stop.set()
        thread.join(10)
    assert 2.4 <= took < 1.0 + 1.5 + 1.5, took  # it held (the row counts), and no longer than the bound


# -- guarantee 1: the warm-up dry batch never reaches the registry or the output -------------------------------


def write_logs(logs: Path, name: str, now: int) -> tuple[str, str]:
    """A query and its click (joinable), and a click too old to wait for its query (unjoinable); flat, closed."""
    qid, cid, old = f"10.0.0.2-6-{now - US}", f"10.0.0.1-5-{now}", f"10.0.0.1-5-{now - 600 * US}"
    query = {"query_id": qid, "ts_us": now - US, "user_id": "u", "query_text": "q", "country": "DE"}
    query["ads"] = [{"ad_id": "a1", "advertiser_id": "adv1", "bid_micros": 1}]
    (logs / "dc-a" / "queries" / f"{name}.jsonl").write_text(json.dumps(query) + "\n")
    clicks = [
        {"click_id": cid, "ts_us": now, "query_id": qid, "ad_id": "a1"},
        {"click_id": old, "ts_us": now - 600 * US, "query_id": f"10.0.0.2-6-{now - 601 * US}", "ad_id": "a1"},
    ]
    (logs / "dc-a" / "clicks" / f"{name}.jsonl").write_text("".join(json.dumps(c) + "\n" for c in clicks))
    return cid, old


def ids_under(folder: Path) -> list[str]:
    """The click ids committed to the table ``<out>/<pipeline>/<kind>``."""
    return output.ids(folder.parents[1], folder.name, folder.parent.name)


def test_a_dry_batch_beside_a_live_lease_or_left_by_a_crash_registers_nothing_and_never_reaches_the_output(
    tmp_path: Path, make_db: Callable[[], str], login_as: Callable[[str, str], str], spark: Any
) -> None:
    """Guard. A live lease runs its batches while a standby's dry batch runs beside it on the same output folder;
    the dry batch's folder is left behind as a standby killed before its clean-up leaves it. The lease's output
    holds its own clicks once, the registry nothing with token 0, and the next lease's start sweeps the folder."""
    dsn = make_db()
    init_registry({"main": dsn}, num_shards=2)
    servers = {"main": login_as(dsn, "photon_joiner")}
    live = joiner(tmp_path, servers, spark=spark)
    live.start()  # the live lease began before the standby
    warm = joiner(tmp_path, servers, spark=spark)
    now = int(time.time() * US)
    first = write_logs(tmp_path / "logs", "f1", now)
    leftover = tmp_path / "out" / "dc-a" / "_staging" / f"warm-up-{os.uname().nodename}-999999"
    errors: list[BaseException] = []

    def dry() -> None:
        try:
            # warm_up() less its clean-up: what SIGKILL after the job leaves
            warm.batches._dry_batch(LocalStore(leftover))
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=dry, daemon=True)
    thread.start()
    live.run(until_caught_up=True, max_batches=3)
    thread.join(120)
    assert not errors, errors
    assert leftover.is_dir()  # the crash's leftover, beside the live lease
    live.run(until_caught_up=True, max_batches=3)  # and batches after it
    live.release()
    nxt = joiner(tmp_path, servers, spark=spark)
    nxt.start()
    assert not leftover.exists()  # a lease start sweeps the staging folder
    second = write_logs(tmp_path / "logs", "f2", now + 2 * US)
    nxt.run(until_caught_up=True, max_batches=3)
    nxt.release()
    out = tmp_path / "out" / "dc-a"
    assert sorted(ids_under(out / "joined")) == sorted([first[0], second[0]])
    assert sorted(ids_under(out / "unjoinable")) == sorted([first[1], second[1]])
    assert not [p for p in out.rglob("*") if "warm-up" in p.name]
    with autocommit(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT table_name FROM photon.shard_state")
        rows: list[Any] = []
        for (t,) in cur.fetchall():
            cur.execute(sql.SQL("SELECT token FROM photon.{}").format(sql.Identifier(t)))
            rows += [tok for (tok,) in cur.fetchall()]
    assert len(rows) == 2 and 0 not in rows, rows  # the two joined clicks, under the lease's tokens
