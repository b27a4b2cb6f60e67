"""`make bench-registry`: the registry's write paths measured side by side in one run, on the same table shapes.

  single-row   one conditional INSERT per SERIALIZABLE transaction (the baseline)
  batched new  IdRegistry.register, every id new
  half dup     IdRegistry.register, half of every batch already registered by another token
  ceiling      binary COPY of the same rows into unindexed tables (no conflict check, no index)

All on a durable server (fsync and synchronous_commit on; checked and printed). The server is PHOTON_REGISTRY_DSN's
or a fresh embedded PostgreSQL.

Then "batched new" again, side by side: the single server and a fresh local three-node cluster (photon registry
cluster: Patroni, quorum commit, every commit waits for one standby's flush), brought up in a temporary folder and
torn down at the end, even on failure. The two alternate, --runs times each, on fresh ids; medians, min and max.
--no-replicated skips the cluster. The last line is the figures as one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import psutil
import psycopg2
import pyarrow as pa
from psycopg2 import sql
from rich.console import Console
from rich.table import Table

from photon.logs.ids import EventKeys
from photon.pg import (
    EmbeddedPostgres,
    RegistryUnavailableError,
    autocommit,
    connect,
    create_database,
    drop_database,
    with_dbname,
)
from photon.registry.admin import init_registry
from photon.registry.client import IdRegistry, RegistryOptions, encode_copy
from photon.registry.cluster import NODES, LocalCluster
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


class Side:
    """One server under test in the side-by-side runs: its registry, an owner, and what each run measured."""

    def __init__(self, name: str, dsn: str, owner_name: str, cluster: LocalCluster | None = None):
        self.name, self.dsn, self.cluster = name, dsn, cluster
        self.reg = IdRegistry({"main": dsn})
        self.owner = create_owner(dsn, owner_name)
        self.rates: list[float] = []
        self.wal_bytes: list[int] = []
        self.txn_seconds: list[float] = []  # one per shard transaction (COPY, commit and its wait for the standby)
        self.flush_lag_s: list[float] = []  # sampled from pg_stat_replication during the runs
        self.backend_samples = [0, 0]  # registry backends seen waiting for a standby (SyncRep), seen active
        self.cpu_s: list[dict[str, float]] = []  # per run: CPU seconds of the primary's and the standbys' PostgreSQL
        self.wall_s: list[float] = []

    def run(self, batches: list[EventKeys], first_seq: int, sample_lag: bool) -> float:
        total = sum(len(b) for b in batches)
        results = []
        start_lsn = _wal_lsn(self.dsn)
        cpu0 = _node_cpu_s(self.cluster) if self.cluster else None
        stop = threading.Event()
        sampler = threading.Thread(target=self._sample_lag, args=(stop,), daemon=True) if sample_lag else None

        def run() -> None:
            for seq, batch in enumerate(batches):
                results.append(self.reg.register(batch, self.owner.token(first_seq + seq)))

        if sampler:
            sampler.start()
        try:
            seconds = timed(run)
        finally:
            stop.set()
            if sampler:
                sampler.join()
        won = sum(r.counts()["won"] for r in results)
        if won != total:  # a benchmark that did not do the work measures nothing
            raise SystemExit(f"{self.name}: expected {total} ids won, got {won}")
        self.rates.append(total / seconds)
        self.wall_s.append(seconds)
        if self.cluster and cpu0 is not None:
            cpu1 = _node_cpu_s(self.cluster)
            self.cpu_s.append({role: cpu1[role] - cpu0.get(role, 0.0) for role in cpu1})
        self.wal_bytes.append(_wal_bytes_since(self.dsn, start_lsn))
        self.txn_seconds += [st.seconds for r in results for st in r.shards]
        return total / seconds

    def _sample_lag(self, stop: threading.Event) -> None:
        # The standbys' own report of how long a flush took to come back (NULL when idle): the commit's wait.
        # And what the registry's backends are doing: a backend in wait event SyncRep has committed locally and waits
        # for a standby's flush; the share of such samples is the share of the batches' server time spent waiting.
        with autocommit(self.dsn) as conn, conn.cursor() as cur:
            while not stop.wait(0.1):
                cur.execute("SELECT extract(epoch FROM flush_lag) FROM pg_stat_replication WHERE flush_lag IS NOT NULL")
                self.flush_lag_s += [float(v) for (v,) in cur.fetchall()]
                cur.execute(
                    "SELECT count(*) FILTER (WHERE wait_event = 'SyncRep'), count(*) FROM pg_stat_activity"
                    " WHERE application_name = %s AND state = 'active'",
                    (RegistryOptions.application_name,),
                )
                syncrep, active = cur.fetchone()
                self.backend_samples[0] += int(syncrep)
                self.backend_samples[1] += int(active)


def _node_cpu_s(cluster: LocalCluster) -> dict[str, float]:
    """CPU seconds used so far by each role's PostgreSQL processes (postmaster and children): 'primary' and
    'standbys' (walreceiver, startup/replay, their writers and checkpointers)."""
    out = {"primary": 0.0, "standbys": 0.0}
    for node in cluster.status():
        with contextlib.suppress(OSError, ValueError, IndexError, psutil.Error):
            pid = int((cluster.folder / node.name / "data" / "postmaster.pid").read_text().splitlines()[0])
            root = psutil.Process(pid)
            for proc in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    t = proc.cpu_times()
                    out["primary" if node.role == "leader" else "standbys"] += t.user + t.system
    return out


def _wal_lsn(dsn: str) -> str:
    with autocommit(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT pg_current_wal_lsn()::text")
        return str(cur.fetchone()[0])


def _wal_bytes_since(dsn: str, lsn: str) -> int:
    with autocommit(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s::pg_lsn)", (lsn,))
        return int(cur.fetchone()[0])


@contextlib.contextmanager
def replicated_server(dbname: str) -> Iterator[tuple[LocalCluster, str, float]]:
    """A fresh local three-node cluster in a temporary folder with an empty database ``dbname``; yields the cluster,
    the database's multi-host DSN and the seconds `up` took. Stopped and removed afterwards, whatever happened."""
    folder = Path(tempfile.mkdtemp(prefix="photon-bench-cluster-"))
    cluster = LocalCluster(folder)
    try:
        t0 = time.perf_counter()
        admin = cluster.up()
        up_s = time.perf_counter() - t0
        dsn = create_database(admin, dbname)
        # Quorum commit waits for a flush, not a replay: a standby may not have the database yet, and libpq stops at
        # a standby that refuses the name before it reaches the primary.
        deadline = time.monotonic() + 30
        while not all(_has_database(cluster.node_dsn(n), dbname) for n in NODES):
            if time.monotonic() > deadline:
                raise SystemExit(f"database {dbname} did not reach every node of the cluster in 30 s")
            time.sleep(0.2)
        yield cluster, dsn, up_s
    finally:
        if cluster.state:  # up() wrote its state: something may run
            cluster.down()
        shutil.rmtree(folder, ignore_errors=True)


def _has_database(dsn: str, dbname: str) -> bool:
    with contextlib.suppress(psycopg2.Error, RegistryUnavailableError), autocommit(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (dbname,))
        return cur.fetchone() is not None
    return False


def spread(rates: list[float]) -> str:
    return f"{statistics.median(rates):,.0f} ({min(rates):,.0f}-{max(rates):,.0f})"


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
    ap.add_argument("--runs", type=int, default=5, help="side-by-side runs of 'batched new' per server")
    ap.add_argument("--no-replicated", action="store_true", help="skip the three-node cluster")
    args = ap.parse_args()
    # A SIGTERM (make interrupted, a CI timeout) unwinds like Ctrl-C, so the cluster and the databases go away too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    with contextlib.ExitStack() as stack:
        embedded = None
        admin = os.environ.get("PHOTON_REGISTRY_DSN")
        if admin:
            admin = with_dbname(admin, "postgres")
        else:
            parent = Path(tempfile.mkdtemp(prefix="photon-bench-"))
            stack.callback(shutil.rmtree, parent, ignore_errors=True)  # the server deletes only its own folder
            embedded = EmbeddedPostgres(parent / "pg", cleanup_mode="delete")
            embedded.start()
            stack.callback(embedded.stop)
            admin = embedded.admin_dsn
        dbname = f"photon_bench_{uuid.uuid4().hex[:8]}"
        dsn = create_database(admin, dbname)
        stack.callback(drop_database, admin, dbname)
        figures = run_all(args, dsn, embedded is not None, stack, dbname)
    print(json.dumps(figures))


def run_all(
    args: argparse.Namespace, dsn: str, embedded: bool, stack: contextlib.ExitStack[bool | None], dbname: str
) -> dict[str, object]:
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
    stack.callback(reg.close)
    a, b = create_owner(dsn, "bench-a"), create_owner(dsn, "bench-b")
    n, bs = args.ids, args.batch
    base = int(time.time() * 1e6) - 4 * 3_600_000_000
    strings_keys = workload(n, 2, base)
    dup_keys = workload(n, 3, base)
    split = lambda k: [k.take(np.arange(i, min(i + bs, len(k)))) for i in range(0, len(k), bs)]  # noqa: E731

    sides = [Side("single", dsn, "bench-side")]
    replicated_up_s = None
    if not args.no_replicated:
        cluster, cluster_dsn, replicated_up_s = stack.enter_context(replicated_server(dbname))
        with autocommit(cluster_dsn) as conn, conn.cursor() as cur:
            cur.execute("SHOW synchronous_standby_names")
            names = cur.fetchone()[0]
            cur.execute("SELECT current_setting('synchronous_commit'), current_setting('fsync')")
            r_sync, r_fsync = cur.fetchone()
        console.print(
            f"replicated: three-node cluster up in {replicated_up_s:.1f} s, synchronous_standby_names={names}, "
            f"synchronous_commit={r_sync}, fsync={r_fsync}"
        )
        init_registry({"main": cluster_dsn}, num_shards=args.shards)
        sides.append(Side("replicated", cluster_dsn, "bench-side", cluster))
    for side in sides:
        stack.callback(side.reg.close)

    # Warm-up: connections, temp tables and the hour partitions exist before anything is timed.
    reg.register(workload(10_000, 9, base), a.token(999_999))
    for side in sides:
        side.reg.register(workload(10_000, 9, base), side.owner.token(999_999))

    single = bench_single_row(dsn, reg, workload(args.single_row_ids, 4, base), b.token(0).value)
    # Batched new, side by side: the same fresh ids on each server, the servers alternating which goes first.
    for r in range(args.runs):
        batches = split(workload(n, 100 + r, base))
        for side in sides if r % 2 == 0 else sides[::-1]:
            rate = side.run(batches, first_seq=r * len(batches), sample_lag=side.name == "replicated")
            console.print(f"run {r + 1}/{args.runs} {side.name}: {rate:,.0f} new ids/s")
    batched_new = statistics.median(sides[0].rates)
    with IdRegistry({"main": dsn}, RegistryOptions(fast_path=False)) as cond:
        cond.register(workload(10_000, 10, base), a.token(999_998))
        conditional_new = bench_register(cond, split(workload(n, 6, base)), lambda s: a.token(30_000 + s))
    string_batches = [pa.array(k.to_ids(), pa.string()) for k in split(strings_keys)]
    batched_strings = bench_register(reg, string_batches, lambda s: a.token(10_000 + s))
    # Half duplicates: every other id of each batch was registered by another owner beforehand (not timed).
    reg.register(dup_keys.take(np.arange(0, n, 2)), b.token(1))
    batched_dup = bench_register(reg, split(dup_keys), lambda s: a.token(20_000 + s), won_share=0.5)
    ceiling = bench_copy_ceiling(dsn, split(workload(n, 5, base)), args.shards, a.token(0).value)

    figures: dict[str, object] = {
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
        "ids_per_run": n,
        "runs": args.runs,
    }
    for side in sides:
        key = "batched_new" if side.name == "single" else "replicated_new"
        figures |= {
            f"{key}_min_ids_per_s": round(min(side.rates)),
            f"{key}_max_ids_per_s": round(max(side.rates)),
            f"{key}_runs_ids_per_s": [round(r) for r in side.rates],
            f"{key}_wal_bytes_per_id": round(statistics.median(side.wal_bytes) / n, 1),
            f"{key}_shard_txn_ms_median": round(statistics.median(side.txn_seconds) * 1000, 1),
            f"{key}_shard_txn_ms_p90": round(float(np.percentile(side.txn_seconds, 90)) * 1000, 1),
        }
    if len(sides) > 1:
        rep = sides[1]
        figures["replicated_new_ids_per_s"] = round(statistics.median(rep.rates))
        figures["replicated_vs_single"] = round(statistics.median(rep.rates) / batched_new, 3)
        figures["replicated_up_s"] = round(replicated_up_s or 0.0, 1)
        if rep.flush_lag_s:
            figures["replicated_flush_lag_ms_median"] = round(statistics.median(rep.flush_lag_s) * 1000, 1)
            figures["replicated_flush_lag_ms_max"] = round(max(rep.flush_lag_s) * 1000, 1)
        if rep.cpu_s:
            # Cores' worth of CPU each role's PostgreSQL used while the batches ran (of 2 here, the client included).
            for role in ("primary", "standbys"):
                figures[f"replicated_{role}_cores"] = round(
                    statistics.median(c[role] / w for c, w in zip(rep.cpu_s, rep.wall_s, strict=True)), 2
                )
        if rep.backend_samples[1]:
            figures["replicated_syncrep_wait_share"] = round(rep.backend_samples[0] / rep.backend_samples[1], 3)

    table = Table(title="IdRegistry write paths (durable)")
    table.add_column("path")
    table.add_column("ids/s", justify="right")
    table.add_column("x single-row", justify="right")
    table.add_column("of ceiling", justify="right")
    for name, rate in [
        ("single-row conditional insert", single),
        (f"register, all new (median of {args.runs})", batched_new),
        ("register, all new, parsing id strings", batched_strings),
        ("register, all new, conditional path only", conditional_new),
        ("register, 50% duplicates", batched_dup),
        ("COPY into unindexed table (ceiling)", ceiling),
    ]:
        table.add_row(name, f"{rate:,.0f}", f"{rate / single:,.1f}", f"{rate / ceiling:.2f}")
    console.print(table)
    side_table = Table(title=f"register, all new: {n:,} ids in batches of {bs:,}, {args.runs} runs each, alternating")
    for col in ("server", "new ids/s: median (min-max)", "WAL bytes/id", "shard txn ms p50 / p90"):
        side_table.add_column(col, justify="left" if col == "server" else "right")
    for side in sides:
        side_table.add_row(
            "single server" if side.name == "single" else "three-node cluster, quorum commit",
            spread(side.rates),
            f"{statistics.median(side.wal_bytes) / n:.1f}",
            f"{statistics.median(side.txn_seconds) * 1000:.0f} / {np.percentile(side.txn_seconds, 90) * 1000:.0f}",
        )
    console.print(side_table)
    if len(sides) > 1:
        console.print(
            f"replicated / single: {figures['replicated_vs_single']}; standby flush lag median "
            f"{figures.get('replicated_flush_lag_ms_median')} ms, max {figures.get('replicated_flush_lag_ms_max')} ms; "
            f"share of active registry backends waiting for the standby (SyncRep): "
            f"{figures.get('replicated_syncrep_wait_share')}; CPU in cores while the batches ran: primary "
            f"{figures.get('replicated_primary_cores')}, both standbys {figures.get('replicated_standbys_cores')}"
        )
    return figures


if __name__ == "__main__":
    main()
