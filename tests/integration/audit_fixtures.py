"""A perfect output built straight from the generator's ground truth, for planting faults into. Test-only: the
product's output comes from the joiner."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from photon.logs.schemas import JOINED_SCHEMA, QUARANTINE_SCHEMA, UNJOINABLE_SCHEMA


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
        mine = joined.filter(pa.array(np.arange(n) % len(dcs) == i))
        k = mine.num_rows
        write(
            out / dc / "joined" / "part-0.parquet",
            pa.table(
                {
                    "click_id": mine["click_id"],
                    "query_id": mine["query_id"],
                    "ad_id": mine["ad_id"],
                    "click_ts_us": mine["click_ts_us"],
                    "query_ts_us": mine["query_ts_us"],
                    "joined_at_us": pc.add(mine["click_ts_us"], latency_us),
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


def write(path: Path, table: pa.Table) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)


def rewrite(path: Path, edit) -> None:  # type: ignore[no-untyped-def]
    """Replace a parquet file by ``edit(table)``."""
    pq.write_table(edit(pq.read_table(path)), path)
