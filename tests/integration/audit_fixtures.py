"""A perfect output built straight from the generator's ground truth, for planting faults into. Test-only: the
product's output comes from the joiner."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import DeltaTable, write_deltalake

from photon.logs.schemas import JOINED_SCHEMA, QUARANTINE_SCHEMA, UNJOINABLE_SCHEMA
from photon.logs.tables import ROW_SCHEMAS, TIME_COLUMN, table_schema


def perfect_output(logs: Path, out: Path, latency_us: int = 2_000_000) -> None:
    """dc-a joins the even clicks that should join, dc-b the odd ones; the rest are unjoinable in both; every
    malformed line is quarantined by each pipeline that read its file."""
    m = pq.read_table(logs / "_manifest" / "clicks.parquet")
    files = pq.read_table(logs / "_manifest" / "files.parquet").to_pylist()
    dcs = sorted({f["dc"] for f in files})
    join = pc.is_in(m["expect"], value_set=pa.array(["join", "either"]))
    joined, unjoinable = m.filter(join), m.filter(pc.invert(join))
    n = joined.num_rows
    for i, dc in enumerate(dcs):
        pipeline_output(out, dc, joined.filter(pa.array(np.arange(n) % len(dcs) == i)), unjoinable, files, latency_us)


def pipeline_output(
    out: Path, dc: str, joined: pa.Table, unjoinable: pa.Table, files: list[dict], latency_us: int = 2_000_000
) -> None:
    """``<out>/<dc>/``: ``joined`` and ``unjoinable`` (manifest rows) as that pipeline's output, and every malformed
    line of its replica (``files``, the manifest's) quarantined."""
    k = joined.num_rows
    write(
        out / dc / "joined" / "part-0.parquet",
        pa.table(
            {
                "click_id": joined["click_id"],
                "query_id": joined["query_id"],
                "ad_id": joined["ad_id"],
                "click_ts_us": joined["click_ts_us"],
                "query_ts_us": joined["query_ts_us"],
                "joined_at_us": pc.add(joined["click_ts_us"], latency_us),
                "pipeline": [dc] * k,
                "user_id": ["u1"] * k,
                "query_text": ["q"] * k,
                "country": ["DE"] * k,
                "advertiser_id": ["adv1"] * k,
                "bid_micros": [1] * k,
            },
            schema=JOINED_SCHEMA,
        ),
    )
    u = unjoinable.num_rows
    write(
        out / dc / "unjoinable" / "part-0.parquet",
        pa.table(
            {
                "click_id": unjoinable["click_id"],
                "query_id": unjoinable["query_id"],
                "ad_id": unjoinable["ad_id"],
                "click_ts_us": unjoinable["click_ts_us"],
                "decided_at_us": unjoinable["click_ts_us"],
                "pipeline": [dc] * u,
                "reason": ["query not found within the maximum join delay"] * u,
            },
            schema=UNJOINABLE_SCHEMA,
        ),
    )
    rows = [(f["kind"], f["name"], j) for f in files if f["dc"] == dc for j in range(f["malformed"])]
    write(
        out / dc / "quarantine" / "part-0.parquet",
        pa.table(
            {
                "pipeline": [dc] * len(rows),
                "kind": [r[0] for r in rows],
                "file": [r[1] for r in rows],
                "line": [r[2] + 1 for r in rows],
                "raw": [b"x"] * len(rows),
                "raw_bytes": [1] * len(rows),
                "reason": ["malformed"] * len(rows),
                "decided_at_us": [0] * len(rows),
            },
            schema=QUARANTINE_SCHEMA,
        ),
    )


def late_in_one_replica(logs: Path, copy: Path, dc: str, num_files: int) -> set[str]:
    """``copy``: the logs (each data center's folder linked) with a manifest in which ``num_files`` query files
    reached ``dc``'s replica an hour late, and the other replicas as before (in time). Returns the clicks that must
    join (the manifest's ``join``) whose query is in those files: only another data center's pipeline can join
    them, and ``dc``'s gives them up."""
    copy.mkdir()
    for folder in logs.iterdir():
        if folder.name != "_manifest":
            (copy / folder.name).symlink_to(folder)
    shutil.copytree(logs / "_manifest", copy / "_manifest")
    late: set[str] = set()
    for part in sorted((copy / "_manifest" / "files.parquet").glob("*.parquet")):
        t = pq.read_table(part)
        rows = t.to_pylist()
        for r in rows:
            if r["dc"] == dc and r["kind"] == "queries" and len(late) < num_files and r["name"] not in late:
                late.add(r["name"])
                r["arrival_us"] += 3_600_000_000
        pq.write_table(pa.Table.from_pylist(rows, schema=t.schema), part)
    query_ids: set[str] = set()
    for name in late:
        for line in (logs / dc / "queries" / name).read_bytes().splitlines():
            try:
                query_ids.add(json.loads(line)["query_id"])
            except (ValueError, KeyError, TypeError):  # the file's malformed lines
                continue
    m = pq.read_table(logs / "_manifest" / "clicks.parquet")
    hit = m.filter(
        pc.and_(pc.is_in(m["query_id"], value_set=pa.array(sorted(query_ids))), pc.equal(m["expect"], "join"))
    )
    return set(hit["click_id"].to_pylist())


def write(path: Path, table: pa.Table) -> None:
    """``<out>/<pipeline>/<kind>/part-0.parquet`` names the pipeline's ``kind`` table: ``table`` (its rows, with or
    without ``batch`` and ``hour``) becomes the table's content, in one commit as batch 1 (a Delta table, as the
    joiner writes it: readers see committed rows only)."""
    kind, where = path.parent.name, path.parent
    rows = table.select(ROW_SCHEMAS[kind].names).cast(ROW_SCHEMAS[kind])
    batch = table["batch"] if "batch" in table.column_names else pa.array([1] * rows.num_rows, pa.int64())
    secs = pc.cast(pc.multiply(pc.divide(rows[TIME_COLUMN[kind]], 1_000_000), 1_000_000), pa.timestamp("us", "UTC"))
    rows = rows.append_column("batch", batch).append_column("hour", pc.strftime(secs, "%Y%m%d%H"))
    write_deltalake(str(where), rows.cast(table_schema(kind)), mode="overwrite", partition_by=["hour"])


def read(path: Path) -> pa.Table:
    """The rows of the table ``path`` names (``write``), as committed."""
    return DeltaTable(str(path.parent)).to_pyarrow_table()


def rewrite(path: Path, edit) -> None:  # type: ignore[no-untyped-def]
    """Replace the table's rows by ``edit(rows)`` (a new commit)."""
    write(path, edit(read(path)))
