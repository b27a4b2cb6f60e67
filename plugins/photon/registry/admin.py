"""Registry administration: init (migrations + first shard configuration), new shard configurations, GC
thresholds, and status. Writes that concern every server go to the other servers first and to ``main`` last:
``main`` is authoritative, so a configuration exists once ``main`` has it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg2.errors
import psycopg2.extensions

from photon.pg import across_failover, autocommit, redact
from photon.registry import sql as q
from photon.registry.client import MAIN, RegistryError, _check_server_names, read_layout
from photon.registry.migrations import applied, apply_migrations
from photon.registry.sharding import ShardConfig, ShardRef

# Component -> the NOLOGIN role (sql/) its login holds.
COMPONENT_ROLES: dict[str, str] = {
    "joiner": "photon_joiner",
    "verifier": "photon_verifier",
    "gc": "photon_gc",
    "reshard": "photon_reshard",
}


@dataclass
class InitReport:
    migrations: dict[str, list[str]] = field(default_factory=dict)  # server -> files applied now
    created_config: ShardConfig | None = None
    existing_config: list[ShardConfig] = field(default_factory=list)


def _check_placement(servers: Mapping[str, str], placement: Sequence[str] | None) -> list[str]:
    placement = list(placement or [MAIN])
    missing = [s for s in placement if s not in servers]
    if missing:
        raise RegistryError(f"no DSN for server(s) {missing}: name them in PHOTON_REGISTRY_SERVERS")
    return placement


def _ordered(servers: Mapping[str, str]) -> list[str]:
    return [*sorted(s for s in servers if s != MAIN), MAIN]


def init_registry(
    servers: Mapping[str, str],
    *,
    num_shards: int = 4,
    placement: Sequence[str] | None = None,
    partition_width_us: int | None = None,
) -> InitReport:
    """Apply migrations on every server; create the first shard configuration if there is none. Idempotent."""
    _check_server_names(servers)
    _check_placement(servers, placement)
    report = InitReport()
    for name in _ordered(servers):
        report.migrations[name] = apply_migrations(servers[name])
    with autocommit(servers[MAIN]) as conn, conn.cursor() as cur:
        cur.execute("SELECT version, valid_from_us, num_shards, state FROM photon.shard_config ORDER BY version")
        existing = [ShardConfig(int(v), int(f), int(n), str(s)) for v, f, n, s in cur.fetchall()]
    if existing:
        report.existing_config = existing
        return report
    if partition_width_us is not None:
        if partition_width_us < 60_000_000 or 86_400_000_000 % partition_width_us:
            raise ValueError("partition width must be at least a minute and divide a day")
        for name in _ordered(servers):
            with autocommit(servers[name]) as conn, conn.cursor() as cur:
                cur.execute(
                    "UPDATE photon.registry_meta SET value = %s WHERE key = 'partition_width_us'",
                    (str(partition_width_us),),
                )
    report.created_config = add_shard_config(servers, valid_from_us=0, num_shards=num_shards, placement=placement)
    return report


def add_shard_config(
    servers: Mapping[str, str],
    *,
    valid_from_us: int,
    num_shards: int,
    placement: Sequence[str] | None = None,
    state: str = "active",
) -> ShardConfig:
    """Add shard configuration ``max(version) + 1`` valid from ``valid_from_us``; shard ``i`` goes to server
    ``placement[i % len(placement)]``. Creates the shard tables on their servers and records the configuration
    and shard map on every server. For the owner (``init``, tests); a live registry changes its configuration
    through the acknowledged, future-dated reshard procedure (``photon.registry.reshard``)."""
    _check_server_names(servers)
    placement = _check_placement(servers, placement)
    if not 1 <= num_shards <= 4096:
        raise ValueError("num_shards must be in 1..4096")
    shard_server = {i: placement[i % len(placement)] for i in range(num_shards)}
    # Main first: it numbers the configuration, and its INSERT has no ON CONFLICT, so two callers at once never both
    # take a version (the loser gets the unique violation). The other servers copy what main holds.
    with autocommit(servers[MAIN]) as conn, conn.cursor() as cur:
        try:
            cur.execute(
                "INSERT INTO photon.shard_config (version, valid_from_us, num_shards, state)"
                " SELECT coalesce(max(version), 0) + 1, %s, %s, %s FROM photon.shard_config RETURNING version",
                (valid_from_us, num_shards, state),
            )
        except psycopg2.errors.UniqueViolation as exc:
            raise RegistryError(f"another shard configuration was added at the same moment: {exc}".strip()) from exc
        version = int(cur.fetchone()[0])
    config = ShardConfig(version, valid_from_us, num_shards, state)
    for name in _ordered(servers):
        with autocommit(servers[name]) as conn:
            conn.autocommit = False
            with conn.cursor() as cur:
                if name != MAIN:
                    cur.execute(
                        "INSERT INTO photon.shard_config (version, valid_from_us, num_shards, state)"
                        " VALUES (%s, %s, %s, %s) ON CONFLICT DO NOTHING",
                        (version, valid_from_us, num_shards, state),
                    )
                cur.executemany(
                    "INSERT INTO photon.shard_map (config_version, shard_no, server) VALUES (%s, %s, %s)"
                    " ON CONFLICT DO NOTHING",
                    [(version, i, srv) for i, srv in shard_server.items()],
                )
                for i, srv in shard_server.items():
                    if srv == name:
                        cur.execute("SELECT photon.create_shard(%s, %s)", (version, i))
            conn.commit()
    return config


def server_clock_us(dsn: str) -> int:
    """The registry server's clock in epoch microseconds: thresholds and deadlines follow the registry's time, not
    the clock of whichever host runs the job."""
    with autocommit(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT photon.clock_us()")
        return int(cur.fetchone()[0])


def advance_gc_threshold(servers: Mapping[str, str], shard: ShardRef, ts_us: int) -> int:
    """Move one shard's GC threshold forward to ``ts_us`` (never back); return the threshold now in force."""
    layout, _ = across_failover(lambda: read_layout(servers[MAIN]))  # a read
    dsn = servers[layout.server_of(shard)]

    def advance() -> int:
        with autocommit(dsn) as conn, conn.cursor() as cur:
            cur.execute(q.ADVANCE_THRESHOLD, (ts_us, shard.version, shard.shard_no))
            row = cur.fetchone()
            if row is None:
                raise RegistryError(f"shard {shard} not found on its server")
            return int(row[0])

    return across_failover(advance)  # again after a failover: greatest() moves a threshold there once


def status(servers: Mapping[str, str], *, exact: bool = True) -> dict[str, Any]:
    """Servers, shard configurations, and per shard: server, GC threshold, partitions, rows, bytes."""
    out: dict[str, Any] = {"servers": {}, "configs": []}
    for name, dsn in servers.items():
        try:
            out["servers"][name] = {
                "dsn": redact(dsn),
                "reachable": True,
                "migrations": [f"{v:04d}_{n}" for v, n in applied(dsn)],
            }
        except Exception as exc:
            out["servers"][name] = {"dsn": redact(dsn), "reachable": False, "error": str(exc).strip()}
    layout, width = read_layout(servers[MAIN])
    out["partition_width_us"] = width
    with autocommit(servers[MAIN]) as conn, conn.cursor() as cur:
        cur.execute("SELECT version, valid_from_us, num_shards, state FROM photon.shard_config ORDER BY version")
        configs = cur.fetchall()
        # An owner is a pipeline's identity in its tokens: current until a fence retires it (a lease ending does
        # not end it; only the registry race's one-off owners are ever ended).
        cur.execute(
            "SELECT count(*), count(*) FILTER (WHERE owner_id IN (SELECT owner_id FROM photon.pipelines)),"
            " count(*) FILTER (WHERE retired_at IS NOT NULL), count(*) FILTER (WHERE ended_at IS NOT NULL)"
            " FROM photon.owners"
        )
        total, current, retired, ended = cur.fetchone()
    out["owners"] = {"total": int(total), "current": int(current), "retired": int(retired), "ended": int(ended)}
    for version, valid_from, num, state in configs:
        shards = []
        for shard_no in range(num if state != "aborted" else 0):  # an aborted plan's shards were removed
            ref = ShardRef(int(version), shard_no)
            server = layout.placement.get(ref, "?")
            shards.append(
                {
                    "shard": shard_no,
                    "server": server,
                    "table": ref.table,
                    **_shard_facts(servers.get(server), ref, exact),
                }
            )
        out["configs"].append(
            {
                "version": int(version),
                "valid_from_us": int(valid_from),
                "num_shards": int(num),
                "state": state,
                "shards": shards,
            }
        )
    return out


def _shard_facts(dsn: str | None, ref: ShardRef, exact: bool) -> dict[str, Any]:
    if dsn is None:
        return {"error": "no DSN for this server"}
    try:
        with autocommit(dsn) as conn, conn.cursor() as cur:
            cur.execute(q.READ_THRESHOLD, (ref.version, ref.shard_no))
            row = cur.fetchone()
            if row is None:
                return {"error": "shard missing on its server"}
            cur.execute(q.SHARD_SIZE, (q.qualified(ref),))
            parts, size, estimate = cur.fetchone()
            rows = int(estimate)
            if exact:
                cur.execute(q.count_rows(ref))
                rows = int(cur.fetchone()[0])
        return {
            "gc_threshold_us": int(row[0]),
            "partitions": int(parts),
            "rows": rows,
            "bytes": int(size),
            "rows_exact": exact,
        }
    except Exception as exc:
        return {"error": str(exc).strip()}


def record_shard_sizes(servers: Mapping[str, str], event: str, *, at_us: int | None = None) -> int:
    """Append every shard's rows, bytes and GC threshold to ``photon.shard_history`` (for `photon report`)."""
    at = across_failover(lambda: server_clock_us(servers[MAIN])) if at_us is None else at_us

    def record() -> int:
        st = status(servers, exact=True)
        rows = [
            (at, cfg["version"], sh["shard"], sh["server"], sh["rows"], sh["bytes"], sh["gc_threshold_us"], event)
            for cfg in st["configs"]
            for sh in cfg["shards"]
            if "error" not in sh
        ]
        with autocommit(servers[MAIN]) as conn, conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO photon.shard_history (at_us, config_version, shard_no, server, rows, bytes,"
                " gc_threshold_us, event) VALUES (%s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
                rows,
            )
        return len(rows)

    # Again after a failover: the rows are keyed by the one time taken above, so a second insert adds nothing.
    return across_failover(record)


def component_login(component: str) -> str:
    """The LOGIN role a component runs as where photon creates it: ``photon_joiner_login`` (the name
    docker/initdb uses too)."""
    return f"{COMPONENT_ROLES[component]}_login"


def ensure_component_logins(admin_dsn: str, passwords: Mapping[str, str]) -> dict[str, str]:
    """On a server this process administers (the embedded one): a LOGIN role per component holding only its NOLOGIN
    role, created if missing, its password set to ``passwords[component]``; returns component -> DSN (``admin_dsn``
    as that login). Run after the migrations, which create the NOLOGIN roles."""
    from psycopg2 import sql

    dsns: dict[str, str] = {}
    with autocommit(admin_dsn, guard=False) as conn, conn.cursor() as cur:
        for component, role in COMPONENT_ROLES.items():
            login = component_login(component)
            cur.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (login,))
            verb = "ALTER" if cur.fetchone() else "CREATE"
            cur.execute(
                sql.SQL(verb + " ROLE {} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD %s").format(
                    sql.Identifier(login)
                ),
                (passwords[component],),
            )
            cur.execute(sql.SQL("GRANT {} TO {}").format(sql.Identifier(role), sql.Identifier(login)))
            dsns[component] = psycopg2.extensions.make_dsn(admin_dsn, user=login, password=passwords[component])
    return dsns
