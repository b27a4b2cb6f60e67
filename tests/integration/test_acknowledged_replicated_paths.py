"""Adversarial review of "acknowledged means replicated" (trap 2 of issue 21): paths other than register and lookup
that publish, skip or cache on the strength of a commit no standby holds. Each test stages it as
test_acknowledged_replicated.py does: a primary and its synchronous standby, the standby cut off by stopping the
primary's WAL sender (SIGSTOP), a COMMIT's wait for it interrupted (pg_cancel_backend), the primary killed and the
standby promoted without the commit. Every answer a component acted on must hold on the promoted server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg2.extensions
import pyarrow as pa
import pytest
from psycopg2 import sql

from photon.joiner.common import batch_tag
from photon.joiner.state import PipelineState
from photon.logs.ids import make_id
from photon.logs.layout import partition_of
from photon.logs.schemas import JOINED, JOINED_SCHEMA
from photon.logs.tables import stage_rows
from photon.pg import autocommit, connect, create_database
from photon.recovery.verify import verify_and_recover
from photon.registry.admin import init_registry
from photon.registry.client import IdRegistry, Outcome, RegistryOptions
from photon.registry.owners import create_owner
from photon.registry.reshard import activate, plan
from tests.integration import output
from tests.integration.replication import Node, sync_pair, wait_ready
from tests.integration.test_acknowledged_replicated import _Call, _kill_server, _one, _wait_for
from tests.integration.test_failover_client import rows_with_token

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

WAITING = "SELECT pid FROM pg_stat_activity WHERE usename = %s AND wait_event = 'SyncRep'"


def _login(admin: str, primary: Node, standby: Node, role: str) -> str:
    """A login holding only ``role``, on a multi-host DSN that follows the primary."""
    name = f"photon_r_{uuid.uuid4().hex[:8]}"
    with autocommit(admin, guard=False) as conn, conn.cursor() as cur:
        cur.execute(sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(sql.Identifier(name), sql.Identifier(role)))
    return psycopg2.extensions.make_dsn(
        admin,
        host="127.0.0.1,127.0.0.1",
        port=f"{primary.port},{standby.port}",
        user=name,
        target_session_attrs="read-write",
        connect_timeout="2",
    )


def _user(dsn: str) -> str:
    return str(psycopg2.extensions.parse_dsn(dsn)["user"])


def _cut_off(primary: Node) -> None:
    """From now on no WAL reaches the standby: a COMMIT waits for it for ever."""
    os.kill(int(_one(primary.dsn, "SELECT pid FROM pg_stat_replication")), signal.SIGSTOP)


def _cancel_wait(primary: Node, user: str) -> int:
    """Cancel the wait for the standby of ``user``'s backend (waited for first): its COMMIT is now visible on the
    primary, and on no standby. Returns the backend's pid."""
    backend = _wait_for(lambda: _one(primary.dsn, WAITING, (user,)), f"{user}'s COMMIT to wait for the standby")
    assert _one(primary.dsn, "SELECT pg_cancel_backend(%s)", (backend,))
    return int(backend)


def _fail_over(primary: Node, standby: Node) -> None:
    _kill_server(primary)
    standby.promote()
    wait_ready(standby.dsn)


@pytest.fixture
def pair(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    # Two servers: the promoted one has no standby left, which the guard would refuse; the guard has its own tests.
    monkeypatch.setenv("PHOTON_REGISTRY_REPLICATION", "single")
    with sync_pair(tmp_path / "pg") as (primary, standby):
        admin = create_database(primary.dsn, "photon_review")
        yield primary, standby, admin


def test_a_login_whose_client_min_messages_hides_the_warning_is_not_told_won(pair: Any) -> None:
    """The warning is the only sign of a cancelled wait, and client_min_messages decides whether the server sends it.
    A DBA quieting a login (ALTER ROLE ... SET client_min_messages = error; or the database's setting, PGOPTIONS, a
    DSN's options) silences it: the guard, which refuses a role whose synchronous_commit acknowledges early, lets this
    one through, and pipeline A is told WON on a commit the promoted server never had; B then wins the click too."""
    primary, standby, admin = pair
    init_registry({"main": admin}, num_shards=1)
    dsn_a, dsn_b = (_login(admin, primary, standby, "photon_joiner") for _ in range(2))
    with autocommit(admin, guard=False) as conn, conn.cursor() as cur:
        cur.execute(sql.SQL("ALTER ROLE {} SET client_min_messages = error").format(sql.Identifier(_user(dsn_a))))
    tok_a, tok_b = create_owner(dsn_a, "dc-a").token(1), create_owner(dsn_b, "dc-b").token(1)
    now = int(time.time() * 1e6)
    click, warm = make_id("10.9.9.9", 7, now), make_id("10.9.9.9", 7, now + 1)
    options = RegistryOptions(failover_s=30)
    with IdRegistry({"main": dsn_a}, options) as reg_a, IdRegistry({"main": dsn_b}, options) as reg_b:
        reg_a.register([warm], tok_a)  # connections, batch tables and the click's partition, replicated
        reg_b.lookup([warm])
        _cut_off(primary)
        a = _Call(lambda: Outcome(reg_a.register([click], tok_a).outcomes[0]))
        a.start()
        _cancel_wait(primary, _user(dsn_a))
        a.join(3)
        told_before = a.result  # today: WON, at once
        _fail_over(primary, standby)
        a.join(40)
        b = Outcome(reg_b.register([click], tok_b).outcomes[0])
    held = rows_with_token(psycopg2.extensions.make_dsn(admin, port=standby.port))
    owner = next((tok for (ts, _src), tok in held.items() if ts == now), None)
    story = (
        f"A told {told_before} before the failover, {a.result} in the end ({a.error!r}); B {b.name}; held by {owner}"
    )
    assert a.result not in (Outcome.WON, Outcome.WON_AGAIN) or owner == tok_a.value, (
        f"A was told the click is its own on a commit the promoted server never had: {story}"
    )
    assert (a.result in (Outcome.WON, Outcome.WON_AGAIN)) != (b in (Outcome.WON, Outcome.WON_AGAIN)), story


def test_a_partition_another_pipeline_created_unreplicated_is_not_cached_across_a_failover(pair: Any) -> None:
    """Pipeline A creates the partition of a new time range; its COMMIT's wait is cancelled and A dies. Pipeline B's
    client lists the shard's partitions for the first time (no barrier: it wrote nothing), caches A's partition, and
    registers into it; the primary is lost and the promoted server has no such partition. B's client then never
    creates it: every registration in that range fails ("no partition of relation ... found for row", not retried)
    for as long as the client lives, though the server is up and would accept them."""
    primary, standby, admin = pair
    init_registry({"main": admin}, num_shards=1)
    dsn_a, dsn_b = (_login(admin, primary, standby, "photon_joiner") for _ in range(2))
    tok_b = create_owner(dsn_b, "dc-b").token(1)
    now = int(time.time() * 1e6)
    with IdRegistry({"main": dsn_b}, RegistryOptions(failover_s=30)) as reg_b:
        width = reg_b.partition_width_us
        old = (now // width - 3) * width  # a range no partition covers yet, well above the GC threshold (none yet)
        reg_b.lookup([make_id("10.9.9.9", 7, now)])  # B's connection and batch table, before the cut-off
        _cut_off(primary)
        # A's joiner creates the partition (photon.ensure_partitions, as its client does); the wait is cancelled.
        a = _Call(lambda: _ensure_partition(dsn_a, old))
        a.start()
        _cancel_wait(primary, _user(dsn_a))
        a.join(5)
        assert a.done_at is not None, "A's COMMIT still waiting after the cancel"
        # B registers a click in that range: it finds the partition, caches it, and its COMMIT waits for the standby.
        b = _Call(lambda: Outcome(reg_b.register([make_id("10.9.9.9", 7, old + 5)], tok_b).outcomes[0]))
        b.start()
        _wait_for(lambda: _one(primary.dsn, WAITING, (_user(dsn_b),)), "B's COMMIT to wait for the standby")
        _fail_over(primary, standby)
        b.join(40)
        assert b.done_at is not None, "B still registering 40 s after the failover"
        story = f"B's register across the failover: {b.result} {b.error!r}"
        assert b.error is None and b.result == Outcome.WON, story
        # The same client, a later batch in that range: the server is up and empty there.
        again = reg_b.register([make_id("10.9.9.9", 7, old + 6)], tok_b)
        assert again.outcomes.tolist() == [Outcome.WON]


def _ensure_partition(dsn: str, start_us: int) -> int:
    """What a joiner's client runs for a partition it lacks (IdRegistry._ensure_partitions), on its own."""
    conn = connect(dsn)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT photon.ensure_partitions(1, 0, %s::bigint[])", ([start_us],))
            made = int(cur.fetchone()[0])
        conn.commit()
        return made
    finally:
        conn.close()


def test_an_activation_the_standby_never_held_never_routes_one_id_to_two_shards(pair: Any) -> None:
    """A reshard activates v2; the COMMIT of main's activation has its wait cancelled. activate() retries, finds v2
    'active' (its own unreplicated commit), commits nothing and returns: the reshard reports v2 active. A joiner that
    loads its layout now routes by v2 (read_layout waits for no standby); the primary is lost and the promoted server
    neither activates nor enforces v2. A's client still routes an id stamped after valid_from to a v2 shard, B's
    (v1, never refused now) to a v1 shard: both are told WON, and the click is joined twice."""
    primary, standby, admin = pair
    init_registry({"main": admin}, num_shards=1)
    dsn_a, dsn_b = (_login(admin, primary, standby, "photon_joiner") for _ in range(2))
    dsn_r = _login(admin, primary, standby, "photon_reshard")
    tok_a, tok_b = create_owner(dsn_a, "dc-a").token(1), create_owner(dsn_b, "dc-b").token(1)
    now = int(time.time() * 1e6)
    options = RegistryOptions(failover_s=30)
    with IdRegistry({"main": dsn_a}, options) as reg_a, IdRegistry({"main": dsn_b}, options) as reg_b:
        reg_b.register([make_id("10.9.9.9", 7, now)], tok_b)  # B runs on v1 (its layout, connection, partition)
        p = plan({"main": dsn_r}, num_shards=2, lead_s=8, max_clock_skew_s=1)  # replicated, shard tables too
        _cut_off(primary)
        r = _Call(lambda: activate({"main": dsn_r}, p.version))
        r.start()
        _cancel_wait(primary, _user(dsn_r))
        r.join(5)
        activated = r.done_at is not None and r.error is None  # today: returns, the reshard reports "active"
        la = _Call(lambda: reg_a.layout().version)  # A's client starts now: its first read of the layout
        la.start()
        la.join(3)
        _fail_over(primary, standby)
        r.join(40)
        la.join(40)
        state = _one(
            psycopg2.extensions.make_dsn(admin, port=standby.port),
            "SELECT state FROM photon.shard_config WHERE version = %s",
            (p.version,),
        )
        click = make_id("10.9.9.8", 8, p.valid_from_us + 1_000)
        a = Outcome(reg_a.register([click], tok_a).outcomes[0])
        b = Outcome(reg_b.register([click], tok_b).outcomes[0])
    story = (
        f"activate() returned={activated} ({r.error!r}); A's layout read: {la.result} ({la.error!r}); v{p.version} on "
        f"the promoted server: {state}; A {a.name}, B {b.name}"
    )
    assert not (a in (Outcome.WON, Outcome.WON_AGAIN) and b in (Outcome.WON, Outcome.WON_AGAIN)), (
        f"one click won by two pipelines (routed to two shards): {story}"
    )
    assert not activated or state == "active", f"the reshard reported an activation the server forgot: {story}"


# A pipeline's joiner process committing its batch (PipelineState.commit, retried across a failover as in a lease);
# killed by the test while it retries.
_COMMIT = """
import json, sys
from photon.joiner.state import Lease, PipelineState
lease = Lease(*json.loads(sys.argv[2]))
print("ready", flush=True)
sys.stdin.readline()
PipelineState(sys.argv[1], lease.pipeline).commit(lease, 1, [("clicks", sys.argv[4])], json.loads(sys.argv[3]))
print("committed", flush=True)
"""

_METRICS = {
    **dict.fromkeys(
        ("query_files", "queries", "retries_in", "prefiltered", "won_again", "wasted", "retried", "unjoinable"), 0
    ),
    **dict.fromkeys(("quarantined", "cache_hits", "cache_lookups", "registry_retries"), 0),
    **{"started_at_us": 0, "duration_s": 0.1, "click_files": 1, "clicks": 1, "joined": 1, "registry_txns": 1},
    "registry_rows": 1,
}


def test_the_verifier_rolls_forward_no_batch_the_standby_never_held(pair: Any, tmp_path: Path) -> None:
    """Pipeline A registers click c (replicated) and stages its output; its batch COMMIT has its wait cancelled; A
    retries, waits in the barrier, and dies. The verifier (grace 0 here; 600 s in production, a standby cut off as
    long) finds the batch committed and unpublished, publishes its files into joined/, then waits for the standby to
    mark it published. The primary is lost: the promoted server has no such batch, so the verifier's retried pass
    fences A and judges c lost, and re-dispatches it from the logs, while c already sits in joined/: joined twice."""
    primary, standby, admin = pair
    init_registry({"main": admin}, num_shards=1)
    dsn_j, dsn_p = (_login(admin, primary, standby, "photon_joiner") for _ in range(2))
    dsn_v = _login(admin, primary, standby, "photon_verifier")
    out, logs = tmp_path / "out", tmp_path / "logs"
    now = int(time.time() * 1e6)
    click = make_id("10.9.9.9", 7, now)
    # The click's line in A's logs (the verifier re-dispatches lost clicks from there).
    name = f"{partition_of(now)}/10.9.9.9-7-000001.jsonl"
    line = {"click_id": click, "ts_us": now, "query_id": make_id("10.1.1.1", 3, now - 1_000_000), "ad_id": "a1"}
    (logs / "dc-a" / "clicks" / partition_of(now)).mkdir(parents=True)
    (logs / "dc-a" / "clicks" / name).write_text(json.dumps(line) + "\n")

    # A's lease, its registration and its staged output: all before the cut-off.
    lease = PipelineState(dsn_j, "dc-a").start_lease()
    assert lease is not None
    with IdRegistry({"main": dsn_j}, RegistryOptions(failover_s=30)) as reg:
        assert reg.register([click], lease.token(1)).outcomes.tolist() == [Outcome.WON]
    (out / "dc-a").mkdir(parents=True)
    (out / "dc-a" / "_pipeline.json").write_text(json.dumps({"pipeline": "dc-a", "dc": "dc-a"}) + "\n")
    tag = batch_tag(1, lease.epoch)
    row = {f.name: [None] for f in JOINED_SCHEMA} | {"click_id": [click], "click_ts_us": [now], "pipeline": ["dc-a"]}
    stage_rows(out / "dc-a", JOINED, f"_staging/{tag}", f"{tag}-p0000", pa.table(row, JOINED_SCHEMA), 1)

    # A's joiner process commits batch 1; the wait is cancelled; it retries (the barrier waits) and dies.
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}"}
    args = [dsn_p, json.dumps([lease.pipeline, lease.epoch, lease.owner_id, lease.last_batch])]
    process = subprocess.Popen(
        [sys.executable, "-c", _COMMIT, *args, json.dumps(_METRICS), name],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None and process.stdin is not None
        assert process.stdout.readline().strip() == "ready"
        _cut_off(primary)
        process.stdin.write("go\n")
        process.stdin.flush()
        first = _cancel_wait(primary, _user(dsn_p))
        # Its retry found the batch committed and waits in the barrier (another backend): it was told nothing yet,
        # and dies now.
        retry = f"{WAITING} AND pid <> %s"
        _wait_for(lambda: _one(primary.dsn, retry, (_user(dsn_p), first)), "A's retry to wait for the standby")
    finally:
        process.kill()
        process.wait()

    # The verifier: the batch looks committed and unpublished.
    v = _Call(lambda: verify_and_recover({"main": dsn_v}, out, logs, grace_s=0.0))
    v.start()
    _wait_for(lambda: _one(primary.dsn, WAITING, (_user(dsn_v),)) or v.done_at, "the verifier to roll forward")
    published_before = output.data_files(out, JOINED, "dc-a")
    _fail_over(primary, standby)
    v.join(60)
    assert v.done_at is not None, "the verifier still running 60 s after the failover"
    promoted = psycopg2.extensions.make_dsn(admin, port=standby.port)
    with autocommit(promoted, guard=False) as conn, conn.cursor() as cur:
        cur.execute("SELECT batch_seq, epoch FROM photon.batches WHERE pipeline = 'dc-a'")
        committed = {batch_tag(int(b), int(e)) for b, e in cur.fetchall()}
    joined = output.data_files(out, JOINED, "dc-a")  # a data file's name starts with its batch's tag
    redispatched = sorted(p.name for p in logs.rglob("recovered-*.jsonl"))
    report = v.result.to_dict() if v.result is not None else v.error
    story = (
        f"published by the verifier before the failover: {published_before}; in joined/ now: {joined}; batches "
        f"committed on the promoted server: {sorted(committed)}; re-dispatched: {redispatched}; verifier: {report}"
    )
    assert all(n.split("-p")[0] in committed for n in joined), f"output published on a lost commit: {story}"
    joined_clicks = output.ids(out, JOINED, "dc-a")
    assert not (click in joined_clicks and redispatched), f"the click is joined and re-dispatched: {story}"


def _plain_login(admin: str, role: str) -> str:
    """A login holding only ``role`` on a lone server."""
    name = f"photon_r_{uuid.uuid4().hex[:8]}"
    with autocommit(admin, guard=False) as conn, conn.cursor() as cur:
        cur.execute(sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(sql.Identifier(name), sql.Identifier(role)))
    return psycopg2.extensions.make_dsn(admin, user=name)


def test_a_fence_the_standby_never_held_is_not_acted_on_across_servers(pair: Any, tmp_path: Path) -> None:
    """The shard lives on server pg2, the pipelines on main. The verifier finds pipeline A idle past the grace period
    with click c registered in a batch it never committed, and fences it on main; that COMMIT's wait is cancelled.
    The pass runs again, reads A as fenced (its own unreplicated commit; no barrier), judges c lost, deletes its row
    on pg2 (durable there) and re-dispatches it. Main is lost and the promoted main never fenced A: A, slow but
    alive, commits its batch and publishes c; B joins the re-dispatched c, finds no row and wins it too."""
    primary, standby, admin = pair
    pg2 = Node(tmp_path / "pg2", "pg2").init()
    pg2.start()
    try:
        admin2 = create_database(pg2.dsn, "photon_review")
        init_registry({"main": admin, "pg2": admin2}, num_shards=1, placement=["pg2"])

        def login(role: str) -> dict[str, str]:
            return {"main": _login(admin, primary, standby, role), "pg2": _plain_login(admin2, role)}

        as_a, as_b, as_v = login("photon_joiner"), login("photon_joiner"), login("photon_verifier")
        out, logs = tmp_path / "out", tmp_path / "logs"
        now = int(time.time() * 1e6)
        click = make_id("10.9.9.9", 7, now)
        line = {"click_id": click, "ts_us": now, "query_id": make_id("10.1.1.1", 3, now - 1_000_000), "ad_id": "a1"}
        (logs / "dc-a" / "clicks" / partition_of(now)).mkdir(parents=True)
        (logs / "dc-a" / "clicks" / partition_of(now) / "10.9.9.9-7-000001.jsonl").write_text(json.dumps(line) + "\n")
        (out / "dc-a").mkdir(parents=True)
        (out / "dc-a" / "_pipeline.json").write_text(json.dumps({"pipeline": "dc-a", "dc": "dc-a"}) + "\n")

        # A's lease and its registration of c (on pg2) for batch 1; then A stalls (a long pause, a partition).
        state_a = PipelineState(as_a["main"], "dc-a")
        lease = state_a.start_lease()
        assert lease is not None
        with IdRegistry(as_a, RegistryOptions(failover_s=30)) as reg:
            assert reg.register([click], lease.token(1)).outcomes.tolist() == [Outcome.WON]
        tok_b = create_owner(as_b["main"], "dc-b").token(1)

        # The verifier fences A on main; the wait for main's standby is cancelled; the pass runs again.
        _cut_off(primary)
        v = _Call(lambda: verify_and_recover(as_v, out, logs, grace_s=0.0))
        v.start()
        first = _cancel_wait(primary, _user(as_v["main"]))
        # Today the pass runs again to its end at once; a pass that waits for the standby first is as good.
        retry = f"{WAITING} AND pid <> %s"
        _wait_for(lambda: v.done_at or _one(primary.dsn, retry, (_user(as_v["main"]), first)), "the second pass")
        before = v.result.to_dict() if v.result is not None else None

        # Main is lost; the promoted main never saw the fence. A wakes up and commits its batch; B meets c.
        _fail_over(primary, standby)
        v.join(60)
        assert v.done_at is not None, "the verifier still running 60 s after the failover"
        a_committed: bool | Exception
        try:
            a_committed = state_a.commit(lease, 1, [], _METRICS)
        except Exception as exc:  # FencedError: the fence held
            a_committed = exc
        with IdRegistry(as_b, RegistryOptions(failover_s=30)) as reg:
            b = Outcome(reg.register([click], tok_b).outcomes[0])
        retired = _one(
            psycopg2.extensions.make_dsn(admin, port=standby.port),
            "SELECT count(*) FROM photon.owners WHERE owner_id = %s AND retired_at IS NOT NULL",
            (lease.owner_id,),
        )
    finally:
        pg2.stop("immediate")
    story = (
        f"verifier before the failover: {before}; A's owner retired on the promoted main: {bool(retired)}; "
        f"verifier in the end: {v.result.to_dict() if v.result is not None else v.error!r}; A's batch commit after the "
        f"failover: {a_committed!r}; B registering the re-dispatched click: {b.name}"
    )
    assert not (a_committed is True and b in (Outcome.WON, Outcome.WON_AGAIN)), f"c published by A and B: {story}"
