"""``photon``: the one command-line entry point for what a person does by hand. The DAGs call the same functions."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

from photon.settings import Settings, load_settings
from photon.tools.status import ago, lag_lines, when

app = typer.Typer(help="Photon: exactly-once joins of clicks to queries across data centers.", no_args_is_help=True)
registry_app = typer.Typer(help="The IdRegistry: init, status, gc, reshard.", no_args_is_help=True)
app.add_typer(registry_app, name="registry")
cluster_app = typer.Typer(
    help="A local three-node registry cluster (Patroni + etcd) for tests, benchmarks and a demo.", no_args_is_help=True
)
registry_app.add_typer(cluster_app, name="cluster")
table_app = typer.Typer(help="The output tables: maintenance.", no_args_is_help=True)
app.add_typer(table_app, name="table")
storage_app = typer.Typer(
    help="The local S3 server (SeaweedFS, 127.0.0.1 only) for trying object storage: up, down, status.",
    no_args_is_help=True,
)
app.add_typer(storage_app, name="storage")
spark_app = typer.Typer(
    help="A local Spark standalone cluster (a master and workers on 127.0.0.1) to join on: up, down, status.",
    no_args_is_help=True,
)
app.add_typer(spark_app, name="spark")
# Soft wrap: a message longer than the terminal is still one line (the terminal folds it on screen). Without it, rich
# breaks lines at the width, 80 columns when output is not a terminal: each batch line of a join task came out as two
# Airflow log records, and so did the demo's.
console = Console(soft_wrap=True)


def servers_from_settings(settings: Settings | None = None) -> dict[str, str]:
    # Imported when a command runs: the registry module loads Arrow, which `--help` does not need.
    from photon.registry.client import servers_from_settings as servers

    return servers(settings)


def initialised_servers(settings: Settings | None = None) -> dict[str, str]:
    """The registry servers, once the main one is known to be initialised: a command that reads the registry says
    so in one line (exit status 2) instead of a traceback from its first query."""
    from photon.registry.client import require_initialised

    servers = servers_from_settings(settings)
    require_initialised(servers["main"])
    return servers


@app.callback()
def _setup(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False) -> None:
    handler: logging.Handler
    if sys.stderr.isatty():
        handler = RichHandler(console=Console(stderr=True), show_path=False)
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:  # a pipe or a file (an Airflow task log): one plain line per record, never wrapped
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, handlers=[handler])


class _StderrHandler(logging.StreamHandler):
    """A StreamHandler on whatever ``sys.stderr`` is when a record comes, as rich's stderr console is: a test runner
    that swaps it for a buffer and closes that buffer leaves no handler writing to a closed file."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


@registry_app.command("init")
def registry_init(
    shards: Annotated[int, typer.Option(help="Shards of the first configuration.")] = 4,
    place: Annotated[str, typer.Option(help="Comma-separated servers to place shards on, round-robin.")] = "main",
    partition_minutes: Annotated[int, typer.Option(help="Width of the time partitions GC drops.")] = 60,
) -> None:
    """Apply migrations on every registry server and create the first shard configuration (idempotent)."""
    from photon.registry.admin import init_registry

    servers = servers_from_settings()
    report = init_registry(
        servers,
        num_shards=shards,
        placement=[p.strip() for p in place.split(",") if p.strip()],
        partition_width_us=partition_minutes * 60_000_000,
    )
    for name, files in report.migrations.items():
        console.print(f"server [bold]{name}[/]: " + (f"applied {', '.join(files)}" if files else "schema up to date"))
    if report.created_config:
        c = report.created_config
        console.print(f"created shard configuration v{c.version}: {c.num_shards} shards on {place}")
    else:
        latest = report.existing_config[-1]
        console.print(f"shard configuration present (latest v{latest.version}, {latest.num_shards} shards): unchanged")


@registry_app.command("status")
def registry_status(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    estimate: Annotated[
        bool, typer.Option("--estimate", help="Row counts from statistics instead of count(*).")
    ] = False,
) -> None:
    """Servers, shard configurations, per-shard GC thresholds, partitions, row counts and sizes."""
    from photon.registry.admin import status

    st = status(servers_from_settings(), exact=not estimate)
    if as_json:
        typer.echo(json.dumps(st, indent=2))
        return
    for name, s in st["servers"].items():
        # The count and the latest migration (--json lists them all): the whole list made a 306-character line.
        m = s.get("migrations") or []
        applied = f"{len(m)} migrations, the latest {m[-1]}" if m else "no migrations"
        state = f"reachable, {applied}" if s["reachable"] else f"UNREACHABLE {s['error']}"
        console.print(f"server [bold]{name}[/]: {state}")
        console.print(f"  {s['dsn']}", highlight=False)
    o = st["owners"]
    console.print(
        f"partition width: {st['partition_width_us'] // 60_000_000} min; owners: {o['total']:,} "
        f"({o['current']:,} current, {o['retired']:,} retired by a fence)"
    )
    for cfg in st["configs"]:
        valid = "always" if cfg["valid_from_us"] == 0 else when(cfg["valid_from_us"])
        table = Table(
            title=f"config v{cfg['version']} ({cfg['state']}), valid from {valid}, {cfg['num_shards']} shards"
        )
        for col in ("shard", "server", "table", "GC threshold (UTC)", "partitions", "rows", "bytes"):
            table.add_column(col, justify="right" if col not in ("server", "table") else "left")
        for sh in cfg["shards"]:
            if "error" in sh:
                table.add_row(str(sh["shard"]), sh["server"], sh["table"], f"[red]{sh['error']}[/]", "", "", "")
                continue
            table.add_row(
                str(sh["shard"]),
                sh["server"],
                sh["table"],
                when(sh["gc_threshold_us"]) if sh["gc_threshold_us"] > 0 else "none yet",
                str(sh["partitions"]),
                f"{sh['rows']:,}",
                f"{sh['bytes']:,}",
            )
        console.print(table)


def _cluster_dir() -> Path:
    return load_settings().home / "cluster"


ClusterDir = Annotated[
    Path | None, typer.Option("--dir", help="The cluster's folder (default: <PHOTON_HOME>/cluster).")
]


@cluster_app.command("up")
def cluster_up(
    folder: ClusterDir = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for a primary and two streaming standbys.")] = 120,
) -> None:
    """Start one etcd and three Patroni nodes (PostgreSQL on 127.0.0.1, quorum commit) and wait until a primary
    acknowledges commits on a standby; print the multi-host DSN (also written to DIR/dsn)."""
    from photon.registry.cluster import LocalCluster

    typer.echo(LocalCluster(folder or _cluster_dir()).up(timeout=timeout))


@cluster_app.command("status")
def cluster_status(folder: ClusterDir = None) -> None:
    """Each node's role, state, lag and sync state (Patroni's REST API and the primary's pg_stat_replication)."""
    from photon.registry.cluster import LocalCluster

    table = Table()
    for col in ("node", "port", "role", "state", "lag (bytes)", "sync state"):
        table.add_column(col)
    for n in LocalCluster(folder or _cluster_dir()).status():
        table.add_row(n.name, str(n.port), n.role, n.state, "" if n.lag is None else str(n.lag), n.sync_state or "")
    console.print(table)


@cluster_app.command("down")
def cluster_down(folder: ClusterDir = None) -> None:
    """Stop every process `up` started (SIGTERM, then SIGKILL after a timeout); the data stays in DIR."""
    from photon.registry.cluster import LocalCluster

    LocalCluster(folder or _cluster_dir()).down()
    console.print("cluster stopped")


@registry_app.command("gc")
def registry_gc(
    retention: Annotated[
        float, typer.Option(help="Seconds the registry remembers an id (longer than any replay of old logs).")
    ] = 3 * 86_400.0,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Report what would be freed; change nothing.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Advance every shard's GC threshold to now - retention - max clock skew (never back), drop the partitions
    wholly below it and delete the rows left below it; report rows and bytes freed per shard."""
    from photon.registry.gc import collect_garbage

    settings = load_settings()
    report = collect_garbage(
        initialised_servers(settings),
        retention_s=retention,
        max_clock_skew_s=settings.max_clock_skew_s,
        dry_run=dry_run,
    )
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
        return
    # Times a person reads, as `registry status` shows them (microseconds since the epoch are in --json).
    table = Table(title=("dry run: would free" if dry_run else "freed") + f" below {when(report.target_us)}")
    for col in ("shard", "server", "threshold before (UTC)", "threshold after (UTC)", "partitions", "rows", "bytes"):
        table.add_column(col, justify="left" if col in ("shard", "server") else "right")
    for sh in report.shards:
        table.add_row(
            sh.shard,
            sh.server,
            when(sh.threshold_before_us) if sh.threshold_before_us > 0 else "none yet",
            when(sh.threshold_after_us),
            str(len(sh.partitions)),
            f"{sh.rows_freed + sh.straggler_rows:,}",
            f"{sh.bytes_freed:,}",
        )
    console.print(table)
    console.print(f"total: {report.rows_freed:,} rows, {report.bytes_freed:,} bytes")


@registry_app.command("reshard")
def registry_reshard(
    shards: Annotated[int, typer.Option(help="Shard count of the new configuration.")],
    place: Annotated[str, typer.Option(help="Comma-separated servers to place shards on, round-robin.")] = "main",
    lead: Annotated[float, typer.Option(help="Seconds from now until the new configuration takes effect.")] = 120.0,
    grace: Annotated[float, typer.Option(help="A pipeline that committed within this many seconds is live.")] = 60.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Plan a new shard configuration effective at now + lead, wait for every live joiner to acknowledge it, then
    activate it (or abort and leave the current one in force). Exit status 1 if aborted."""
    from photon.registry.reshard import reshard

    settings = load_settings()
    report = reshard(
        initialised_servers(settings),
        num_shards=shards,
        placement=[p.strip() for p in place.split(",") if p.strip()],
        lead_s=lead,
        max_clock_skew_s=settings.max_clock_skew_s,
        grace_s=grace,
    )
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        console.print(
            f"shard configuration v{report.version} ({report.num_shards} shards, valid from "
            f"{when(report.valid_from_us)}): {report.state} after {report.waited_s:.1f}s; acknowledged by "
            f"{', '.join(sorted(report.acknowledged)) or 'no live joiner'}"
            + (f"; {report.reason}" if report.reason else "")
        )
    raise typer.Exit(0 if report.state == "active" else 1)


@registry_app.command("reshard-resume")
def registry_reshard_resume(
    version: Annotated[int, typer.Argument(help="The shard configuration a reshard left part-way.")],
    abort: Annotated[bool, typer.Option("--abort", help="Abort the plan instead (never an active one).")] = False,
    grace: Annotated[float, typer.Option(help="A pipeline that committed within this many seconds is live.")] = 60.0,
) -> None:
    """Finish a reshard that stopped part-way (a crash, a lost connection): a planned configuration is activated if
    every live joiner acknowledged it and its deadline allows, else aborted; an active one is enforced on every
    server; an aborted one is removed everywhere. Exit status 1 if it ends aborted."""
    from photon.registry.reshard import abort as abort_plan
    from photon.registry.reshard import resume

    servers = initialised_servers()
    if abort:
        abort_plan(servers, version)
        state = "aborted"
    else:
        state = resume(servers, version, grace_s=grace)
    console.print(f"shard configuration v{version}: {state}")
    raise typer.Exit(0 if state == "active" else 1)


@table_app.command("maintain")
def table_maintain(
    out: Annotated[str, typer.Option(help="Output of the pipelines: a folder, or s3://bucket/prefix.")],
    pipeline: Annotated[list[str] | None, typer.Option(help="Only this pipeline (repeatable); default: all.")] = None,
    retention_hours: Annotated[
        int,
        typer.Option(help="Vacuum data files no commit names, and files a compaction replaced, this much older."),
    ] = 168,
    force: Annotated[
        bool, typer.Option("--force", help="Accept a retention under the minimum (24 h): only with no writer.")
    ] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Report what would be done; change nothing.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    lock_lease_s: Annotated[
        float,
        typer.Option(
            min=10.0,
            help="On an object store, the lock's lease: a killed run's lock is taken over this long (plus 5 s) after"
            " it was taken, and a run starts no compaction past half of it.",
        ),
    ] = 600.0,
) -> None:
    """Per pipeline and table: compact each hour's small files, checkpoint, drop expired log files, vacuum old files
    no commit names. Safe beside live pipelines and backfills (also the hourly DAG photon_table_maintenance)."""
    from photon.tools.maintenance import format_bytes, maintain

    report = maintain(
        _store_or_folder(out, "--out", must_exist=True),
        pipeline,
        retention_hours=retention_hours,
        dry_run=dry_run,
        force=force,
        lock_lease_s=lock_lease_s,
    )
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
        return
    table = Table(title=("dry run: would do" if dry_run else "done") + f", retention {retention_hours} h")
    for col in ("pipeline", "table", "commits", "files", "hours", "vacuumed", "spared", "s"):
        table.add_column(col, justify="left" if col in ("pipeline", "table") else "right")
    for t in report.tables:
        table.add_row(
            t.pipeline,
            t.kind,
            f"{t.after.version + 1:,}",
            f"{t.before.files:,} -> {t.after.files:,}",
            f"{len(t.hours_compacted)}" + (f" ({len(t.hours_left)} left)" if t.hours_left else ""),
            f"{len(t.vacuumed):,} ({format_bytes(t.vacuumed_bytes)})",
            f"{t.spared:,}",
            f"{t.seconds:.1f}",
        )
    console.print(table)
    n = report.totals()
    console.print(
        f"{n['tables']} tables: {n['files_before']:,} -> {n['files_after']:,} data files, {n['files_compacted']:,} "
        f"compacted, {n['vacuumed']:,} vacuumed ({format_bytes(n['vacuumed_bytes'])}) in {report.seconds:.1f} s"
    )


def _when_us(us: int) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(us / 1_000_000, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_time(text: str) -> int:
    """Epoch microseconds from an ISO-8601 time (UTC if no zone) or epoch seconds."""
    from datetime import UTC, datetime

    try:
        return int(float(text) * 1_000_000)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"{text!r} is neither an ISO-8601 time (2026-11-21T10:00:00+00:00) nor epoch seconds"
        ) from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return int(dt.timestamp() * 1_000_000)


@app.command("generate")
def generate_cmd(
    logs: Annotated[
        str,
        typer.Option(
            help="Folder to write <dc>/{queries,clicks}/ and _manifest/ into, or s3://bucket/prefix (each file one "
            "object; credentials and endpoint from the AWS_* variables; the manifest then in --manifest)."
        ),
    ],
    mode: Annotated[str, typer.Option(help="historical (a time range, as fast as possible) or live (real time).")] = (
        "historical"
    ),
    rate: Annotated[float, typer.Option(help="Events (queries + clicks) per second of log time.")] = 2_000.0,
    duration: Annotated[float, typer.Option(help="Seconds of log time (live: from now; historical: see --start).")] = (
        60.0
    ),
    start: Annotated[
        str | None, typer.Option(help="Historical start (ISO-8601 UTC or epoch s); default now-duration.")
    ] = (None),
    seed: Annotated[int, typer.Option(help="Same seed, same settings and range: byte-identical logs.")] = 1,
    dcs: Annotated[str, typer.Option(help="Comma-separated data centers, each with its own replica.")] = "dc-a,dc-b",
    outage: Annotated[list[str] | None, typer.Option(help="DC:START_S:DURATION_S, a replica outage (repeatable).")] = (
        None
    ),
    rotate: Annotated[float | None, typer.Option(help="Seconds per file (default: 1 live, 10 historical).")] = None,
    max_join_delay: Annotated[float, typer.Option(help="The joiner's maximum join delay, for the manifest.")] = 120.0,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Any other setting as KEY=VALUE (repeatable).")] = (
        None
    ),
    manifest: Annotated[
        Path | None, typer.Option(help="Folder for the manifest (default: <logs>/_manifest; needed for s3:// logs).")
    ] = None,
) -> None:
    """Write realistic query and click logs for each data center, with a ground-truth manifest."""
    import time

    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from photon.tools.generator import GeneratorSettings, Outage, generate

    if mode not in ("historical", "live"):
        raise ValueError("--mode is historical or live")
    live = mode == "live"
    rot = rotate if rotate is not None else (1.0 if live else 10.0)
    settings = GeneratorSettings(
        dcs=tuple(d.strip() for d in dcs.split(",") if d.strip()),
        seed=seed,
        events_per_s=rate,
        outages=tuple(Outage.parse(o) for o in outage or []),
        rotate_s=rot,
        chunk_s=max(rot, 10.0 if not live else rot * max(1, round(5 / rot))),
        max_join_delay_s=max_join_delay,
    ).with_overrides(set_ or [])
    now = int(time.time() * 1_000_000)
    begin = now if live else (_parse_time(start) if start else now - int(duration * 1_000_000))
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not console.is_terminal,
    ) as bar:
        task = bar.add_task(f"{mode} logs", total=duration)
        report = generate(
            settings,
            logs,
            start_us=begin,
            end_us=begin + int(duration * 1_000_000),
            live=live,
            on_progress=lambda done, total: bar.update(task, completed=done / 1e6),
            manifest=manifest,
        )
    console.print(
        f"{report.mode}: {report.queries:,} queries, {report.clicks:,} clicks, {report.lines:,} lines per data center "
        f"({report.duplicate_lines:,} duplicated, {report.malformed_lines:,} malformed) in {report.files:,} files, "
        f"{report.bytes / 1e6:,.1f} MB per data center; {report.seconds:.1f}s, {report.events_per_s:,.0f} events/s"
    )
    console.print(f"expected outcomes: {report.expect}; manifest in {manifest or Path(logs) / '_manifest'}")


@app.command("audit")
def audit_cmd(
    out: Annotated[
        str,
        typer.Option(
            help="Output holding one folder per pipeline: a folder, or s3://bucket/prefix (the AWS_* variables)."
        ),
    ],
    logs: Annotated[
        str | None,
        typer.Option(help="Input logs, a folder or s3://bucket/prefix; a folder's _manifest/ is used when present."),
    ] = None,
    manifest: Annotated[
        Path | None, typer.Option(help="Manifest folder (default: <logs>/_manifest; with s3:// logs, give it).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    dcs: Annotated[
        str | None,
        typer.Option(
            help="The data centers that ran, all of them (comma-separated): a lost click only another could still "
            "join is then pending there, not lost. Default: those with output under --out, and such clicks lost."
        ),
    ] = None,
) -> None:
    """Check every pipeline's output: duplicates, lost and unexpected clicks, quarantine, shares, latency.
    Exit status 1 on any duplicate, loss, unexpected row or quarantine mismatch."""
    from photon.logs.schemas import MANIFEST_DIR
    from photon.storage import open_store
    from photon.tools.audit import audit, print_audit

    target = _store_or_folder(out, "--out", must_exist=True)
    source = None if logs is None else _store_or_folder(logs, "--logs", must_exist=True)
    if manifest is None and isinstance(source, Path) and (source / MANIFEST_DIR / "clicks.parquet").exists():
        manifest = source / MANIFEST_DIR
    spark = None
    if manifest is None:
        if logs is None:
            raise ValueError("give --logs (with or without a _manifest) or --manifest")
        from photon.spark_session import get_spark

        spark = get_spark("photon-audit")
    ran = None if dcs is None else [d.strip() for d in dcs.split(",") if d.strip()]
    report = audit(open_store(target), manifest=manifest, logs=source, spark=spark, ran=ran)
    if as_json:
        typer.echo(report.to_json())
    else:
        print_audit(report, console)
    raise typer.Exit(0 if report.ok else 1)


@app.command(
    "join",
    help="Run the micro-batch joiner for one data center (the registry from PHOTON_REGISTRY_DSN).\n\n"
    "Ctrl-C (SIGINT) or SIGTERM: the batch in progress commits, no other starts, the lease is released (a standby "
    "takes over at once) and it says so; exit status 130 (SIGINT) or 143 (SIGTERM). A second signal abandons the "
    "batch in progress (the next lease joins its files again). A lease fenced by another one says so and exits 3.",
)
def join_cmd(
    dc: Annotated[str, typer.Option(help="The pipeline's data center: reads <logs>/<dc>, writes <out>/<dc>.")],
    logs: Annotated[
        str,
        typer.Option(
            help="Input logs: a folder, or s3://bucket/prefix (credentials and endpoint from the AWS_* variables)."
        ),
    ],
    out: Annotated[
        str,
        typer.Option(
            help="Output: a folder, or s3://bucket/prefix (credentials and endpoint from the AWS_* variables)."
        ),
    ],
    run_for: Annotated[float | None, typer.Option(help="Run micro-batches for this many seconds (a lease).")] = None,
    until_caught_up: Annotated[
        bool, typer.Option("--until-caught-up", help="Stop when no new file and no due retry is left.")
    ] = False,
    drain: Annotated[
        bool, typer.Option("--drain", help="With --until-caught-up: also wait for every retry to resolve.")
    ] = False,
    trigger_interval: Annotated[float, typer.Option(help="Seconds between micro-batch triggers.")] = 1.0,
    max_join_delay: Annotated[float, typer.Option(help="Give up on a click's query after this many seconds.")] = 120.0,
    adapter: Annotated[str, typer.Option(help="module:function merging query fields into clicks.")] = (
        "photon.joiner.adapter:default_adapter"
    ),
    master: Annotated[str | None, typer.Option(help="Spark master (default: spark-submit's, else local[*]).")] = None,
    pipeline: Annotated[
        str | None, typer.Option(help="Pipeline name: its state and output folder (default: the data center).")
    ] = None,
    window_start: Annotated[
        str | None, typer.Option(help="Backfill: only files whose first event is at or after this ISO time (UTC).")
    ] = None,
    window_end: Annotated[str | None, typer.Option(help="Backfill: ... and before this ISO time (UTC).")] = None,
    allow_empty: Annotated[
        bool,
        typer.Option(
            "--allow-empty/--no-allow-empty",
            help="Backfill: run a window without click files in the replica, or past the registry's horizon (refused "
            "otherwise).",
        ),
    ] = False,
    start: Annotated[
        str,
        typer.Option(
            help="Where a NEW live pipeline starts reading: 'beginning' (every file in the logs), 'now' (the registry "
            "server's clock) or an ISO time (UTC). Click files before it are history, for backfills. Recorded when "
            "the pipeline is created; an existing pipeline keeps its own."
        ),
    ] = "beginning",
    standby: Annotated[
        bool,
        typer.Option(
            "--standby",
            help="Warm up while the pipeline's current lease runs, and take over the moment it ends (it releases "
            "the pipeline after its last batch, or its heartbeat goes stale): consecutive leases without a gap.",
        ),
    ] = False,
    standby_timeout: Annotated[
        float | None,
        typer.Option(help="--standby: fence a lease that started longer ago than this (default: --run-for + 600 s)."),
    ] = None,
    hand_over_wait: Annotated[
        float,
        typer.Option(
            help="--run-for: when the term ends while a standby is still starting, go on joining up to this many "
            "seconds until it is ready, so that it takes over without a gap (0: end on time). Keep it well under "
            "600 s (the standby's patience)."
        ),
    ] = 120.0,
    connect: Annotated[
        bool,
        typer.Option(
            "--connect",
            help="Run on the warm Spark Connect server `photon spark-connect` keeps (no Spark start of its own); or "
            "set PHOTON_SPARK_REMOTE to a server's sc:// URL.",
        ),
    ] = False,
) -> None:
    """Run the micro-batch joiner for one data center (its help, with how it stops, is the decorator's)."""
    from photon.joiner.common import BEGINNING, NOW, JoinSettings
    from photon.joiner.lease import Joiner
    from photon.joiner.state import FencedError, PipelineState
    from photon.registry.client import read_layout
    from photon.registry.clock import ClockSkewError, ServerClock
    from photon.spark_session import get_spark

    source = _store_or_folder(logs, "--logs", must_exist=True)
    target = _store_or_folder(out, "--out", must_exist=False)
    if run_for is None and not until_caught_up:
        raise ValueError("give --run-for SECONDS (a lease) or --until-caught-up")
    import os

    remote = None
    if connect:
        from photon.tools.spark_connect import TOKEN_ENV, connection

        if master:
            raise ValueError("--connect runs on the server's master: leave out --master")
        # No server (or one with other code): one line, before anything starts. The token travels in the
        # environment, not in the URL, which Spark's errors print.
        remote, os.environ[TOKEN_ENV] = connection(load_settings().home)

    if start != BEGINNING and (window_start or window_end):
        raise ValueError("--start is a live pipeline's; a backfill's --window-start/--window-end is its range")
    config = load_settings()
    settings = JoinSettings(
        start=BEGINNING if start == BEGINNING else NOW if start == NOW else _parse_time(start),
        max_clock_skew_s=config.max_clock_skew_s,
        max_future_s=config.max_future_s,
        max_join_delay_s=max_join_delay,
        trigger_interval_s=trigger_interval,
        adapter=adapter,
        max_click_files=int(os.environ.get("PHOTON_TEST_MAX_CLICK_FILES", JoinSettings.max_click_files)),
        window_start_us=_parse_time(window_start) if window_start else None,
        window_end_us=_parse_time(window_end) if window_end else None,
    )
    if (settings.window_start_us is None) != (settings.window_end_us is None):
        raise ValueError("give both --window-start and --window-end, or neither")
    servers = servers_from_settings()
    read_layout(servers["main"])  # an uninitialised or unreachable registry: one clear line, before Spark starts
    # A host whose clock is off from the registry server's by more than the skew: one clear line, before Spark starts.
    clock = ServerClock(servers["main"], settings.max_clock_skew_s)
    clock.check()
    if settings.window_start_us is not None and settings.window_end_us is not None:
        from photon.tools.completeness import check_backfill_window  # a window with nothing to join: one line

        window = (settings.window_start_us, settings.window_end_us)
        accepted = check_backfill_window(
            servers, source, dc, *window, allow_empty=allow_empty, max_clock_skew_s=settings.max_clock_skew_s
        )
        if accepted:
            console.print(f"{dc}: {accepted}")
    # A standby announces itself from now on (starting, then ready once warm), so the lease before it holds on
    # until it is ready rather than leave the pipeline idle while its Spark session starts.
    announcing = PipelineState(servers["main"], pipeline or dc).standing_by() if standby else contextlib.nullcontext()
    stopper: _Stopper | None = None
    try:
        try:
            with announcing as announcement:
                spark = get_spark(f"photon-join-{pipeline or dc}", master=master, shuffle_partitions=4, remote=remote)
                joiner = Joiner(dc, source, target, servers, spark, settings, pipeline=pipeline, clock=clock)
                # From here (PySpark's session sets a SIGINT handler of its own): a signal stops the lease, not Python.
                stopper = _Stopper(joiner)
                if announcement is not None:
                    joiner.warm_up()
                    announcement.ready()
                    timeout = standby_timeout if standby_timeout is not None else (run_for or 3_000.0) + 600.0
                    why = joiner.take_over(stale_s=3 * settings.heartbeat_s, timeout_s=timeout)
                    console.print(f"{dc}: took over ({why})")
            lease = joiner.lease or joiner.start()
            origin = "the beginning of the logs" if lease.start_us is None else _when_us(lease.start_us)
            if settings.window_start_us is not None:
                origin = "its window"
            console.print(
                f"{dc}: lease epoch {lease.epoch}, resuming after batch {lease.last_batch} (reading from {origin})"
            )
            stopper.running = True  # from here a first signal ends the loop after its batch, a second abandons it
        except KeyboardInterrupt:  # a signal before the lease's first batch
            if stopper is None:
                raise
            stopper.restore()
            released = " lease released" if stopper.joiner.lease is not None else " no lease taken"
            stopper.joiner.release()
            console.print(f"{dc}: stopped by {stopper.name} before its first batch:{released}")
            raise typer.Exit(stopper.status) from None

        def report(r: Any) -> None:
            m = r.metrics
            shipped = f" ({m['shipped']} with their query shipped)" if m.get("shipped") else ""
            console.print(
                f"{dc} batch {r.batch_seq}: {m['clicks']} clicks, {m['joined']} joined{shipped}, {m['prefiltered']} "
                f"pre-filtered, {m['wasted']} wasted, {m['retried']} waiting, {m['unjoinable']} unjoinable, "
                f"{m['quarantined']} quarantined, {m['duration_s']:.1f}s"
            )

        assert stopper is not None
        try:
            results = joiner.run(
                run_for_s=run_for,
                until_caught_up=until_caught_up,
                drain=drain,
                on_batch=report,
                hand_over_wait_s=hand_over_wait,
            )
        except ClockSkewError:  # drifted mid-lease: its batches are committed; a standby may take over at once
            joiner.release()
            raise
        except FencedError as exc:  # another lease holds the pipeline: nothing to release, nothing more to commit
            stopper.restore()
            n = joiner.batches.last_batch - lease.last_batch
            Console(stderr=True, soft_wrap=True).print(
                f"{exc}; this lease committed {n} batch(es) and stopped", markup=False
            )
            raise typer.Exit(FENCED_EXIT) from None
        except KeyboardInterrupt:  # a second signal: the batch in progress is abandoned, uncommitted
            stopper.restore()
            joiner.release()
            console.print(
                f"{dc}: stopped by {stopper.name} in batch {joiner.batches.last_batch + 1}, before its end (what it "
                "had not committed, the next lease joins again): lease released"
            )
            raise typer.Exit(stopper.status) from None
        except Exception as exc:
            if joiner.stopped_by is None:
                # The batch failed: Spark stops first, so that the error is the last line said, not a line its
                # executors' other tasks still log after it (a store gone mid-batch fails every task that reads it)
                with contextlib.suppress(Exception):
                    spark.stop()
                raise
            # Stopped, and the batch failed meanwhile: a signal sent to the whole process group (systemd, `kill --
            # -PGID`) stops the Spark JVM too. A crash's case, uncommitted: released all the same, and said so.
            stopper.restore()
            joiner.release()
            console.print(
                f"{dc}: stopped by {stopper.name} in batch {joiner.batches.last_batch + 1}, before its end (it failed: "
                f"{type(exc).__name__}, its Spark stopped too; what it had not committed, the next lease joins "
                "again): lease released"
            )
            raise typer.Exit(stopper.status) from None
        stopper.restore()
        joiner.release()  # a standby takes over now
        if joiner.stopped_by is not None:
            console.print(
                f"{dc}: stopped by {joiner.stopped_by} after batch {joiner.batches.last_batch}: lease released"
            )
            raise typer.Exit(stopper.status)
        held = f" (held on {joiner.held_s:.1f}s for a standby to be ready)" if joiner.held_s >= 0.5 else ""
        console.print(f"{dc}: {len(results)} batch(es) committed{held}")
    finally:  # the handlers from before, whatever ends the command (a test may run it in-process)
        if stopper is not None:
            stopper.restore()


FENCED_EXIT = 3  # `photon join`: another lease fenced this one (README, "photon join")


class _Stopper:
    """SIGINT and SIGTERM on `photon join`, once its Spark session is up: before the lease's loop runs, a signal
    stops the command at once (``KeyboardInterrupt``; a lease already taken is released); while it runs, the first
    ends the loop after the batch in progress, a second abandons that batch (``KeyboardInterrupt``)."""

    def __init__(self, joiner: Any) -> None:
        import signal
        import threading

        self.joiner = joiner
        self.running = False
        self.name = ""
        self.status = 1
        self._previous: dict[int, Any] = {}
        # Python takes signals in its main thread only (a test may run the command in another: no handlers then).
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self) for s in (signal.SIGINT, signal.SIGTERM)}

    def __call__(self, signum: int, _frame: Any) -> None:
        import signal
        import threading

        first = not self.name
        if first:
            self.name, self.status = signal.Signals(signum).name, 128 + signum  # the shell's convention
        if first and self.running:
            # From a thread: the handler runs in the main thread, which may hold the stop event's own lock.
            threading.Thread(target=self.joiner.stop, args=(self.name,), daemon=True).start()
            return
        raise KeyboardInterrupt(self.name)

    def restore(self) -> None:
        import signal

        for s, handler in self._previous.items():
            signal.signal(s, handler)


StorageFolder = Annotated[
    Path | None, typer.Option("--folder", help="The server's folder (data, key, log); default PHOTON_HOME/storage.")
]


def _storage_folder(folder: Path | None) -> Path:
    return folder if folder is not None else load_settings().home / "storage"


def _shown(path: Path) -> str:
    """A path as a shell takes it (quoted) and rich prints it (its brackets not read as markup)."""
    import shlex

    from rich.markup import escape

    return escape(shlex.quote(str(path)))


@storage_app.command("up")
def storage_up(
    bucket: Annotated[
        list[str] | None, typer.Option(help="A bucket to create (repeatable; kept if it exists).")
    ] = None,
    folder: StorageFolder = None,
    host: Annotated[
        str, typer.Option(help="The address clients reach it at (a container's: its service name).")
    ] = "127.0.0.1",
    bind: Annotated[str, typer.Option(help="The address it listens on (a container's: 0.0.0.0).")] = "127.0.0.1",
    s3_port: Annotated[int | None, typer.Option(help="The S3 port (default: a free one, kept across starts).")] = None,
    foreground: Annotated[
        bool, typer.Option("--foreground", help="Stay until the server ends; SIGTERM or Ctrl-C stops it (a container).")
    ] = False,
) -> None:
    """Start the local S3 server (or find it running) and create the buckets; its clients' AWS variables go to
    env.sh in its folder (mode 600): `source` it, the key is never printed. The key and secret it serves are made on
    the first start, or are PHOTON_STORAGE_ACCESS_KEY and PHOTON_STORAGE_SECRET_KEY where both are set (a deployment
    whose other services are given the same)."""
    from photon.tools.storage_server import env_file, start

    settings = load_settings()
    given = (settings.storage_access_key, settings.storage_secret_key)
    key, secret = (v.get_secret_value() if v else "" for v in given)
    if bool(key) != bool(secret):
        raise ValueError("set both PHOTON_STORAGE_ACCESS_KEY and PHOTON_STORAGE_SECRET_KEY, or neither")
    where = _storage_folder(folder)
    credentials = (key, secret) if key and secret else None
    asked = _stop_asked() if foreground else None  # from before the start: a SIGTERM during it stops the server too
    server = start(where, tuple(bucket or ()), host=host, bind=bind, s3_port=s3_port, credentials=credentials)
    console.print(
        f"local S3 server at {server.endpoint} (pid {server.pid}); "
        f"for its clients: source {_shown(env_file(server.folder))}"
    )
    if asked is not None:
        _serve_until_stopped(where, server.pid, asked)


def _stop_asked() -> threading.Event:
    """Set by SIGTERM (``docker stop``) or SIGINT."""
    import signal

    asked = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: asked.set())
    return asked


def _serve_until_stopped(where: Path, pid: int, asked: threading.Event) -> None:
    """Wait while the server runs; once ``asked``, stop it and return; its end on its own exits 1."""
    from photon.tools.storage_server import alive, stop

    while not asked.wait(1.0):
        if not alive(pid):
            raise typer.Exit(1)  # stopped from elsewhere, or crashed: its log is in its folder
    stop(where)
    console.print(f"local S3 server of {_shown(where)} stopped")


@storage_app.command("down")
def storage_down(
    folder: StorageFolder = None,
    hard: Annotated[bool, typer.Option("--hard", help="SIGKILL at once, as a crash would.")] = False,
) -> None:
    """Stop the local S3 server; its data stays in its folder for the next `photon storage up`."""
    from photon.tools.storage_server import stop

    where = _storage_folder(folder)
    _say_stopped("local S3 server", where, stop(where, hard=hard))


@storage_app.command("status")
def storage_status(
    folder: StorageFolder = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Whether the local S3 server runs, where and since which pid (exit 1 if it does not)."""
    from photon.tools.storage_server import running

    where = _storage_folder(folder)
    server = running(where)
    info: dict[str, Any] = {"running": server is not None, "folder": str(where)}
    if server is not None:
        info |= {"pid": server.pid, "endpoint": server.endpoint, "env_file": str(where / "env.sh")}
    _say_status(
        info,
        as_json,
        f"no local S3 server runs for {_shown(where)} (photon storage up starts one)",
        lambda: console.print(
            f"local S3 server at {info['endpoint']} (pid {info['pid']}); "
            f"for its clients: source {_shown(where / 'env.sh')}"
        ),
    )


def _say_stopped(what: str, where: Path, stopped: bool) -> None:
    console.print(f"{what} of {_shown(where)} stopped" if stopped else f"no {what} runs for {_shown(where)}")


def _say_status(info: dict[str, Any], as_json: bool, not_running: str, say: Callable[[], None]) -> None:
    """A local server's status: JSON, or its lines (``say``) if it runs, else ``not_running`` and exit status 1."""
    if as_json:
        typer.echo(json.dumps(info, indent=2))
    elif info["running"]:
        say()
    else:
        console.print(not_running)
    if not info["running"]:
        raise typer.Exit(1)


SparkFolder = Annotated[
    Path | None,
    typer.Option("--folder", help="The cluster's folder (workers' folders, logs); default PHOTON_HOME/spark."),
]


def _spark_folder(folder: Path | None) -> Path:
    return folder if folder is not None else load_settings().home / "spark"


def _say_cluster(cluster: Any) -> None:
    from photon.tools.spark_cluster import airflow_connection

    workers = len(cluster.processes) - 1
    console.print(
        f"Spark cluster at {cluster.master_url}: a master and {workers} worker(s), UI http://127.0.0.1:{cluster.ui_port}"
    )
    console.print(f"  join on it: photon join --master {cluster.master_url} ...")
    console.print(f"  under Airflow: export AIRFLOW_CONN_SPARK_DEFAULT='{airflow_connection(cluster)}'")


@spark_app.command("up")
def spark_up(
    workers: Annotated[int, typer.Option(help="Workers, each in a folder of its own.")] = 2,
    cores: Annotated[int, typer.Option(help="Cores each worker offers.")] = 1,
    memory: Annotated[str, typer.Option(help="Memory each worker offers (Spark's notation: 1g, 512m).")] = "1g",
    folder: SparkFolder = None,
) -> None:
    """Start a Spark standalone cluster on this machine (or find it running): a master and workers from the pyspark
    wheel, on 127.0.0.1, each a process of its own; they run until `photon spark down`. Workers that died under a
    live master are started again as they were (running joins carry on). Executors read an object store with the
    AWS_* variables of the environment this runs in."""
    from photon.tools.spark_cluster import start

    _say_cluster(start(_spark_folder(folder), workers=workers, cores=cores, memory=memory))


@spark_app.command("down")
def spark_down(
    folder: SparkFolder = None,
    hard: Annotated[bool, typer.Option("--hard", help="SIGKILL at once, as a crash would.")] = False,
) -> None:
    """Stop the local Spark cluster: its workers, then its master (the applications on it fail)."""
    from photon.tools.spark_cluster import stop

    where = _spark_folder(folder)
    _say_stopped("Spark cluster", where, stop(where, hard=hard))


@spark_app.command("status")
def spark_status(
    folder: SparkFolder = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Whether the local Spark cluster runs (every process of it alive), its master, workers and applications (exit 1
    if it does not run)."""
    from photon.tools.spark_cluster import running

    where = _spark_folder(folder)
    cluster = running(where)
    info: dict[str, Any] = {"running": cluster is not None, "folder": str(where)}
    if cluster is not None:
        try:
            state = cluster.state()
        except OSError as exc:
            raise ValueError(f"the Spark master at {cluster.master_url} does not answer: {exc}") from None
        info |= {
            "master_url": cluster.master_url,
            "ui": f"http://127.0.0.1:{cluster.ui_port}",
            "alive_workers": state.get("aliveworkers", 0),
            "cores": state.get("cores", 0),
            "active_apps": [a["name"] for a in state.get("activeapps", [])],
            "completed_apps": len(state.get("completedapps", [])),
        }

    def say() -> None:
        _say_cluster(cluster)
        console.print(
            f"  {info['alive_workers']} worker(s) alive, {info['cores']} core(s); running: "
            f"{', '.join(info['active_apps']) or 'nothing'}; {info['completed_apps']} application(s) finished"
        )

    _say_status(info, as_json, f"no Spark cluster runs for {_shown(where)} (photon spark up starts one)", say)


@app.command("spark-connect")
def spark_connect_cmd(
    port: Annotated[int, typer.Option(help="Port on 127.0.0.1.")] = 15002,
    master: Annotated[str, typer.Option(help="Spark master of the server.")] = "local[*]",
) -> None:
    """Keep a Spark Connect server running on 127.0.0.1, warm, for `photon join --connect` (a backfill task's join
    without a Spark start of its own); token-protected, stopped by Ctrl-C or SIGTERM."""
    from photon.tools.spark_connect import serve

    raise typer.Exit(serve(load_settings().home, port=port, master=master, say=console.print))


@app.command("verify")
def verify_cmd(
    logs: Annotated[
        str, typer.Option(help="Input logs, a folder or s3://bucket/prefix (lost clicks are re-dispatched there).")
    ],
    out: Annotated[str, typer.Option(help="Output of the pipelines: a folder, or s3://bucket/prefix.")],
    grace: Annotated[float, typer.Option(help="Seconds without a commit before a pipeline counts as gone.")] = 600.0,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Report only; change nothing.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Find registered clicks missing from their pipeline's output whose batch is over, recover them (delete their
    registry rows if the token still matches, re-dispatch their lines), and clear the tokens of committed output."""
    from photon.recovery.verify import verify_and_recover
    from photon.storage import open_store

    source = open_store(_store_or_folder(logs, "--logs", must_exist=True))
    target = open_store(_store_or_folder(out, "--out", must_exist=True))
    report = verify_and_recover(initialised_servers(), target, source, grace_s=grace, dry_run=dry_run)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
        return
    console.print(
        f"{'dry run: ' if dry_run else ''}checked {report.checked:,} registry rows with tokens: "
        f"{report.committed:,} committed (tokens {'to clear' if dry_run else 'cleared'}), {report.in_flight:,} in "
        f"flight, {report.lost:,} lost, {report.recovered:,} recovered, {report.not_in_logs:,} not found in the logs"
    )
    for path in report.redispatched_files:
        console.print(f"re-dispatched: {path}")
    if report.fenced:
        console.print(f"fenced (gone) pipelines: {', '.join(report.fenced)}")


@app.command("status")
def status_cmd(
    pipeline: Annotated[list[str] | None, typer.Option(help="Only this pipeline (repeatable); default: all.")] = None,
    logs: Annotated[
        str | None,
        typer.Option(help="Input logs, for the lag: a folder or s3://bucket/prefix (default: $PHOTON_HOME/logs)."),
    ] = None,
    out: Annotated[
        str | None,
        typer.Option(
            help="Output, for the retry sets and tables: a folder or s3://bucket/prefix (default: $PHOTON_HOME/out)."
        ),
    ] = None,
    window: Annotated[float, typer.Option(help="Seconds of recent batches for latency and shares.")] = 300.0,
    wide: Annotated[
        bool,
        typer.Option(
            "--wide", help="One table row per pipeline (for 150 columns or more); tab-separated when not a terminal."
        ),
    ] = False,
    show_all: Annotated[
        bool, typer.Option("--all", help="Finished backfills too (default: live pipelines and running backfills).")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Per pipeline: its state (running, idle, finished, stalled), last batch and when, lease holder and heartbeat,
    lag (oldest unconsumed closed file), retries waiting, over the recent window click latency, joins and the
    wasted share, and its output tables (Delta version, last published batch, files, size, last commit). One block
    per pipeline, readable at 80 columns; --wide for a table. Finished backfills only with
    --all (or named with --pipeline)."""
    from photon.tools.status import pipeline_status

    home = load_settings().home
    source = (
        _store_or_folder(logs, "--logs", must_exist=True)
        if logs is not None
        else (home / "logs" if (home / "logs").is_dir() else None)
    )
    target = (
        _store_or_folder(out, "--out", must_exist=True)
        if out is not None
        else (home / "out" if (home / "out").is_dir() else None)
    )
    records = pipeline_status(
        initialised_servers()["main"], logs=source, out=target, pipelines=pipeline or (), window_s=window
    )
    # A finished backfill is history (an hour joined, often with nothing in it); a day of hourly backfills buried
    # the live pipelines. Named ones are shown whatever their state.
    hidden = 0
    if not show_all and not pipeline:
        shown = [r for r in records if not (r["kind"] == "backfill" and r["state"] == "finished")]
        hidden, records = len(records) - len(shown), shown
    if as_json:
        typer.echo(json.dumps(records, indent=2))
        return
    note = f"({hidden:,} finished backfill{'' if hidden == 1 else 's'} not shown: --all shows them)" if hidden else ""
    if not records:
        console.print("no pipeline has started yet" if not hidden else f"no live pipeline {note}")
        return
    if wide and not console.is_terminal:  # a pipe or a file: one tab-separated line per pipeline, no box drawing
        typer.echo("\n".join("\t".join(row) for row in _status_rows(records)))
    elif wide:
        console.print(_status_table(records, window))
    else:
        console.print(f"pipelines (recent = last {window:.0f} s)")
        for r in records:
            console.print()
            console.print(_status_block(r))
    if note and wide and not console.is_terminal:
        typer.echo(note, err=True)  # the rows on stdout stay one per pipeline
    elif note:
        console.print(("" if wide else "\n") + note)


STATE_STYLE = {"running": "green", "idle": "yellow", "finished": "cyan", "stalled": "bold red"}


def _lag_text(r: dict[str, Any]) -> str:
    if r["kind"] == "backfill":
        return "- (a backfill joins one window of the logs)"
    first, *more = lag_lines(r)
    return first + "".join(f"\n[{'red' if 'history' in line else 'dim'}]{line}[/]" for line in more)


def _lease_text(r: dict[str, Any]) -> str:
    if r["lease_holder"] is None:
        return f"released (epoch {r['epoch']})"
    beat = ago(r["heartbeat_age_s"])
    if r["state"] == "stalled":
        return f"{r['lease_holder']} (epoch {r['epoch']}), [red]last heartbeat {beat}[/]"
    return f"{r['lease_holder']} (epoch {r['epoch']}), heartbeat {beat}"


def _seconds(s: float) -> str:
    return f"{s:,.2f} s" if abs(s) < 100 else f"{s:,.0f} s"


def _recent_text(r: dict[str, Any]) -> str:
    rec = r["recent"]
    text = f"{rec['batches']:,} batch{'' if rec['batches'] == 1 else 'es'}, {rec['joined']:,} joined"
    if rec["latency_p50_s"] is not None:
        text += f"; latency p50 {_seconds(rec['latency_p50_s'])}, p99 {_seconds(rec['latency_p99_s'])}"
    if rec["wasted_share"] is not None:
        text += f"; wasted {rec['wasted_share']:.1%} of clicks"
    if rec["handover_gaps_s"]:
        text += f"; hand-over gaps {', '.join(f'{g:.1f}' for g in rec['handover_gaps_s'])} s"
    return text


def _last_batch_text(r: dict[str, Any], form: str) -> str:
    """``form`` with the last batch's number and age, or "none yet" before a pipeline's first batch."""
    return form.format(n=f"{r['last_batch']:,}", age=ago(r["last_batch_age_s"])) if r["last_batch"] else "none yet"


def _status_block(r: dict[str, Any]) -> Any:
    """One pipeline as a heading (its name whole, whatever the width) and label/value lines that wrap."""
    from rich.console import Group
    from rich.text import Text

    state = r["state"]
    heading = Text.assemble(
        (r["pipeline"], "bold"),
        f"  {r['kind']}, {r['dc']}, ",
        (state, STATE_STYLE.get(state, "")),
    )
    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="dim", justify="right", no_wrap=True)
    grid.add_column(overflow="fold")
    grid.add_row("last batch", _last_batch_text(r, "{n}, {age}"))
    grid.add_row("lease", _lease_text(r))
    if r["kind"] == "live":
        grid.add_row("lag", _lag_text(r))
    retries = r["retries"]
    grid.add_row("retries", "?" if retries is None else f"{retries['waiting']:,} waiting, {retries['due']:,} due")
    grid.add_row("recent", _recent_text(r))
    if r.get("tables") is not None:
        grid.add_row("tables", _tables_text(r["tables"]))
    return _Unpadded(Group(heading, grid))


def _tables_text(found: dict[str, Any] | None) -> str:
    """One line per output table: version, last published batch, files and size, files awaiting maintenance; then
    when each was last committed (a line of its own: the rest stays within 80 columns)."""
    if found is None:
        return "? (no output folder)"
    if not found:
        return "none yet"
    lines = []
    for kind, t in found.items():
        stale = t["files_on_disk"] - t["files"]
        lines.append(
            f"{kind} v{t['version']}, batch {t['published_batch'] if t['published_batch'] is not None else '-'}, "
            f"{t['files']:,} files, {t['bytes'] / 1e6:,.1f} MB" + (f" ({stale:,} more on disk)" if stale > 0 else "")
        )
    ages = ", ".join(f"{kind} {ago(t.get('last_commit_age_s'))}" for kind, t in found.items())
    return "\n".join([*lines, f"[dim]last commit: {ages}[/]"])


class _Unpadded:
    """A renderable without the spaces rich pads a grid's lines with to its widest one (copied text and logs keep
    them otherwise)."""

    def __init__(self, renderable: Any) -> None:
        self.renderable = renderable

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.segment import Segment

        for line in console.render_lines(self.renderable, options, pad=False):
            while line and not line[-1].text.strip() and not line[-1].control:
                line.pop()
            if line:
                last = line[-1]
                line[-1] = Segment(last.text.rstrip(), last.style, last.control)
            yield from line
            yield Segment.line()


def _status_table(records: list[dict[str, Any]], window: float) -> Table:
    from rich.text import Text

    table = Table(title=f"pipelines (recent = last {window:.0f} s)")
    table.add_column("pipeline", no_wrap=True)  # whole, whatever the width: the other columns give way
    for col in ("state", "last batch", "lease, heartbeat", "lag", "retries", "recent", "tables"):
        table.add_column(col)
    for r in records:
        retries = r["retries"]
        table.add_row(
            f"{r['pipeline']}\n[dim]{r['kind']}, {r['dc']}[/]",
            Text(r["state"], style=STATE_STYLE.get(r["state"], "")),
            _last_batch_text(r, "{n}\n[dim]{age}[/]"),
            _lease_text(r),
            _lag_text(r),
            "?" if retries is None else f"{retries['waiting']:,} waiting\n[dim]{retries['due']:,} due[/]",
            _recent_text(r),
            _tables_text(r.get("tables")),
        )
    return table


def _status_rows(records: list[dict[str, Any]]) -> list[list[str]]:
    """``status --wide`` for a pipe: a header and one row per pipeline, plain text, a cell's lines joined by "; "."""
    from rich.text import Text

    def plain(markup: str) -> str:
        return "; ".join(Text.from_markup(markup).plain.splitlines()).replace("\t", " ")

    head = ["pipeline", "kind", "dc", "state", "last batch", "lease, heartbeat", "lag", "retries", "recent", "tables"]
    rows = [head]
    for r in records:
        retries = r["retries"]
        rows.append(
            [
                r["pipeline"],
                r["kind"],
                str(r["dc"]),
                r["state"],
                plain(_last_batch_text(r, "{n}, {age}")),
                plain(_lease_text(r)),
                plain(_lag_text(r)),
                "?" if retries is None else f"{retries['waiting']:,} waiting, {retries['due']:,} due",
                plain(_recent_text(r)),
                plain(_tables_text(r.get("tables"))),
            ]
        )
    return rows


@app.command("final")
def final_cmd(
    hour: Annotated[str | None, typer.Option(help="The UTC hour, e.g. 2026-11-24T13.")] = None,
    start: Annotated[str | None, typer.Option(help="Or an interval's start (ISO time, UTC if no zone)...")] = None,
    end: Annotated[str | None, typer.Option(help="...and its end (exclusive).")] = None,
    logs: Annotated[
        str | None, typer.Option(help="Input logs: a folder or s3://bucket/prefix (default: $PHOTON_HOME/logs).")
    ] = None,
    out: Annotated[
        str | None, typer.Option(help="Output: a folder or s3://bucket/prefix (default: $PHOTON_HOME/out).")
    ] = None,
    max_join_delay: Annotated[float, typer.Option(help="The joiners' maximum join delay, seconds.")] = 120.0,
    lost_after: Annotated[
        float, typer.Option(help="Seconds without a heartbeat from any of its pipelines before a data center is lost.")
    ] = 600.0,
    recheck: Annotated[bool, typer.Option("--recheck", help="Decide again even where a marker says final.")] = False,
    mark: Annotated[bool, typer.Option("--mark", help="Write the marker if final (as photon_finality does).")] = False,
    min_click_files: Annotated[
        int, typer.Option(min=0, help="Fewer click files in the interval (all replicas) than this: not final.")
    ] = 1,
    allow_empty: Annotated[
        bool,
        typer.Option(
            "--allow-empty", help="Declare an interval without input final all the same (the marker says so)."
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Is the hour (or interval) final: every click of its input decided, its output no longer changing? Says why
    not. Exit status 0 if final, 1 if not. A marker <out>/_final/<YYYYmmddHH>.json, once written, is the answer."""
    from photon.tools.completeness import (
        FinalitySettings,
        decide_final,
        hour_interval,
        read_marker,
        summary,
        write_marker,
    )

    if (hour is None) == (start is None and end is None) or (start is None) != (end is None):
        raise ValueError("give --hour, or --start and --end")
    start_us, end_us = hour_interval(hour) if hour is not None else (_parse_time(start or ""), _parse_time(end or ""))
    settings = load_settings()
    source = _store_or_folder(logs, "--logs", must_exist=True) if logs is not None else settings.home / "logs"
    target = _store_or_folder(out, "--out", must_exist=True) if out is not None else settings.home / "out"
    marker = None if recheck else read_marker(target, start_us, end_us)
    if marker is None:
        decision = decide_final(
            initialised_servers(settings),
            source,
            target,
            start_us,
            end_us,
            FinalitySettings(max_join_delay, settings.max_clock_skew_s, lost_after, min_click_files, allow_empty),
        )
        marker = decision.to_dict()
        if decision.final and mark:
            path, marker = write_marker(target, decision)
            marker["marker"] = str(path)
    if as_json:
        typer.echo(json.dumps(marker, indent=2, sort_keys=True))
    else:
        typer.echo(summary(marker))
        for reason in marker["reasons"][1:]:
            typer.echo(f"  and: {reason}")
    raise typer.Exit(0 if marker["final"] else 1)


def _store_or_folder(where: str, option: str, *, must_exist: bool) -> Path | str:
    """``--logs`` or ``--out``: a folder (that exists, if ``must_exist``), or an s3:// URL whose store answers (a
    missing bucket, wrong credentials: one line, before Spark starts)."""
    if not where.startswith("s3://"):
        return _folder(Path(where), option) if must_exist else Path(where)
    from photon.storage import open_store

    open_store(where).files()
    return where


def _folder(path: Path, option: str) -> Path:
    """A folder the user named must exist: one clear line instead of a listing of nothing."""
    if not path.is_dir():
        raise ValueError(f"{option} {path}: no such folder")
    return path


@app.command("report")
def report_cmd(
    pipeline: Annotated[
        list[str] | None, typer.Option(help="Only this pipeline (repeatable); default: every one but backfills.")
    ] = None,
    since: Annotated[
        str, typer.Option(help="Batches since: a duration back from now (90m, 6h, 2d), an ISO time, or 'all'.")
    ] = "1h",
    to: Annotated[Path | None, typer.Option(help="Folder for the PNG charts (default: $PHOTON_HOME/report).")] = None,
) -> None:
    """PNG charts from the metrics tables: click latency, pipelines' shares, registry batching, shard sizes. A chart
    with no data in the range is not drawn."""
    from photon.registry.admin import server_clock_us
    from photon.tools.report import live_pipelines, render_report

    main_dsn = initialised_servers()["main"]
    since_us = None if since == "all" else _parse_since(since, server_clock_us(main_dsn))
    chosen = pipeline or live_pipelines(main_dsn)
    result = render_report(main_dsn, to or load_settings().home / "report", pipelines=chosen, since_us=since_us)
    console.print(f"pipelines: {', '.join(result.pipelines) or 'none with batches in the range'}")
    for name, facts in result.per_pipeline.items():
        gaps = facts["handover_gaps_s"]
        console.print(
            f"  {name}: {facts['batches']:,} batches, {facts['joined']:,} joined, wasted {facts['wasted_share']:.1%} of"
            f" {facts['clicks']:,} clicks; {len(gaps)} hand-over(s)"
            + (f", gaps max {max(gaps):.1f} s, median {sorted(gaps)[len(gaps) // 2]:.1f} s" if gaps else "")
        )
    for path in result.written:
        note = result.notes.get(path.name)
        console.print(f"wrote {path}" + (f" ({note})" if note else ""))
    for name, why in result.skipped.items():
        console.print(f"[dim]not drawn: {name}: {why}[/]")


def _parse_since(text: str, now_us: int) -> int:
    """Epoch microseconds from a duration back from ``now_us`` (30s, 90m, 6h, 2d) or an absolute time."""
    units = {"s": 1, "m": 60, "h": 3_600, "d": 86_400}
    if text[-1:] in units:
        try:
            return now_us - int(float(text[:-1]) * units[text[-1]] * 1_000_000)
        except ValueError:
            pass
    return _parse_time(text)


@app.command("demo")
def demo(
    seconds: Annotated[float, typer.Option(help="Seconds of live logs.")] = 90.0,
    rate: Annotated[float, typer.Option(help="Events per second.")] = 1_000.0,
    max_join_delay: Annotated[float, typer.Option(help="The joiners' maximum join delay.")] = 30.0,
    registry_race: Annotated[
        bool, typer.Option("--registry-race", help="Only race two writers over the registry.")
    ] = False,
    logs: Annotated[
        str | None,
        typer.Option(
            help="Write the live logs into s3://bucket/prefix (a prefix of the run's own; credentials and endpoint "
            "from the AWS_* variables) instead of the run's folder."
        ),
    ] = None,
    out: Annotated[
        str | None,
        typer.Option(
            help="Write the output tables and the pipelines' state into s3://bucket/prefix (a prefix of the run's "
            "own) instead of the run's folder."
        ),
    ] = None,
) -> None:
    """Both data centers joining generated live logs at once into Delta tables (under .photon/demo/<time>/out, or
    PHOTON_HOME's; with a registry database of the run's own), ending with an audit and a check of every table
    against the batches the registry committed (exit 1 if either fails)."""
    from photon.tools.demo import run_pipeline_demo, run_registry_race

    settings = load_settings()
    where = "PHOTON_REGISTRY_DSN" if settings.registry_dsn else f"embedded PostgreSQL in {settings.home}/postgres"
    console.print(f"registry: {where}")
    if registry_race:
        ok = run_registry_race(num_ids=200_000, batch=20_000, console=console)
    else:
        for option, url in (("--logs", logs), ("--out", out)):
            if url is not None:  # a bucket that does not answer: one line, at once
                if not url.startswith("s3://"):
                    raise ValueError(f"{option} {url}: the demo writes into its run's folder, or into s3://...")
                _store_or_folder(url, option, must_exist=True)
        ok = run_pipeline_demo(
            seconds=seconds, rate=rate, max_join_delay_s=max_join_delay, console=console, logs_url=logs, out_url=out
        )
    raise typer.Exit(0 if ok else 1)


# Every argument goes to airflow as it is, --help included (`photon --help` describes this command).
@app.command(
    "airflow-cli",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
)
def airflow_cli_cmd(
    args: Annotated[list[str] | None, typer.Argument(help="The airflow command's arguments.")] = None,
) -> None:
    """Any `airflow` command, against the Airflow that `photon airflow` runs (its AIRFLOW_HOME, the venv's airflow)."""
    from photon.airflow.standalone import airflow_cli

    try:
        status = airflow_cli(args or [])
    except RuntimeError as exc:
        raise ValueError(str(exc)) from exc  # one line and exit status 2 (main)
    raise typer.Exit(status)


@app.command("airflow")
def airflow_cmd(
    port: Annotated[int, typer.Option(help="The UI and API's port.")] = 8080,
    host: Annotated[str, typer.Option(help="The interface the UI and API bind to (0.0.0.0: every one).")] = (
        "127.0.0.1"
    ),
    parallelism: Annotated[
        int | None, typer.Option(help="LocalExecutor slots (default: one per joiner DAG + max(6, 2 per core)).")
    ] = None,
    metadata_db: Annotated[str, typer.Option(help="Airflow's metadata database, on the registry's server.")] = (
        "airflow"
    ),
    access_log: Annotated[
        bool,
        typer.Option(
            "--access-log",
            envvar="PHOTON_AIRFLOW_ACCESS_LOG",
            help="Show the API server's HTTP access log (a line per request: UI polls, task heartbeats).",
        ),
    ] = False,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose",
            envvar="PHOTON_AIRFLOW_VERBOSE",
            help="Airflow's own log levels: the access log, DAG-parse bookkeeping, statistics every 30 s.",
        ),
    ] = False,
    spark_connect: Annotated[
        bool,
        typer.Option(
            "--spark-connect/--no-spark-connect",
            envvar="PHOTON_AIRFLOW_SPARK_CONNECT",
            help="Keep a Spark Connect server warm for the backfill tasks (photon spark-connect): each joins without "
            "a Spark start of its own.",
        ),
    ] = True,
) -> None:
    """Airflow with the project's DAGs on this machine: metadata on PostgreSQL (the embedded server, or the one
    PHOTON_REGISTRY_DSN names), the LocalExecutor, the UI on 127.0.0.1. SIGINT or SIGTERM stops every process.
    The console is quiet (no access log, no DAG-parse bookkeeping); the ready line comes once the start-up is out."""
    from photon.airflow.standalone import serve

    raise typer.Exit(
        serve(
            host=host,
            port=port,
            parallelism=parallelism,
            metadata_db=metadata_db,
            access_log=access_log,
            verbose=verbose,
            spark_connect=spark_connect,
        )
    )


def main() -> None:
    try:
        app(prog_name="photon")
    except Exception as exc:
        # The error classes are imported only now: their modules load Arrow, which `--help` does not need.
        from photon.durable import CorruptStateError
        from photon.logs.ids import InvalidEventIdError
        from photon.pg import RegistryUnavailableError, UnsafeReplicationError
        from photon.registry.client import RegistryError
        from photon.registry.clock import ClockSkewError
        from photon.registry.cluster import ClusterError
        from photon.registry.migrations import MigrationError
        from photon.storage import StorageError
        from photon.tools.spark_cluster import SparkClusterError
        from photon.tools.spark_connect import NoServerError
        from photon.tools.storage_server import StorageServerError

        if not isinstance(
            exc,
            RegistryError
            | RegistryUnavailableError
            | UnsafeReplicationError
            | MigrationError
            | InvalidEventIdError
            | CorruptStateError
            | ClockSkewError
            | ClusterError
            | NoServerError
            | StorageError
            | StorageServerError
            | SparkClusterError
            | ValueError,
        ):
            raise
        # Known failures get one clear line, not a traceback (-v logging still shows details): one line whatever
        # the message holds (a driver's error spans several), never wrapped by rich.
        from rich.markup import escape

        Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(' '.join(str(exc).split()))}")
        sys.exit(2)
