"""The tests' own reading of the output: each pipeline's ``<out>/<pipeline>/<kind>`` is a Delta table, read through
its log with deltalake (never the folder's Parquet files: a crashed batch's data files are there too, and a reader
of the folder would count them). A task's rows before their batch is published are read from the data files its
add records name (``<stage>/_adds``), as the publish commits them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import DeltaTable


def pipelines(out: Path) -> list[str]:
    """The pipeline folders under ``out`` (``_*`` and ``.*`` are not pipelines)."""
    return sorted(p.name for p in out.iterdir() if p.is_dir() and p.name[0] not in "_.") if out.is_dir() else []


def table(out: Path, kind: str, pipeline: str | None = None, columns: list[str] | None = None) -> pa.Table:
    """The committed ``kind`` rows of one pipeline's table, or of every pipeline's, as of their current snapshots
    (a table not created yet holds none)."""
    parts = []
    for name in [pipeline] if pipeline is not None else pipelines(out):
        path = out / name / kind
        if DeltaTable.is_deltatable(str(path)):
            parts.append(DeltaTable(str(path)).to_pyarrow_table(columns=columns))
    return pa.concat_tables(parts) if parts else pa.table({c: [] for c in columns or []})


def rows(out: Path, kind: str, pipeline: str | None = None, columns: list[str] | None = None) -> list[dict[str, Any]]:
    """``table`` as Python rows."""
    return table(out, kind, pipeline, columns).to_pylist()


def ids(out: Path, kind: str = "joined", pipeline: str | None = None) -> list[str]:
    """The click ids of the committed ``kind`` rows (each as often as it is there)."""
    return [r["click_id"] for r in rows(out, kind, pipeline, ["click_id"])]


def data_files(out: Path, kind: str, pipeline: str) -> list[str]:
    """The names of the data files the table's current snapshot holds."""
    path = out / pipeline / kind
    if not DeltaTable.is_deltatable(str(path)):
        return []
    return sorted(uri.rsplit("/", 1)[-1] for uri in DeltaTable(str(path)).file_uris())


def staged(task: Any, kind: str) -> list[dict[str, Any]]:
    """The ``kind`` rows a task wrote for its batch, not yet published: the data files its add records name."""
    found = []
    for record in sorted((Path(task.root, task.stage) / "_adds").glob(f"{kind}-*.json")):
        for add in json.loads(record.read_text())["files"]:
            found += pq.read_table(Path(task.root) / kind / add["path"]).to_pylist()
    return found
