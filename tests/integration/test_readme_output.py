"""The README's examples that read the output (section "Reading the output"), run as they are written: the pyarrow
lines and the Spark lines, in a folder whose `.photon/out` holds two pipelines' joined tables (three batches
committed, one staged and never committed, as a crash leaves it), and `_` folders that are not pipelines (one of
them holding Parquet of another shape)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from photon.logs.schemas import JOINED_SCHEMA
from photon.logs.tables import ensure_tables, publish_batch, stage_rows
from tests.readme_blocks import README, code_blocks

pytestmark = pytest.mark.integration


def _python_blocks() -> list[str]:
    """The code blocks of the README's section "Reading the output", as the lines a reader pastes into Python."""
    blocks = [body for _, section, body in code_blocks(README.read_text()) if section == "Reading the output"]
    assert len(blocks) == 2, blocks  # pyarrow, then Spark
    return ["\n".join(body) for body in blocks]


def _joined(pipeline: str, ids: list[str]) -> pa.Table:
    n = len(ids)
    columns: dict[str, Any] = {f.name: pa.nulls(n, f.type) for f in JOINED_SCHEMA}
    columns |= {"click_id": pa.array(ids), "pipeline": pa.array([pipeline] * n)}
    columns["click_ts_us"] = pa.array([1_764_300_000_000_000] * n, pa.int64())
    return pa.table(columns, schema=JOINED_SCHEMA)


@pytest.fixture
def out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    out = tmp_path / ".photon" / "out"
    for pipeline, batches in (("dc-a", [3, 2, 1]), ("dc-b", [4])):
        root = out / pipeline
        ensure_tables(root)
        for b, n in enumerate(batches, 1):
            ids = [f"10.0.0.1-1-{pipeline[-1]}{b}{k:03d}" for k in range(n)]
            stage = f"_staging/b{b}"
            stage_rows(root, "joined", stage, f"b{b}-e1-p0", _joined(pipeline, ids), b)
            if b < 3:  # dc-a's batch 3 crashed before its commit: its data file is there, named by no commit
                publish_batch(root, pipeline, b, stage)
    index = out / "_query_index" / "dc-a"  # not a pipeline
    index.mkdir(parents=True)
    pq.write_table(pa.table({"bucket": [1]}), index / "part-0.parquet")
    (out / "_query_index" / "joined").mkdir()
    pq.write_table(_joined("x", ["10.0.0.9-9-7"]), out / "_query_index" / "joined" / "part-0.parquet")
    monkeypatch.chdir(tmp_path)
    return out


def _run(code: str) -> str:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, str(README), "exec"), {})  # the README's own lines
    return printed.getvalue()


def test_the_pyarrow_example_reads_every_pipeline_and_nothing_else(out: Path) -> None:
    printed = _run(_python_blocks()[0])
    assert printed.startswith("9 "), printed  # dc-a's uncommitted batch 3 is not read
    assert 'pipeline: [["dc-a","dc-b"]]' in printed and "click_id_count: [[5,4]]" in printed, printed


def test_the_spark_example_reads_every_pipeline_and_nothing_else(out: Path, spark: Any) -> None:
    """On the tests' Spark session (the example's getOrCreate returns it), its JVM's working folder moved to where the
    reader stands for the while: a JVM resolves relative paths against its own, the clone's here, not Python's."""
    jvm = spark._jvm
    fs = jvm.org.apache.hadoop.fs.FileSystem.get(spark._jsc.hadoopConfiguration())
    before = fs.getWorkingDirectory()
    fs.setWorkingDirectory(jvm.org.apache.hadoop.fs.Path(str(out.parents[1])))
    try:
        printed = _run("\n".join(_python_blocks()))
    finally:
        fs.setWorkingDirectory(before)
    rows = [line for line in printed.splitlines() if line.startswith("|")]
    assert rows == ["|pipeline|count|", "|    dc-a|    5|", "|    dc-b|    4|"], printed
