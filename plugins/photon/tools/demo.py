"""The demo behind ``make demo``: both data centers' writers racing over the same ids in the registry."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from photon.logs.ids import EventKeys
from photon.pg import autocommit, create_database, drop_database, redact, with_dbname
from photon.registry.admin import init_registry
from photon.registry.client import IdRegistry, Outcome, RegistryError, servers_from_settings
from photon.registry.owners import create_owner, end_owner
from photon.storage import Store
from photon.tools.status import when


def _demo_keys(num_ids: int, seed: int, now: int) -> EventKeys:
    rng = np.random.default_rng(seed)
    ts = now - rng.integers(0, 600_000_000, num_ids)  # the last ten minutes
    ip = (10 << 24) | rng.integers(0, 1 << 16, num_ids)
    pid = rng.integers(1, 1 << 22, num_ids)
    src = ((ip.astype(np.uint64) << np.uint64(32)) | pid.astype(np.uint64)).view(np.int64)
    return EventKeys(ts.astype(np.int64), src)


def _writer(
    servers: dict[str, str],
    pipeline: str,
    seed: int,
    now: int,
    num_ids: int,
    batch: int,
    order_seed: int,
    start: Any,
    out: Any,
) -> None:
    keys = _demo_keys(num_ids, seed, now)
    order = np.random.default_rng(order_seed).permutation(num_ids)  # each writer meets the ids in its own order
    with IdRegistry(servers) as reg:
        owner = create_owner(reg.main_dsn, pipeline, {"demo": True})
        won = np.zeros(num_ids, dtype=bool)
        counts = {o.name.lower(): 0 for o in Outcome}
        retries = 0
        start.wait()
        t0 = time.perf_counter()
        for seq, lo in enumerate(range(0, num_ids, batch)):
            pos = order[lo : lo + batch]
            res = reg.register(keys.take(pos), owner.token(seq))
            won[pos] = res.ours
            for k, v in res.counts().items():
                counts[k] += v
            retries += res.retries
        seconds = time.perf_counter() - t0
        end_owner(reg.main_dsn, owner.owner_id)
    out.put((pipeline, owner.owner_id, np.flatnonzero(won), counts, retries, seconds))


def _scratch_database(main: str) -> tuple[str, str]:
    """A database of the race's own on the registry's main server: ``(its name, its DSN)``. Its synthetic ids and
    owners never reach the registry's own database (``photon verify`` would count them in flight), production's
    included. The named database is only the door in: nothing is written there. A login that may not create
    databases is refused in one line."""
    with autocommit(main, guard=False) as conn, conn.cursor() as cur:
        cur.execute("SELECT current_user, rolcreatedb OR rolsuper FROM pg_roles WHERE rolname = current_user")
        user, may = cur.fetchone()
    if not may:
        raise RegistryError(
            f"photon demo --registry-race races in a database of its own, created and dropped on the registry's "
            f"server ({redact(main)}), and login {user} may not create databases (CREATEDB): run it as a login that "
            "may, or without PHOTON_REGISTRY_DSN (the embedded PostgreSQL); it never writes into the named database"
        )
    name = f"photon_race_{time.strftime('%Y%m%d_%H%M%S')}_{os.getpid()}"
    return name, create_database(main, name)


def run_registry_race(*, num_ids: int, batch: int, console: Console) -> bool:
    """Two writers racing over the same ids, in a registry database of the race's own, dropped at the end."""
    main = servers_from_settings()["main"]
    name, dsn = _scratch_database(main)
    console.print(f"registry race in a database of its own, {name} (dropped at the end)")
    try:
        return _race({"main": dsn}, num_ids=num_ids, batch=batch, console=console)
    finally:
        drop_database(main, name)


def _race(servers: dict[str, str], *, num_ids: int, batch: int, console: Console) -> bool:
    init_registry(servers)
    seed = random.SystemRandom().randrange(1 << 30)
    now = int(time.time() * 1e6)
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_writer, args=(servers, dc, seed, now, num_ids, batch, i + 1, start, out))
        for i, dc in enumerate(("dc-a", "dc-b"))
    ]
    for p in procs:
        p.start()
    start.set()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    table = Table(title=f"two writers racing over the same {num_ids:,} ids ({batch:,} per batch)")
    for col in ("dc", "won", "lost", "again", "too old", "retries", "s", "ids/s"):
        table.add_column(col, justify="right")
    owners = {}
    for pipeline, owner_id, won_pos, counts, retries, seconds in sorted(results):
        owners[pipeline] = (owner_id, set(won_pos.tolist()))
        table.add_row(
            pipeline,
            f"{counts['won']:,}",
            f"{counts['lost']:,}",
            f"{counts['won_again']:,}",
            f"{counts['too_old']:,}",
            str(retries),
            f"{seconds:.2f}",
            f"{num_ids / seconds:,.0f}",
        )
    console.print(table)
    a, b = owners["dc-a"][1], owners["dc-b"][1]
    both, neither = len(a & b), num_ids - len(a | b)
    # The writers' answers against the registry itself: every id is held by the token of the writer that won it.
    keys = _demo_keys(num_ids, seed, now)
    with IdRegistry(servers) as reg:
        found = reg.lookup(keys)
    holder = found.tokens >> 32
    owner_a, owner_b = owners["dc-a"][0], owners["dc-b"][0]
    agree = np.zeros(num_ids, dtype=bool)
    idx_a, idx_b = np.array(sorted(a), dtype=np.int64), np.array(sorted(b), dtype=np.int64)
    agree[idx_a] = holder[idx_a] == owner_a
    agree[idx_b] = holder[idx_b] == owner_b
    ok = both == 0 and neither == 0 and bool(agree.all())
    console.print(
        f"ids won by both: {both}; by neither: {neither}; answers agreeing with the registry: "
        f"{int(agree.sum()):,}/{num_ids:,}  ->  {'OK' if ok else 'FAILED'}"
    )
    return ok


def run_pipeline_demo(
    *,
    seconds: float,
    rate: float,
    max_join_delay_s: float,
    console: Console,
    logs_url: str | None = None,
    out_url: str | None = None,
) -> bool:
    """Both data centers end to end: live logs with late queries, duplicates, malformed lines and an outage of
    dc-b's replica; both joiners at once, a reshard from 4 to 8 shards while they run; then the independent audit
    (it reads the output tables), each pipeline's tables against its committed batches (``check_tables``), a
    registry GC, and the report's charts. ``logs_url``: the live logs go to a prefix of the run's own under this
    s3:// URL (removed after a passing run), the manifest to the run's folder; ``out_url``: the output and the
    pipelines' state likewise (kept)."""
    import shutil
    import threading

    from photon.joiner.common import JoinSettings
    from photon.joiner.lease import Joiner
    from photon.logs.schemas import MANIFEST_DIR
    from photon.registry.admin import record_shard_sizes
    from photon.registry.gc import collect_garbage
    from photon.registry.reshard import reshard
    from photon.settings import load_settings
    from photon.spark_session import get_spark
    from photon.storage import open_store
    from photon.tools.audit import audit, print_audit
    from photon.tools.generator import GeneratorSettings, Outage, generate
    from photon.tools.report import render_report

    home = load_settings().home
    run = home / "demo" / time.strftime("%Y%m%d-%H%M%S")
    manifest = run / ("manifest" if logs_url else f"logs/{MANIFEST_DIR}")
    logs: Path | str = f"{logs_url.rstrip('/')}/{run.name}" if logs_url else run / "logs"
    out = open_store(f"{out_url.rstrip('/')}/{run.name}" if out_url else run / "out")
    # A registry database of its own: a pipeline's registry state and its output folder belong together.
    main = servers_from_settings()["main"]
    servers = {"main": create_database(with_dbname(main, "postgres"), f"photon_demo_{run.name.replace('-', '_')}")}
    init_registry(servers)
    settings = GeneratorSettings(
        events_per_s=rate,
        max_join_delay_s=max_join_delay_s,
        late_query_lag_max_s=max_join_delay_s * 1.5,
        outages=(Outage("dc-b", seconds / 3, 20.0),),
        malformed_fraction=0.002,
    )
    console.print(
        f"demo in {run}: {seconds:.0f}s of live logs at {rate:,.0f} events/s for dc-a and dc-b "
        f"(dc-b's replica stops for 20s), max join delay {max_join_delay_s:.0f}s"
        + (f"; logs in {logs}" if logs_url else "")
        + (f"; output in {out.url}" if out_url else "")
    )
    spark = get_spark("photon-demo", master="local[2]", shuffle_partitions=4)
    start = int(time.time() * 1e6)
    done = threading.Event()
    errors: list[BaseException] = []

    def gen() -> None:
        try:
            generate(settings, logs, start_us=start, end_us=start + int(seconds * 1e6), live=True, manifest=manifest)
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    def join(dc: str) -> None:
        try:
            joiner = Joiner(
                dc,
                logs,
                out.url,
                servers,
                spark,
                JoinSettings(max_join_delay_s=max_join_delay_s, trigger_interval_s=1.0),
            )
            while not done.is_set():
                joiner.run(
                    run_for_s=5,
                    on_batch=lambda r: console.print(
                        f"  {dc} batch {r.batch_seq}: {r.metrics['clicks']} clicks, {r.metrics['joined']} joined, "
                        f"{r.metrics['prefiltered']} already joined elsewhere, {r.metrics['retried']} waiting, "
                        f"{r.metrics['duration_s']:.1f}s"
                    ),
                )
            joiner.run(until_caught_up=True, drain=True)
        except BaseException as exc:
            errors.append(exc)

    def sample() -> None:  # shard sizes over time, for the report
        while not done.is_set():
            record_shard_sizes(servers, "sample")
            time.sleep(5)

    def grow() -> None:  # a reshard from 4 to 8 shards while both joiners run, effective 30 s after it starts
        try:
            time.sleep(seconds / 5)
            r = reshard(servers, num_shards=8, lead_s=30, max_clock_skew_s=settings.max_clock_skew_s)
            console.print(
                f"  reshard to v{r.version} ({r.num_shards} shards): {r.state} after {r.waited_s:.1f}s, acknowledged "
                f"by {', '.join(sorted(r.acknowledged))}; in force from {when(r.valid_from_us)}"
                + (f"; {r.reason}" if r.reason else "")
            )
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=gen), threading.Thread(target=sample), threading.Thread(target=grow)]
    threads += [threading.Thread(target=join, args=(dc,)) for dc in ("dc-a", "dc-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    report = audit(out, manifest=manifest)
    print_audit(report, console)
    tables_ok = check_tables(servers["main"], out, console)
    # Once everything is decided: a GC run that keeps one minute (the shard-size chart shows what it frees).
    record_shard_sizes(servers, "sample")
    freed = collect_garbage(servers, retention_s=60, max_clock_skew_s=10)
    console.print(f"registry GC keeping 60 s: {freed.rows_freed:,} rows freed")
    charts = render_report(servers["main"], run / "report")
    console.print(f"charts: {', '.join(str(c) for c in charts.written)}")
    if report.ok and tables_ok:
        # the logs are only needed to look into a failure
        if isinstance(logs, Path):
            shutil.rmtree(logs, ignore_errors=True)
        else:
            store = open_store(logs)
            for e in list(store.listing()):
                store.delete(e.key)
            console.print(f"logs removed from {logs}")
        console.print(f"output kept in {out.url}")
    else:
        console.print(f"logs and output kept: `photon audit --out {out.url} --manifest {manifest}` audits them again")
    return report.ok and tables_ok


def check_tables(main_dsn: str, out: Path | Store, console: Console) -> bool:
    """Each pipeline's output tables against the batches the registry committed for it, once every lease has
    drained: per table, the rows its snapshot names (the Delta log's file statistics, no data read) are the sum of
    the committed batches' counts of that kind, and its last published batch (its txn version) is the last batch
    that had rows of that kind. A committed batch missing from a table, or one published twice, shows here."""
    from photon.logs import tables
    from photon.logs.schemas import OUTPUT_KINDS
    from photon.tools.maintenance import table_facts

    metric = {"joined": "joined", "unjoinable": "unjoinable", "quarantine": "quarantined"}
    ok = True
    with autocommit(main_dsn, guard=False) as conn, conn.cursor() as cur:
        for pipeline in tables.pipelines(out):
            parts = []
            for kind in OUTPUT_KINDS:
                col = metric[kind]
                cur.execute(
                    f"SELECT coalesce(sum({col}), 0), max(batch_seq) FILTER (WHERE {col} > 0)"
                    " FROM photon.batch_metrics WHERE pipeline = %s",
                    (pipeline,),
                )
                rows, last = (None if v is None else int(v) for v in cur.fetchone())
                found = list(tables.tables(out, kind, [pipeline]))
                facts = table_facts(found[0]) if found else None
                have = (0, None) if facts is None else (facts.rows, facts.published_batch)
                text = f"{kind} {have[0]:,} rows" + ("" if facts is None else f" in {facts.files:,} files")
                text += f", batch {have[1] if have[1] is not None else '-'}"
                if have != (rows, last):
                    ok = False
                    text += f" [red](the registry's batches: {rows:,} rows, last batch {last})[/]"
                parts.append(text)
            console.print(f"  {pipeline} tables: " + "; ".join(parts))
    console.print(
        f"output tables against the registry's committed batches  ->  {'OK' if ok else '[bold red]FAILED[/]'}"
    )
    return ok
