"""A client on a multi-host DSN follows a failover: the primary stopped hard (pg_ctl stop -m immediate) while an
IdRegistry registers in a loop, its synchronous standby promoted a few seconds later; the client retries whole
transactions until the new primary answers, every id it was told it won is on the promoted server, and it carries on.
(No manager here: the test promotes, as Patroni would; the suite's Patroni cluster is issue 21's other part.)"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import psycopg2.extensions
import pytest
from psycopg2 import sql

from photon.logs.ids import EventKeys, make_id
from photon.pg import autocommit, create_database
from photon.registry.admin import init_registry
from photon.registry.client import IdRegistry, RegistryOptions
from photon.registry.owners import create_owner
from photon.registry.sharding import ShardRef
from tests.integration.replication import sync_pair

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

STOPPED_FOR_S = 12.0  # primary lost to promotion: beyond the old budget (12 tries, about 5 s), short of Patroni's 20 s


def rows_with_token(dsn: str) -> dict[tuple[int, int], int]:
    with autocommit(dsn, guard=False) as conn, conn.cursor() as cur:
        cur.execute("SELECT config_version, shard_no FROM photon.shard_map")
        refs = [ShardRef(int(v), int(s)) for v, s in cur.fetchall()]
        found: dict[tuple[int, int], int] = {}
        for ref in refs:
            cur.execute(sql.SQL("SELECT ts_us, src, token FROM photon.{}").format(sql.Identifier(ref.table)))
            found |= {(int(ts), int(src)): int(tok) for ts, src, tok in cur.fetchall()}
    return found


def test_registration_follows_a_promoted_standby(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Two servers only: the promoted one has no standby left, which the guard would refuse (a three-node cluster
    # keeps one); this test is about the client's retries, the guard has its own.
    monkeypatch.setenv("PHOTON_REGISTRY_REPLICATION", "single")
    with sync_pair(tmp_path) as (primary, standby):
        admin = create_database(primary.dsn, "photon_failover")
        init_registry({"main": admin}, num_shards=2)
        name = f"photon_f_{uuid.uuid4().hex[:8]}"
        with autocommit(admin, guard=False) as conn, conn.cursor() as cur:
            cur.execute(sql.SQL("CREATE ROLE {} LOGIN IN ROLE photon_joiner").format(sql.Identifier(name)))
        both = psycopg2.extensions.make_dsn(
            admin,
            host="127.0.0.1,127.0.0.1",
            port=f"{primary.port},{standby.port}",
            user=name,
            target_session_attrs="read-write",
            connect_timeout="2",
        )
        owner = create_owner(both, "dc-a")

        ours: dict[tuple[int, int], int] = {}  # key -> token the client was told WON / WON_AGAIN with
        done_at: list[float] = []  # when each batch returned
        errors: list[BaseException] = []
        stop = threading.Event()

        def loop() -> None:
            seq = 0
            try:
                with IdRegistry({"main": both}, RegistryOptions(failover_s=30)) as reg:
                    while not stop.is_set():
                        base = int(time.time() * 1e6)
                        batch = [make_id("10.1.0.1", seq % 60_000, base + i * 100) for i in range(300)]
                        token = owner.token(seq)
                        res = reg.register(batch, token)
                        keys: EventKeys = res.keys.take(res.ours.nonzero()[0])
                        ours.update({(int(t), int(s)): token.value for t, s in zip(keys.ts_us, keys.src, strict=True)})
                        done_at.append(time.monotonic())
                        seq += 1
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        worker = threading.Thread(target=loop)
        worker.start()
        try:
            time.sleep(1.0)
            assert done_at and not errors, errors
            lost_at = time.monotonic()
            primary.stop("immediate")
            time.sleep(STOPPED_FOR_S)
            standby.promote()
            promoted_at = time.monotonic()
            deadline = promoted_at + 40
            while sum(t > promoted_at for t in done_at) < 5 and not errors:
                assert time.monotonic() < deadline, "no batch committed on the promoted standby"
                time.sleep(0.1)
        finally:
            stop.set()
            worker.join(60)
        assert not errors, errors
        first_after = min(t for t in done_at if t > promoted_at)
        print(
            f"\nfailover: {len(done_at)} batches; first commit {first_after - promoted_at:.2f} s after the promotion, "
            f"{first_after - lost_at:.2f} s after the primary's loss"
        )
        on_new = rows_with_token(psycopg2.extensions.make_dsn(admin, port=standby.port))
        missing = [k for k in ours if k not in on_new]
        assert not missing, f"{len(missing)} ids told WON are not on the promoted server"
        assert all(on_new[k] == tok for k, tok in ours.items())
        assert len(done_at) > sum(t > promoted_at for t in done_at) > 0  # it carried on
