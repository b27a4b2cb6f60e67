"""``photon``: the one command-line entry point for what a person does by hand. The DAGs call the same functions."""

from __future__ import annotations

import json
import logging
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

from photon.registry import servers_from_settings
from photon.settings import load_settings

app = typer.Typer(help="Photon: exactly-once joins of clicks to queries across data centers.", no_args_is_help=True)
registry_app = typer.Typer(help="The IdRegistry: init, status.", no_args_is_help=True)
app.add_typer(registry_app, name="registry")
console = Console()


@app.callback()
def _setup(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=Console(stderr=True), show_path=False)],
    )


@registry_app.command("init")
def registry_init(
    shards: Annotated[int, typer.Option(help="Shards of the first configuration.")] = 4,
    place: Annotated[str, typer.Option(help="Comma-separated servers to place shards on, round-robin.")] = "main",
    partition_minutes: Annotated[int, typer.Option(help="Width of the time partitions GC drops.")] = 60,
) -> None:
    """Apply migrations on every registry server and create the first shard configuration (idempotent)."""
    from photon.registry_admin import init_registry

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
    estimate: Annotated[bool, typer.Option(help="Row counts from statistics instead of count(*).")] = False,
) -> None:
    """Servers, shard configurations, per-shard GC thresholds, partitions, row counts and sizes."""
    from photon.registry_admin import status

    st = status(servers_from_settings(), exact=not estimate)
    if as_json:
        typer.echo(json.dumps(st, indent=2))
        return
    for name, s in st["servers"].items():
        state = "reachable, migrations " + ",".join(s["migrations"]) if s["reachable"] else f"UNREACHABLE {s['error']}"
        console.print(f"server [bold]{name}[/] ({s['dsn']}): {state}")
    console.print(f"partition width: {st['partition_width_us'] // 60_000_000} min; owners: {st['owners']}")
    for cfg in st["configs"]:
        table = Table(
            title=f"config v{cfg['version']} ({cfg['state']}), valid from {cfg['valid_from_us']} us, "
            f"{cfg['num_shards']} shards"
        )
        for col in ("shard", "server", "table", "gc threshold us", "partitions", "rows", "bytes"):
            table.add_column(col, justify="right" if col not in ("server", "table") else "left")
        for sh in cfg["shards"]:
            if "error" in sh:
                table.add_row(str(sh["shard"]), sh["server"], sh["table"], f"[red]{sh['error']}[/]", "", "", "")
                continue
            table.add_row(
                str(sh["shard"]),
                sh["server"],
                sh["table"],
                str(sh["gc_threshold_us"]),
                str(sh["partitions"]),
                f"{sh['rows']:,}",
                f"{sh['bytes']:,}",
            )
        console.print(table)


@app.command("demo")
def demo(
    ids: Annotated[int, typer.Option(help="Ids both writers race over.")] = 200_000,
    batch: Annotated[int, typer.Option(help="Ids per register call.")] = 20_000,
) -> None:
    """Initialise the registry and run two writers (dc-a, dc-b) racing over the same ids; print who won what."""
    from photon.demo import run_registry_race

    settings = load_settings()
    where = "PHOTON_REGISTRY_DSN" if settings.registry_dsn else f"embedded PostgreSQL in {settings.home}/postgres"
    console.print(f"registry: {where}")
    ok = run_registry_race(num_ids=ids, batch=batch, console=console)
    raise typer.Exit(0 if ok else 1)


def main() -> None:
    from photon.ids import InvalidEventIdError
    from photon.migrations import MigrationError
    from photon.pg import RegistryUnavailableError
    from photon.registry import RegistryError

    try:
        app()
    except (RegistryError, RegistryUnavailableError, MigrationError, InvalidEventIdError, ValueError) as exc:
        # Known failures get one clear line, not a traceback; -v logging still shows details.
        Console(stderr=True).print(f"[bold red]error:[/] {exc}")
        sys.exit(2)
