"""The IdRegistry against a real PostgreSQL: outcomes, races between processes, GC thresholds, shard configuration
changes across servers, bad input, unreachable servers and commits whose outcome the client never heard."""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import psycopg2
import pytest

from photon.logs.ids import EventKeys, InvalidEventIdError, make_id
from photon.pg import RegistryUnavailableError, autocommit, with_dbname
from photon.registry.admin import add_shard_config, advance_gc_threshold, init_registry, status
from photon.registry.client import IdRegistry, Outcome, RegistryError, RegistryOptions
from photon.registry.migrations import MigrationError, apply_migrations
from photon.registry.owners import Token, create_owner
from photon.registry.sharding import ShardRef
from tests.integration.helpers import CommitCuttingProxy, keys_from, race_worker, spread_worker

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration
MakeDb = Callable[[], str]
HOUR = 3_600_000_000


@pytest.fixture
def servers(make_db: MakeDb) -> dict[str, str]:
    dsn = make_db()
    init_registry({"main": dsn}, num_shards=4)
    return {"main": dsn}


@pytest.fixture(params=[True, False], ids=["fast-path", "conditional-only"])
def registry(servers: dict[str, str], request: pytest.FixtureRequest) -> Iterator[IdRegistry]:
    """Both write paths must give the same answers."""
    with IdRegistry(servers, RegistryOptions(fast_path=request.param)) as reg:
        yield reg


def now_us() -> int:
    return int(time.time() * 1e6)


def ids_at(base: int, n: int, ip: str = "10.0.0.1", pid: int = 4711, step: int = 1000) -> list[str]:
    return [make_id(ip, pid, base + i * step) for i in range(n)]


def table_rows(servers: dict[str, str]) -> dict[tuple[int, int], tuple[ShardRef, str, int | None]]:
    """Every registry row of every shard on every server: key -> (shard, server, token)."""
    with IdRegistry(servers) as reg:
        layout = reg.layout(refresh=True)
    rows: dict[tuple[int, int], tuple[ShardRef, str, int | None]] = {}
    for ref in layout.shards():
        server = layout.server_of(ref)
        with autocommit(servers[server]) as conn, conn.cursor() as cur:
            cur.execute(f"SELECT ts_us, src, token FROM photon.{ref.table}")  # test-only, name from ShardRef
            for ts, src, tok in cur.fetchall():
                assert (ts, src) not in rows, "a key stored twice"
                rows[(ts, src)] = (ref, server, tok)
    return rows


def test_outcomes_new_again_lost(servers: dict[str, str], registry: IdRegistry) -> None:
    a, b = create_owner(servers["main"], "dc-a"), create_owner(servers["main"], "dc-b")
    ids = ids_at(now_us() - 60_000_000, 1000)
    first = registry.register(ids, a.token(1))
    assert first.counts() == {"won": 1000, "won_again": 0, "lost": 0, "too_old": 0}
    again = registry.register(ids, a.token(1))  # a retry after an unknown outcome
    assert again.counts()["won_again"] == 1000
    other = registry.register(ids[:400] + ids_at(now_us(), 10, ip="10.0.0.2"), b.token(1))
    assert other.outcomes.tolist() == [Outcome.LOST] * 400 + [Outcome.WON] * 10
    later_batch_same_owner = registry.register(ids[:5], a.token(2))  # same owner, other batch: another token
    assert set(later_batch_same_owner.outcomes.tolist()) == {Outcome.LOST}
    rows = table_rows(servers)
    assert len(rows) == 1010
    assert {tok for _, _, tok in rows.values()} == {a.token(1).value, b.token(1).value}


def test_duplicates_inside_a_batch_get_one_answer(servers: dict[str, str], registry: IdRegistry) -> None:
    owner = create_owner(servers["main"], "dc-a")
    ids = ids_at(now_us(), 50)
    res = registry.register(ids + ids[::-1] + ids[:7], owner.token(0))
    assert len(res.outcomes) == 107
    assert set(res.outcomes.tolist()) == {Outcome.WON}
    assert sum(s.rows for s in res.shards) == 50  # deduplicated before it reached the shards
    assert len(table_rows(servers)) == 50


def test_lookup_reports_registration_token_and_age(servers: dict[str, str], registry: IdRegistry) -> None:
    owner = create_owner(servers["main"], "dc-a")
    base = now_us() - 2 * HOUR
    registered = ids_at(base, 300)
    registry.register(registered, owner.token(9))
    fresh = ids_at(base, 300, ip="10.9.9.9")
    for ref in registry.layout().shards():
        advance_gc_threshold(servers, ref, base + 100 * 1000)
    res = registry.lookup(registered + fresh)
    assert res.registered.tolist() == [True] * 300 + [False] * 300
    assert set(res.tokens[:300].tolist()) == {owner.token(9).value}
    assert res.tokens[300:].tolist() == [0] * 300
    assert res.too_old.tolist() == ([True] * 100 + [False] * 200) * 2


def test_processes_racing_agree_on_exactly_one_winner(servers: dict[str, str]) -> None:
    rng = np.random.default_rng(11)
    n = 40_000
    ts = np.sort(now_us() - rng.integers(0, 3 * HOUR, n)).astype(np.int64)
    src = ((10 << 56) | rng.integers(1, 1 << 20, n)).astype(np.int64)
    workers = 4
    # Each process takes an overlapping 60% of the ids; every id is wanted by someone.
    subsets = [np.flatnonzero(rng.random(n) < 0.6) for _ in range(workers)]
    wanted = np.zeros(n, dtype=bool)
    for s in subsets:
        wanted[s] = True
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=race_worker, args=(servers, f"w{i}", ts, src, subsets[i], 2_000, i, i % 2 == 0, start, out))
        for i in range(workers)
    ]
    for p in procs:
        p.start()
    start.set()
    results = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    rows = table_rows(servers)
    assert len(rows) == int(wanted.sum())
    winners = np.zeros(n, dtype=np.int64)
    holder = {owner: set() for _, owner, _, _ in results}
    for _, owner, pos, outcomes in results:
        first_try = outcomes != 100
        np.add.at(winners, pos[first_try & (outcomes == Outcome.WON)], 1)
        holder[owner].update(pos[outcomes == Outcome.WON].tolist())
        # the same-token retry of batch 0 is "won again" exactly where batch 0 was won
        assert not np.any(outcomes == Outcome.WON_AGAIN)
    assert winners[wanted].tolist() == [1] * int(wanted.sum())
    for owner, positions in holder.items():
        for p in positions:
            assert Token.from_value(rows[(int(ts[p]), int(src[p]))][2]).owner_id == owner
    for _, owner, pos, outcomes in results:
        lost = pos[outcomes == Outcome.LOST]
        assert all(Token.from_value(rows[(int(ts[p]), int(src[p]))][2]).owner_id != owner for p in lost.tolist())
        retried = outcomes == 100
        assert retried.sum() > 0


def test_gc_threshold_moving_during_inserts_admits_nothing_older(servers: dict[str, str]) -> None:
    rng = np.random.default_rng(5)
    n = 60_000
    base = now_us() - 3 * HOUR
    ts = (base + rng.integers(0, 2 * HOUR, n)).astype(np.int64)
    src = ((10 << 56) | rng.integers(1, 1 << 20, n)).astype(np.int64)
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=spread_worker, args=(servers, f"w{i}", ts, src, 1_500, i, start, out)) for i in range(2)
    ]
    for p in procs:
        p.start()
    with IdRegistry(servers) as reg:
        shards = reg.layout().shards()
    below_after_move: list[tuple[ShardRef, int, int]] = []
    start.set()
    steps = 20
    for step in range(1, steps + 1):
        time.sleep(0.05)
        threshold = base + step * (2 * HOUR) // (steps + 4)
        for ref in shards:
            assert advance_gc_threshold(servers, ref, threshold) == threshold
            with autocommit(servers["main"]) as conn, conn.cursor() as cur:
                cur.execute(f"SELECT count(*) FROM photon.{ref.table} WHERE ts_us < %s", (threshold,))
                below_after_move.append((ref, threshold, int(cur.fetchone()[0])))
    results = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for ref, threshold, count in below_after_move:
        with autocommit(servers["main"]) as conn, conn.cursor() as cur:
            cur.execute(f"SELECT count(*) FROM photon.{ref.table} WHERE ts_us < %s", (threshold,))
            assert int(cur.fetchone()[0]) == count, f"rows below {threshold} appeared in {ref} after it moved"
    too_old = sum(int(c[Outcome.TOO_OLD]) for _, c in results)
    assert too_old > 0  # the writers really raced the threshold
    final = base + steps * (2 * HOUR) // (steps + 4)
    rows = table_rows(servers)
    registered_below_final = sum(1 for (t, _) in rows if t < final)
    assert registered_below_final == sum(c for r, th, c in below_after_move if th == final)


def test_threshold_never_goes_back(servers: dict[str, str], registry: IdRegistry) -> None:
    ref = registry.layout().shards()[0]
    assert advance_gc_threshold(servers, ref, 5_000) == 5_000
    assert advance_gc_threshold(servers, ref, 1_000) == 5_000  # a slower GC run racing: no effect
    with (
        autocommit(servers["main"]) as conn,
        conn.cursor() as cur,
        pytest.raises(psycopg2.Error, match="cannot go back"),
    ):
        cur.execute("UPDATE photon.shard_state SET gc_threshold_us = 10 WHERE shard_no = %s", (ref.shard_no,))


def test_too_old_ids_are_refused_in_a_mixed_batch(servers: dict[str, str], registry: IdRegistry) -> None:
    owner = create_owner(servers["main"], "dc-a")
    cut = now_us() - HOUR
    for ref in registry.layout().shards():
        advance_gc_threshold(servers, ref, cut)
    old, young = ids_at(cut - 500_000_000, 100), ids_at(cut, 100)
    res = registry.register(old + young, owner.token(0))
    assert res.outcomes.tolist() == [Outcome.TOO_OLD] * 100 + [Outcome.WON] * 100
    assert min(t for t, _ in table_rows(servers)) >= cut


def test_shard_config_change_routes_ids_by_their_own_time_across_two_servers(make_db: MakeDb) -> None:
    servers = {"main": make_db(), "pg2": make_db()}
    init_registry(servers, num_shards=2)
    change = now_us() - HOUR
    cfg = add_shard_config(servers, valid_from_us=change, num_shards=3, placement=["main", "pg2"])
    assert cfg.version == 2
    owner = create_owner(servers["main"], "dc-a")
    rng = np.random.default_rng(3)
    ts = np.concatenate([change - rng.integers(1, HOUR, 2000), change + rng.integers(0, HOUR // 2, 2000)])
    src = ((10 << 56) | rng.integers(1, 1 << 20, 4000)).astype(np.int64)
    keys = keys_from(ts, src)
    with IdRegistry(servers) as reg:
        res = reg.register(keys, owner.token(0))
        layout = reg.layout()
    assert res.counts()["won"] == 4000
    rows = table_rows(servers)
    assert len(rows) == 4000
    for i, event_id in enumerate(keys.to_ids()):
        want = layout.shard_of(event_id)
        shard, server, _ = rows[(int(ts[i]), int(src[i]))]
        assert shard == want
        assert want.version == (1 if ts[i] < change else 2)
        assert server == ("pg2" if want == ShardRef(2, 1) else "main")
    assert {s for _, s, _ in rows.values()} == {"main", "pg2"}
    # Lookups follow the same rule.
    with IdRegistry(servers) as reg:
        assert reg.lookup(keys).registered.all()


def test_malformed_ids_are_refused_before_anything_is_written(servers: dict[str, str], registry: IdRegistry) -> None:
    owner = create_owner(servers["main"], "dc-a")
    good = ids_at(now_us(), 100)
    with pytest.raises(InvalidEventIdError) as err:
        registry.register([*good[:50], "10.0.0.1-12", *good[50:], "010.0.0.1-1-1"], owner.token(0))
    assert err.value.total == 2
    assert [p for p, _, _ in err.value.problems] == [50, 101]
    with pytest.raises(InvalidEventIdError, match="differs from the id"):
        registry.register(good[:2], owner.token(0), times=[EventKeys.from_ids(good[:1]).ts_us[0], 5])
    with pytest.raises(InvalidEventIdError, match="in the future"):
        registry.register([make_id("10.0.0.1", 1, now_us() + 3 * 86_400_000_000)], owner.token(0))
    assert table_rows(servers) == {}


def test_empty_batch_is_an_empty_answer_without_a_transaction(registry: IdRegistry, servers: dict[str, str]) -> None:
    owner = create_owner(servers["main"], "dc-a")
    res = registry.register([], owner.token(0))
    assert len(res.outcomes) == 0 and res.shards == []
    assert len(registry.lookup([]).registered) == 0


def test_unreachable_server_fails_the_batch_with_nothing_written(make_db: MakeDb) -> None:
    main = make_db()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    dead_port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    dead = f"host=127.0.0.1 port={dead_port} dbname=nowhere user=postgres connect_timeout=2"
    pg2 = make_db()
    init_registry({"main": main, "pg2": pg2}, num_shards=4, placement=["main", "pg2"])
    owner = create_owner(main, "dc-a")
    ids = ids_at(now_us(), 500)
    with (
        IdRegistry({"main": main, "pg2": dead}, RegistryOptions(connect_attempts=2, failover_s=0)) as reg,
        pytest.raises(RegistryUnavailableError, match=f"port={dead_port}"),
    ):
        reg.register(ids, owner.token(0))
    assert table_rows({"main": main, "pg2": pg2}) == {}
    with IdRegistry({"main": main, "pg2": pg2}) as reg:  # once the server is back, the same batch goes through
        assert reg.register(ids, owner.token(0)).counts()["won"] == 500


def test_lost_connection_during_commit_is_resolved_by_rereading(servers: dict[str, str]) -> None:
    proxy = CommitCuttingProxy(servers["main"])
    try:
        owner = create_owner(servers["main"], "dc-a")
        # One shard, so the one COMMIT the proxy cuts is the registration's.
        with IdRegistry({"main": proxy.dsn}, RegistryOptions(backoff_base_s=0.01)) as reg:
            layout = reg.layout()
            ids = [i for i in ids_at(now_us(), 400) if layout.shard_of(i) == ShardRef(1, 0)]
            reg.register(ids[:1], owner.token(0))  # connections and partitions ready before arming
            proxy.armed.set()
            res = reg.register(ids[1:], owner.token(1))
        assert proxy.cut.is_set()
        assert res.shards[0].attempts == 2
        # The first attempt committed; the client never heard it, retried, and found its own token.
        assert set(res.outcomes.tolist()) == {Outcome.WON_AGAIN}
        rows = table_rows(servers)
        assert {tok for _, _, tok in rows.values()} == {owner.token(0).value, owner.token(1).value}
        assert len(rows) == len(ids)
    finally:
        proxy.close()


def test_migrations_apply_once_and_guard_their_history(make_db: MakeDb, tmp_path: Path) -> None:
    dsn = make_db()
    report = init_registry({"main": dsn}, num_shards=2)
    assert report.migrations["main"] == sorted(p.name for p in (ROOT / "sql").glob("*.sql"))
    assert report.migrations["main"][:2] == ["0001_registry.sql", "0002_pipelines.sql"]
    again = init_registry({"main": dsn}, num_shards=8)
    assert again.migrations["main"] == [] and again.created_config is None
    assert [c.num_shards for c in again.existing_config] == [2]
    edited = tmp_path / "sql"
    edited.mkdir()
    original = (Path(__file__).resolve().parents[2] / "sql" / "0001_registry.sql").read_text()
    (edited / "0001_registry.sql").write_text(original + "\n-- edited\n")
    with pytest.raises(MigrationError, match="changed after it was applied"):
        apply_migrations(dsn, edited)


def test_roles_have_least_privilege(servers: dict[str, str], registry: IdRegistry, pg_admin_dsn: str) -> None:
    owner = create_owner(servers["main"], "dc-a")
    registry.register(ids_at(now_us(), 10), owner.token(0))
    table = registry.layout().shards()[0].table
    login = f"photon_t_joiner_{owner.owner_id}_{int(time.time())}"
    with autocommit(servers["main"]) as conn, conn.cursor() as cur:
        cur.execute(f"CREATE ROLE {login} LOGIN IN ROLE photon_joiner")
    try:
        joiner_dsn = psycopg2.extensions.make_dsn(servers["main"], user=login)
        mine = ids_at(now_us() - 1000, 10, ip="10.3.3.3")
        with IdRegistry({"main": joiner_dsn}) as reg:  # the joiner role can register and look up
            res = reg.register(mine, create_owner(joiner_dsn, "dc-a").token(0))
            assert res.counts()["won"] == 10
            assert reg.lookup(mine).registered.all()
        with autocommit(joiner_dsn) as conn, conn.cursor() as cur:
            for stmt in (
                f"DELETE FROM photon.{table}",
                f"UPDATE photon.{table} SET token = NULL",
                "UPDATE photon.shard_state SET gc_threshold_us = gc_threshold_us + 1",
                f"DROP TABLE photon.{table}",
                "SELECT photon.create_shard(1, 99)",
            ):
                with pytest.raises(psycopg2.errors.InsufficientPrivilege):
                    cur.execute(stmt)
    finally:
        with autocommit(servers["main"]) as conn, conn.cursor() as cur:
            cur.execute(f"DROP OWNED BY {login}; DROP ROLE {login}")


def test_uninitialised_registry_is_a_clear_error(make_db: MakeDb) -> None:
    with IdRegistry({"main": make_db()}) as reg, pytest.raises(RegistryError, match="photon registry init"):
        reg.layout()


def test_status_reports_shards_thresholds_and_rows(servers: dict[str, str], registry: IdRegistry) -> None:
    owner = create_owner(servers["main"], "dc-a")
    registry.register(ids_at(now_us() - 2 * HOUR - 60_000_000, 1000, step=7_200_000), owner.token(0))  # 2 partitions
    ref = registry.layout().shards()[2]
    advance_gc_threshold(servers, ref, 123)
    st = status(servers)
    assert st["servers"]["main"]["migrations"] == sorted(p.stem for p in (ROOT / "sql").glob("*.sql"))
    shards = st["configs"][0]["shards"]
    assert sum(s["rows"] for s in shards) == 1000
    assert shards[2]["gc_threshold_us"] == 123
    assert all(s["partitions"] >= 2 for s in shards)
    assert with_dbname(servers["main"], "x")  # DSN helpers accept what psycopg2 accepts
