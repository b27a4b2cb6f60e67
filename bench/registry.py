"""`make bench-registry`: the registry's write paths measured side by side in one run, on the same table shapes.

  single-row   one conditional INSERT per SERIALIZABLE transaction (the baseline)
  batched new  IdRegistry.register, every id new
  half dup     IdRegistry.register, half of every batch already registered by another token
  ceiling      binary COPY of the same rows into unindexed tables (no conflict check, no index)

All on a durable server (fsync and synchronous_commit on; checked and printed). The server is PHOTON_REGISTRY_DSN's
or a fresh embedded PostgreSQL. The last line is the figures as one JSON object.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
from psycopg2 import sql
from rich.console import Console
from rich.table import Table

from photon.logs.ids import EventKeys
from photon.pg import EmbeddedPostgres, autocommit, connect, create_database, drop_database, with_dbname
from photon.registry.admin import init_registry
from photon.registry.client import IdRegistry, RegistryOptions, encode_copy
from photon.registry.owners import create_owner
from photon.registry.sharding import ShardRef

console = Console()


def workload(n: int, seed: int, start_us: int) -> EventKeys:
    """Click-like ids: a thousand server processes, timestamps rising through one hour (as micro-batches see them)."""
    rng = np.random.default_rng(seed)
    ts = start_us + np.sort(rng.integers(0, 3_600_000_000, n))
    ip = (10 << 24) | rng.integers(0, 1000, n)
    pid = rng.integers(1000, 60000, n)
    src = ((ip.astype(np.uint64) << np.uint64(32)) | pid.astype(np.uint64)).view(np.int64)
    return EventKeys(ts.astype(np.int64), src)


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_single_row(dsn: str, reg: IdRegistry, keys: EventKeys, token: int) -> float:
    layout = reg.layout()
    versions, shards = layout.assign(keys)
    conn = connect(dsn)
    conn.set_session(isolation_level="SERIALIZABLE")
    stmts = {
        s: sql.SQL("INSERT INTO photon.{} (ts_us, src, token) VALUES (%s, %s, %s) ON CONFLICT DO NOTHING").format(
            sql.Identifier(ShardRef(int(versions[0]), s).table)
        )
        for s in set(shards.tolist())
    }

    def run() -> None:
        with conn.cursor() as cur:
            for t, s, sh in zip(keys.ts_us.tolist(), keys.src.tolist(), shards.tolist(), strict=True):
                cur.execute(stmts[sh], (t, s, token))
                conn.commit()

    seconds = timed(run)
    conn.close()
    return len(keys) / seconds


def bench_register(
    reg: IdRegistry, batches: list[EventKeys | pa.Array], owner_token: Callable[[int], object], won_share: float = 1.0
) -> float:
    total = sum(len(b) for b in batches)
    results = []

    def run() -> None:
        for seq, batch in enumerate(batches):
            results.append(reg.register(batch, owner_token(seq)))  # type: ignore[arg-type]

    rate = total / timed(run)
    won = sum(r.counts()["won"] for r in results)
    if abs(won - won_share * total) > 1:  # a benchmark that did not do the work measures nothing
        raise SystemExit(f"expected {won_share * total:.0f} ids won, got {won}")
    return rate


def bench_copy_ceiling(dsn: str, batches: list[EventKeys], shards: int, token: int) -> float:
    with autocommit(dsn) as conn, conn.cursor() as cur:
        for s in range(shards):
            cur.execute(
                sql.SQL("CREATE TABLE photon.{} (ts_us bigint, src bigint, token bigint)").format(
                    sql.Identifier(f"ceiling_{s}")
                )
            )
    conns = [connect(dsn) for _ in range(shards)]
    # Same split as the registry: each batch is cut into per-shard parts written in parallel, one commit each.
    parts = [[b.take(np.arange(s, len(b), shards)) for s in range(shards)] for b in batches]
    total = sum(len(b) for b in batches)

    def writer(s: int) -> None:
        with conns[s].cursor() as cur:
            copy = sql.SQL("COPY photon.{} FROM STDIN WITH (FORMAT binary)").format(sql.Identifier(f"ceiling_{s}"))
            for batch_parts in parts:
                k = batch_parts[s]
                cur.copy_expert(copy, io.BytesIO(encode_copy(k.ts_us, k.src, np.full(len(k), token, np.int64))))
                conns[s].commit()

    def run() -> None:
        with ThreadPoolExecutor(shards) as pool:
            for fut in [pool.submit(writer, s) for s in range(shards)]:
                fut.result()

    rate = total / timed(run)
    for c in conns:
        c.close()
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ids", type=int, default=1_000_000, help="ids per batched measurement")
    ap.add_argument("--batch", type=int, default=50_000, help="ids per register call")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--single-row-ids", type=int, default=3_000)
    args = ap.parse_args()

    embedded = None
    admin = os.environ.get("PHOTON_REGISTRY_DSN")
    if admin:
        admin = with_dbname(admin, "postgres")
    else:
        embedded = EmbeddedPostgres(Path(tempfile.mkdtemp(prefix="photon-bench-")) / "pg", cleanup_mode="delete")
        embedded.start()
        admin = embedded.admin_dsn
    dbname = f"photon_bench_{uuid.uuid4().hex[:8]}"
    dsn = create_database(admin, dbname)
    try:
        with autocommit(dsn) as conn, conn.cursor() as cur:
            cur.execute("SELECT current_setting('fsync'), current_setting('synchronous_commit'), version()")
            fsync, sync_commit, version = cur.fetchone()
        console.print(
            f"server: {version.split(' on ')[0]}, fsync={fsync}, synchronous_commit={sync_commit}, "
            f"{'embedded' if embedded else 'PHOTON_REGISTRY_DSN'}; {args.shards} shards, "
            f"batches of {args.batch:,}, {os.cpu_count()} cores"
        )
        init_registry({"main": dsn}, num_shards=args.shards)
        reg = IdRegistry({"main": dsn})
        a, b = create_owner(dsn, "bench-a"), create_owner(dsn, "bench-b")
        n, bs = args.ids, args.batch
        base = int(time.time() * 1e6) - 4 * 3_600_000_000
        new_keys = workload(n, 1, base)
        strings_keys = workload(n, 2, base)
        dup_keys = workload(n, 3, base)
        split = lambda k: [k.take(np.arange(i, min(i + bs, len(k)))) for i in range(0, len(k), bs)]  # noqa: E731

        # Warm-up: connections, temp tables and the hour partitions exist before anything is timed.
        reg.register(workload(10_000, 9, base), a.token(999_999))

        single = bench_single_row(dsn, reg, workload(args.single_row_ids, 4, base), b.token(0).value)
        batched_new = bench_register(reg, split(new_keys), a.token)
        with IdRegistry({"main": dsn}, RegistryOptions(fast_path=False)) as cond:
            cond.register(workload(10_000, 10, base), a.token(999_998))
            conditional_new = bench_register(cond, split(workload(n, 6, base)), lambda s: a.token(30_000 + s))
        string_batches = [pa.array(k.to_ids(), pa.string()) for k in split(strings_keys)]
        batched_strings = bench_register(reg, string_batches, lambda s: a.token(10_000 + s))
        # Half duplicates: every other id of each batch was registered by another owner beforehand (not timed).
        reg.register(dup_keys.take(np.arange(0, n, 2)), b.token(1))
        batched_dup = bench_register(reg, split(dup_keys), lambda s: a.token(20_000 + s), won_share=0.5)
        ceiling = bench_copy_ceiling(dsn, split(workload(n, 5, base)), args.shards, a.token(0).value)
        reg.close()
    finally:
        drop_database(admin, dbname)
        if embedded:
            embedded.stop()

    figures = {
        "single_row_ids_per_s": round(single),
        "batched_new_ids_per_s": round(batched_new),
        "batched_half_dup_ids_per_s": round(batched_dup),
        "copy_ceiling_rows_per_s": round(ceiling),
        "ratio_batched_to_ceiling": round(batched_new / ceiling, 3),
        "batched_new_from_strings_ids_per_s": round(batched_strings),
        "batched_new_conditional_only_ids_per_s": round(conditional_new),
        "ratio_batched_to_single_row": round(batched_new / single, 1),
        "batch": bs,
        "shards": args.shards,
    }
    table = Table(title="IdRegistry write paths (durable)")
    table.add_column("path")
    table.add_column("ids/s", justify="right")
    table.add_column("x single-row", justify="right")
    table.add_column("of ceiling", justify="right")
    for name, rate in [
        ("single-row conditional insert", single),
        ("register, all new", batched_new),
        ("register, all new, parsing id strings", batched_strings),
        ("register, all new, conditional path only", conditional_new),
        ("register, 50% duplicates", batched_dup),
        ("COPY into unindexed table (ceiling)", ceiling),
    ]:
        table.add_row(name, f"{rate:,.0f}", f"{rate / single:,.1f}", f"{rate / ceiling:.2f}")
    console.print(table)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
