"""SQL of the registry's shard-table family. Table names only ever come from ``ShardRef.table`` (checked against a
strict pattern) and go through ``psycopg2.sql.Identifier``; values are always parameters."""

from __future__ import annotations

import re

from psycopg2 import sql

from photon.registry.sharding import SHARD_TABLE_RE, ShardRef

PARTITION_RE = re.compile(r"^ids_c[1-9][0-9]{0,8}_s(0|[1-9][0-9]{0,4})_p[0-9]+$")

# Per connection: the batch goes in here by binary COPY (no WAL, no per-row statements), then one INSERT ... SELECT.
CREATE_BATCH_TABLE = (
    "CREATE TEMP TABLE IF NOT EXISTS photon_batch"
    " (i integer NOT NULL, ts_us bigint NOT NULL, src bigint NOT NULL) ON COMMIT DELETE ROWS"
)
COPY_BATCH = "COPY photon_batch (i, ts_us, src) FROM STDIN WITH (FORMAT binary)"

# FOR SHARE: a GC run moving the threshold (UPDATE) waits for this transaction, and this transaction, if the
# threshold moved after its snapshot, fails with 40001 and is retried with the new value.
LOCK_THRESHOLD = "SELECT gc_threshold_us FROM photon.shard_state WHERE config_version = %s AND shard_no = %s FOR SHARE"
# FOR SHARE: activating a new layout (an UPDATE of this row) waits for the register transactions in flight.
LOCK_LAYOUT_VERSION = "SELECT version FROM photon.layout_enforced FOR SHARE"
READ_THRESHOLD = "SELECT gc_threshold_us FROM photon.shard_state WHERE config_version = %s AND shard_no = %s"
ENSURE_PARTITIONS = "SELECT photon.ensure_partitions(%s, %s, %s::bigint[])"
ADVANCE_THRESHOLD = (
    "UPDATE photon.shard_state SET gc_threshold_us = greatest(gc_threshold_us, %s), gc_updated_at = now()"
    " WHERE config_version = %s AND shard_no = %s RETURNING gc_threshold_us"
)
# Partitions, bytes and estimated rows of one shard table (named by its qualified name).
SHARD_SIZE = (
    "SELECT count(*), coalesce(sum(pg_total_relation_size(c.oid)), 0), coalesce(sum(greatest(c.reltuples, 0)), 0)"
    " FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = to_regclass(%s)"
)
LIST_PARTITIONS = (
    "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = to_regclass(%s)"
)


def _table(ref: ShardRef) -> sql.Composed:
    name = ref.table
    if not SHARD_TABLE_RE.match(name):
        raise ValueError(f"invalid shard table name {name!r}")
    return sql.SQL("photon.{}").format(sql.Identifier(name))


shard_table = _table  # the qualified, checked identifier of a shard's table, for other modules' statements


def copy_into(ref: ShardRef, threshold: int) -> sql.Composed:
    """The fast path: bulk COPY straight into the shard. It succeeds only if every id is new (one id already there
    fails it with a unique violation), and its WHERE repeats the client's filter: nothing below the locked threshold.
    COPY takes no bind parameters: the threshold (an int read from the database) goes in as a quoted literal."""
    return sql.SQL("COPY {} (ts_us, src, token) FROM STDIN WITH (FORMAT binary) WHERE ts_us >= {}").format(
        _table(ref), sql.Literal(int(threshold))
    )


def conditional_insert(ref: ShardRef) -> sql.Composed:
    """The conditional path, one statement: every CTE sees the same snapshot, so ``prior`` holds exactly the rows
    that were there before (with their tokens) and ``ins`` the rows this statement inserted. At SERIALIZABLE, a
    conflicting row committed after our snapshot makes ON CONFLICT fail with 40001 instead of being skipped unseen.
    The first result row is (-1, inserted count); the others are (batch position, token) of the prior rows. The
    LATERAL ... OFFSET 0 keeps one index probe per batch row (the temp table has no statistics)."""
    return sql.SQL(
        "WITH prior AS MATERIALIZED ("
        " SELECT b.i, r.token FROM photon_batch b CROSS JOIN LATERAL ("
        "  SELECT x.token FROM {t} x WHERE x.ts_us = b.ts_us AND x.src = b.src OFFSET 0) r),"
        " ins AS (INSERT INTO {t} (ts_us, src, token) SELECT ts_us, src, %(token)s FROM photon_batch"
        "  WHERE ts_us >= %(threshold)s ON CONFLICT DO NOTHING RETURNING 1)"
        " SELECT -1, (SELECT count(*) FROM ins) UNION ALL SELECT i, token FROM prior"
    ).format(t=_table(ref))


def lookup_rows(ref: ShardRef) -> sql.Composed:
    return sql.SQL(
        "SELECT b.i, r.token FROM photon_batch b CROSS JOIN LATERAL ("
        " SELECT x.token FROM {} x WHERE x.ts_us = b.ts_us AND x.src = b.src OFFSET 0) r"
    ).format(_table(ref))


def count_rows(ref: ShardRef) -> sql.Composed:
    return sql.SQL("SELECT count(*) FROM {}").format(_table(ref))


def qualified(ref: ShardRef) -> str:
    return f"photon.{ref.table}"


def count_below(ref: ShardRef) -> sql.Composed:
    return sql.SQL("SELECT count(*) FROM {} WHERE ts_us < %s").format(_table(ref))


def count_range(ref: ShardRef) -> sql.Composed:
    return sql.SQL("SELECT count(*) FROM {} WHERE ts_us >= %s AND ts_us < %s").format(_table(ref))


def delete_below(ref: ShardRef) -> sql.Composed:
    return sql.SQL("DELETE FROM {} WHERE ts_us < %s").format(_table(ref))


def count_partition(name: str) -> sql.Composed:
    """Rows of one partition of a shard (its name checked against the shard-partition pattern)."""
    if not PARTITION_RE.match(name):
        raise ValueError(f"invalid shard partition name {name!r}")
    return sql.SQL("SELECT count(*) FROM photon.{}").format(sql.Identifier(name))
