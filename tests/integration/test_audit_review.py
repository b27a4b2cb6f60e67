"""Review of issue 33: a click whose query dc-a's replica had in time (in one of two files holding a duplicated query
line) and dc-a lost must stay lost when told only dc-a ran, whichever of the two files reached dc-a late."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from photon.tools.audit import audit
from tests.integration.audit_fixtures import pipeline_output
from tests.integration.test_audit import logs  # noqa: F401  (the module-scoped generated logs)


def _dup_query(root: Path) -> tuple[str, str, str]:
    """A must-join click's query id whose line is in two different dc-a query files: (query_id, file1, file2)."""
    m = pq.read_table(root / "_manifest" / "clicks.parquet")
    must = dict(zip(m.filter(pc.equal(m["expect"], "join"))["query_id"].to_pylist(), [1] * m.num_rows, strict=False))
    seen: dict[str, str] = {}
    for path in sorted((root / "dc-a" / "queries").rglob("*")):
        if not path.is_file():
            continue
        name = str(path.relative_to(root / "dc-a" / "queries"))
        for line in path.read_bytes().splitlines():
            try:
                q = json.loads(line)["query_id"]
            except (ValueError, KeyError, TypeError):
                continue
            if q in must and q in seen and seen[q] != name:
                return q, seen[q], name
            seen.setdefault(q, name)
    raise AssertionError("no duplicated query line across two files")


@pytest.mark.parametrize("late_file", [0, 1])
def test_own_replica_had_the_duplicated_query_in_time(logs: Path, tmp_path: Path, late_file: int) -> None:  # noqa: F811
    qid, f1, f2 = _dup_query(logs)
    copy = tmp_path / "logs"
    copy.mkdir()
    for folder in logs.iterdir():
        if folder.name != "_manifest":
            (copy / folder.name).symlink_to(folder)
    shutil.copytree(logs / "_manifest", copy / "_manifest")
    late = (f1, f2)[late_file]
    for part in sorted((copy / "_manifest" / "files.parquet").glob("*.parquet")):
        t = pq.read_table(part)
        rows = t.to_pylist()
        for r in rows:
            if r["dc"] == "dc-a" and r["kind"] == "queries" and r["name"] == late:
                r["arrival_us"] += 3_600_000_000
        pq.write_table(pa.Table.from_pylist(rows, schema=t.schema), part)
    m = pq.read_table(logs / "_manifest" / "clicks.parquet")
    files = pq.read_table(logs / "_manifest" / "files.parquet").to_pylist()
    gone = set(m.filter(pc.and_(pc.equal(m["query_id"], qid), pc.equal(m["expect"], "join")))["click_id"].to_pylist())
    join = pc.and_(
        pc.is_in(m["expect"], value_set=pa.array(["join", "either"])),
        pc.invert(pc.is_in(m["click_id"], value_set=pa.array(sorted(gone), pa.string()))),
    )
    out = tmp_path / "out"
    pipeline_output(out, "dc-a", m.filter(join), m.filter(pc.invert(join)), files)
    r = audit(out, manifest=copy / "_manifest", ran=["dc-a"])
    # dc-a's replica had the query in time in the other file: dc-a's loss, never pending.
    assert r.lost == len(gone) and not r.ok, (r.lost, r.still_joinable, late_file, f1, f2)
