"""Registry garbage collection (Photon's GC thread): per shard, move the GC threshold forward to
``now - retention - max_clock_skew`` (never back: ``greatest()`` in the UPDATE and a trigger), then drop the time
partitions wholly below it and delete the rows left below it in the partition it cuts through.

``now`` is the main registry server's clock, never the GC host's: a threshold never goes back, so one run on a host
whose clock is ahead would move it forward for good and refuse ids that are still within the retention.

A register transaction reads its shard's threshold FOR SHARE in the transaction that inserts, so once the new
threshold commits no id below it can be registered: the joiner sends such a click to ``unjoinable/`` with the reason
"older than the registry's garbage-collection threshold", and replaying old logs never duplicates output.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from photon.logs.layout import partition_of
from photon.pg import across_failover, autocommit
from photon.registry import sql as q
from photon.registry.client import MAIN, read_layout
from photon.registry.sharding import ShardRef

US = 1_000_000
DEFAULT_RETENTION_S = 3 * 86_400  # how long the registry remembers an id: longer than any replay of old logs


@dataclass
class ShardGC:
    shard: str
    server: str
    threshold_before_us: int
    threshold_after_us: int
    partitions: list[str] = field(default_factory=list)  # dropped (or, in a dry run, that would be)
    rows_freed: int = 0
    bytes_freed: int = 0
    straggler_rows: int = 0  # rows below the threshold in the partition it cuts through (deleted)


@dataclass
class GCReport:
    dry_run: bool
    target_us: int
    shards: list[ShardGC] = field(default_factory=list)
    consumed_files_freed: int = 0  # records of files behind their pipeline's listing mark and the horizon

    @property
    def rows_freed(self) -> int:
        return sum(s.rows_freed + s.straggler_rows for s in self.shards)

    @property
    def bytes_freed(self) -> int:
        return sum(s.bytes_freed for s in self.shards)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "rows_freed": self.rows_freed, "bytes_freed": self.bytes_freed}


def gc_target_us(now_us: int, retention_s: float, max_clock_skew_s: float) -> int:
    return now_us - int((retention_s + max_clock_skew_s) * US)


def collect_garbage(
    servers: Mapping[str, str],
    *,
    retention_s: float = DEFAULT_RETENTION_S,
    max_clock_skew_s: float = 10.0,
    now_us: int | None = None,
    dry_run: bool = False,
) -> GCReport:
    """One GC pass over every shard of every configuration. Safe to run concurrently with itself and with joiners.
    ``now_us`` (tests) replaces the registry server's clock."""
    if retention_s <= 0:
        raise ValueError("retention must be positive")
    from photon.registry.admin import record_shard_sizes, server_clock_us

    now = server_clock_us(servers[MAIN]) if now_us is None else now_us
    target = gc_target_us(now, retention_s, max_clock_skew_s)
    layout, _ = read_layout(servers[MAIN])
    report = GCReport(dry_run=dry_run, target_us=target)
    for ref in layout.shards():
        server = layout.server_of(ref)
        # Both steps run again after a failover: a threshold never moves back, a partition dropped is skipped.
        dsn = servers[server]
        report.shards.append(across_failover(lambda: _collect_shard(dsn, server, ref, target, dry_run)))  # noqa: B023
    report.consumed_files_freed = across_failover(lambda: _collect_consumed_files(servers[MAIN], target, dry_run))
    if not dry_run:
        record_shard_sizes(servers, "gc")
    return report


def _collect_consumed_files(main: str, target: int, dry_run: bool) -> int:
    """Consumed-file records of partitions older than the horizon and behind the pipeline's own listing mark (its
    joiner never lists them again, and their clicks are past the registry's memory): the table stays as large as
    the retention, not as the pipeline's history. Files directly in ``<kind>/`` are kept (they are always listed)."""
    horizon = partition_of(target)
    freed = 0
    with autocommit(main) as conn, conn.cursor() as cur:
        for kind in ("queries", "clicks"):
            where = (
                f"FROM photon.consumed_files c USING photon.pipelines p JOIN photon.batches b"
                f" ON b.pipeline = p.pipeline AND b.batch_seq = p.last_batch"
                f" WHERE c.pipeline = p.pipeline AND c.kind = %s AND b.{kind}_from IS NOT NULL"  # NULL: lists all
                f" AND c.part < least(b.{kind}_from, %s)"
            )
            if dry_run:
                cur.execute(f"SELECT count(*) {where.replace('USING', ',', 1)}", (kind, horizon))
                freed += int(cur.fetchone()[0])
            else:
                cur.execute(f"DELETE {where}", (kind, horizon))
                freed += cur.rowcount
    return freed


def _collect_shard(dsn: str, server: str, ref: ShardRef, target: int, dry_run: bool) -> ShardGC:
    with autocommit(dsn) as conn, conn.cursor() as cur:
        cur.execute(q.READ_THRESHOLD, (ref.version, ref.shard_no))
        row = cur.fetchone()
        if row is None:
            raise RuntimeError(f"shard {ref} is missing on server {server}")
        before = int(row[0])
        if dry_run:
            after = max(before, target)
        else:
            cur.execute(q.ADVANCE_THRESHOLD, (target, ref.version, ref.shard_no))
            after = int(cur.fetchone()[0])  # another GC may have moved it further: never back
        out = ShardGC(str(ref), server, before, after)
        cur.execute("SELECT * FROM photon.expired_partitions(%s, %s, %s)", (ref.version, ref.shard_no, after))
        expired = cur.fetchall()
        for name, start, end, size in expired:
            if dry_run:  # through the shard table: the GC role's privileges are on it, not on its partitions
                cur.execute(q.count_range(ref), (start, end))
                rows = int(cur.fetchone()[0])
            else:
                cur.execute("SELECT photon.drop_expired_partition(%s, %s, %s)", (ref.version, ref.shard_no, name))
                rows = int(cur.fetchone()[0])
                if rows < 0:
                    continue  # dropped by a concurrent GC
            out.partitions.append(str(name))
            out.rows_freed += rows
            out.bytes_freed += int(size)
        cur.execute(q.count_below(ref) if dry_run else q.delete_below(ref), (after,))
        # A dry run dropped nothing: the rows below the threshold include those of the expired partitions.
        out.straggler_rows = int(cur.fetchone()[0]) - out.rows_freed if dry_run else cur.rowcount
    return out
