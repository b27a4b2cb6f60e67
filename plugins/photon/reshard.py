"""Resharding with timestamp-based configurations (Photon) and acknowledged desired state (Turbine).

1. Plan: configuration ``v = max + 1`` with the new shard count (and placement over servers), valid from
   ``now + lead``, in state ``planned``; its shard tables are created on their servers. Routing ignores it.
2. Joiners report the newest configuration they know with every batch commit (``photon.pipelines.config_version``).
   The reshard waits until every live pipeline (a commit within ``grace_s``) reports ``v``.
3. Activate, before ``valid_from - max_clock_skew`` (no id stamped at or after ``valid_from`` can have been
   registered yet): the configuration becomes ``active`` on the main server, then every server raises its enforced
   layout version (``photon.layout_enforced``) to ``v``. From then on a register transaction routed with an older
   layout is refused (``StaleLayoutError``); the client reloads and routes again, and a client held on the old
   layout cannot write.
   An id is registered in the shard that the configuration in force at its own timestamp names.
4. Or abort, when the acknowledgements do not arrive in time: the plan is marked ``aborted`` and never routes.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from photon.pg import autocommit
from photon.registry import MAIN
from photon.registry_admin import add_shard_config

US = 1_000_000


@dataclass
class ReshardReport:
    version: int
    num_shards: int
    valid_from_us: int
    state: str  # "active" or "aborted"
    acknowledged: dict[str, int] = field(default_factory=dict)  # live pipeline -> config version it reported
    waited_s: float = 0.0
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _live_acks(main: str, grace_s: float) -> dict[str, int]:
    with autocommit(main) as conn, conn.cursor() as cur:
        cur.execute(
            "SELECT pipeline, config_version FROM photon.pipelines"
            " WHERE heartbeat_at > now() - make_interval(secs => %s)",
            (grace_s,),
        )
        return {str(p): int(v) for p, v in cur.fetchall()}


def reshard(
    servers: Mapping[str, str],
    *,
    num_shards: int,
    placement: Sequence[str] | None = None,
    lead_s: float = 120.0,
    max_clock_skew_s: float = 10.0,
    grace_s: float = 60.0,
    poll_s: float = 0.5,
    now_us: int | None = None,
) -> ReshardReport:
    """Plan, wait for every live joiner's acknowledgement, then activate or abort (see the module's doc)."""
    if lead_s <= 2 * max_clock_skew_s:
        raise ValueError(
            f"lead {lead_s}s must exceed twice the maximum clock skew ({max_clock_skew_s}s): the joiners need time "
            "to acknowledge before the activation deadline (valid_from - skew)"
        )
    now = int(time.time() * US) if now_us is None else now_us
    valid_from = now + int(lead_s * US)
    deadline = valid_from - int(max_clock_skew_s * US)
    config = add_shard_config(
        servers, valid_from_us=valid_from, num_shards=num_shards, placement=placement, state="planned"
    )
    report = ReshardReport(config.version, num_shards, valid_from, "planned")
    t0 = time.monotonic()
    while True:
        acks = _live_acks(servers[MAIN], grace_s)
        report.acknowledged = acks
        if all(v >= config.version for v in acks.values()):
            break
        if time.time() * US + poll_s * US >= deadline:
            report.waited_s = time.monotonic() - t0
            behind = sorted(p for p, v in acks.items() if v < config.version)
            return _abort(servers, report, f"not acknowledged before the deadline by: {', '.join(behind)}")
        time.sleep(poll_s)
    report.waited_s = time.monotonic() - t0
    if time.time() * US >= deadline:
        return _abort(servers, report, "acknowledged too late: past valid_from - max clock skew")
    with autocommit(servers[MAIN]) as conn, conn.cursor() as cur:
        cur.execute(
            "UPDATE photon.shard_config SET state = 'active' WHERE version = %s AND state = 'planned'",
            (config.version,),
        )
        if cur.rowcount != 1:
            raise RuntimeError(f"shard configuration v{config.version} is no longer planned")
    for name in servers:  # main first is not required: a server enforcing v refuses until the client reloads
        with autocommit(servers[name]) as conn, conn.cursor() as cur:
            cur.execute(
                "UPDATE photon.shard_config SET state = 'active' WHERE version = %s AND state = 'planned'",
                (config.version,),
            )
            cur.execute("UPDATE photon.layout_enforced SET version = greatest(version, %s)", (config.version,))
    report.state = "active"
    return report


def _abort(servers: Mapping[str, str], report: ReshardReport, reason: str) -> ReshardReport:
    """Remove the plan: its (empty, never routed to) shard tables and shard map go; the configuration row stays,
    marked ``aborted``, so versions are never reused and the history shows what was tried."""
    from psycopg2 import sql

    from photon.registry_sql import shard_table
    from photon.sharding import ShardRef

    for name in servers:
        with autocommit(servers[name]) as conn:
            conn.autocommit = False
            with conn.cursor() as cur:
                cur.execute(
                    "UPDATE photon.shard_config SET state = 'aborted' WHERE version = %s AND state = 'planned'",
                    (report.version,),
                )
                cur.execute(
                    "DELETE FROM photon.shard_state WHERE config_version = %s RETURNING shard_no", (report.version,)
                )
                for (shard_no,) in cur.fetchall():
                    ref = ShardRef(report.version, int(shard_no))
                    cur.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(shard_table(ref)))
                cur.execute("DELETE FROM photon.shard_map WHERE config_version = %s", (report.version,))
            conn.commit()
    report.state, report.reason = "aborted", reason
    return report
