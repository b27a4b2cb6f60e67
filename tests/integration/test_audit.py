"""The auditor passes a correct output and catches every planted fault, from the manifest and from the raw logs."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from rich.console import Console
from typer.testing import CliRunner

from photon.cli import app
from photon.tools.audit import audit, input_from_logs, print_audit
from photon.tools.generator import GeneratorSettings, generate
from tests.integration.audit_fixtures import perfect_output, rewrite

START = 1_763_700_000_000_000


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("logs")
    s = GeneratorSettings(
        events_per_s=2_000, malformed_fraction=0.01, lost_query_fraction=0.05, duplicate_fraction=0.02
    )
    generate(s, root, start_us=START, end_us=START + 20 * 1_000_000)
    return root


@pytest.fixture(scope="module")
def perfect(logs: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("perfect")
    perfect_output(logs, out)
    return out


@pytest.fixture
def out(perfect: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "out"
    shutil.copytree(perfect, copy)
    return copy


def run(out: Path, logs: Path) -> Any:
    return audit(out, manifest=logs / "_manifest")


def test_a_correct_output_passes(out: Path, logs: Path) -> None:
    r = run(out, logs)
    assert r.ok, r.failures()
    assert r.duplicate_clicks == r.lost == r.unexpected == r.wrong_query == 0
    assert r.outcomes["none"] == 0 and r.outcomes["joined"] + r.outcomes["unjoinable"] == r.input_clicks
    assert r.quarantine["expected"] == r.quarantine["found"] > 0
    assert set(r.shares) == {"dc-a", "dc-b"} and abs(r.shares["dc-a"]["share"] - 0.5) < 0.01
    assert r.latency_s["p50"] == r.latency_s["max"] == 2.0
    # Each unjoinable click once, as the outcomes count it; both pipelines gave it up, so twice the records.
    assert r.unjoinable_by_reason == {"query not found within the maximum join delay": r.outcomes["unjoinable"]} != {}
    assert r.unjoinable_records == 2 * r.outcomes["unjoinable"]


def test_duplicate_across_pipelines_fails(out: Path, logs: Path) -> None:
    row = pq.read_table(out / "dc-a" / "joined" / "part-0.parquet").slice(0, 1)
    rewrite(out / "dc-b" / "joined" / "part-0.parquet", lambda t: pa.concat_tables([t, row]))
    r = run(out, logs)
    assert r.duplicate_clicks == 1 and r.duplicate_extra_rows == 1
    assert r.samples["duplicates"] == [row["click_id"][0].as_py()]
    assert not r.ok and "joined more than once" in r.failures()[0]


def test_lost_click_fails(out: Path, logs: Path) -> None:
    path = out / "dc-a" / "joined" / "part-0.parquet"
    gone = pq.read_table(path)["click_id"][3].as_py()
    rewrite(path, lambda t: t.filter(pc.not_equal(t["click_id"], gone)))
    r = run(out, logs)
    assert r.lost == 1 and r.lost_by_expectation == {"join": 1} and r.samples["lost"] == [gone]
    assert not r.ok
    # The person's line names what the lost clicks had to be, in words: it printed "lost 1 {np.str_('join'): 1}".
    console = Console(record=True, width=200)
    print_audit(r, console)
    assert "; lost 1 (must join 1); unexpected 0;" in console.export_text()


def test_a_must_join_click_given_up_is_lost(out: Path, logs: Path) -> None:
    path = out / "dc-a" / "joined" / "part-0.parquet"
    t = pq.read_table(path)
    gone = t.slice(0, 1)
    rewrite(path, lambda t: t.slice(1))
    rewrite(
        out / "dc-a" / "unjoinable" / "part-0.parquet",
        lambda u: pa.concat_tables(
            [
                u,
                pa.table(
                    {
                        "click_id": gone["click_id"],
                        "query_id": gone["query_id"],
                        "ad_id": gone["ad_id"],
                        "click_ts_us": gone["click_ts_us"],
                        "decided_at_us": gone["click_ts_us"],
                        "pipeline": ["dc-a"],
                        "reason": ["gave up"],
                    },
                    schema=u.schema,
                ),
            ]
        ),
    )
    r = run(out, logs)
    assert r.lost == 1 and r.outcomes["unjoinable"] > 0


def test_unexpected_click_fails(out: Path, logs: Path) -> None:
    path = out / "dc-b" / "joined" / "part-0.parquet"
    t = pq.read_table(path)
    fake = t.slice(0, 1).set_column(0, "click_id", pa.array(["10.66.66.66-1-1763700000000001"]))
    rewrite(path, lambda t: pa.concat_tables([t, fake]))
    r = run(out, logs)
    assert r.unexpected == 1 and r.samples["unexpected"] == ["10.66.66.66-1-1763700000000001"] and not r.ok


def test_click_joined_to_another_query_fails(out: Path, logs: Path) -> None:
    path = out / "dc-a" / "joined" / "part-0.parquet"

    def swap(t: pa.Table) -> pa.Table:
        q = t["query_id"].to_pylist()
        q[0], q[1] = q[1], q[0]
        return t.set_column(1, "query_id", pa.array(q))

    rewrite(path, swap)
    r = run(out, logs)
    assert r.wrong_query == 2 and not r.ok


def test_missing_quarantine_record_fails(out: Path, logs: Path) -> None:
    path = out / "dc-b" / "quarantine" / "part-0.parquet"
    dropped = pq.read_table(path).slice(0, 1).to_pylist()[0]
    rewrite(path, lambda t: t.slice(1))
    r = run(out, logs)
    assert r.quarantine["missing"] == 1 and r.quarantine["extra"] == 0 and not r.ok
    assert r.quarantine["files_mismatched"][0].startswith(f"dc-b/{dropped['kind']}/{dropped['file']}")


def test_in_progress_output_files_are_not_read(out: Path, logs: Path) -> None:
    row = pq.read_table(out / "dc-a" / "joined" / "part-0.parquet").slice(0, 1)
    pq.write_table(row, out / "dc-b" / "joined" / "_part-1.parquet.tmp")
    assert run(out, logs).ok


def test_cli_exit_status_and_json(out: Path, logs: Path) -> None:
    runner = CliRunner()
    good = runner.invoke(app, ["audit", "--out", str(out), "--logs", str(logs)])
    assert good.exit_code == 0, good.output
    assert "PASS" in good.output and "dc-a" in good.output and "p90" in good.output
    # The printed unjoinable count and its reason table count the same clicks (was: 62 beside a table of 124).
    n = run(out, logs).outcomes["unjoinable"]
    assert f"unjoinable {n:,}, none 0" in good.output
    assert f"the {n:,} unjoinable clicks by reason: {n:,} query not found within the maximum join delay" in good.output
    assert f"({2 * n:,} records in the unjoinable/ folders" in good.output
    row = pq.read_table(out / "dc-a" / "joined" / "part-0.parquet").slice(0, 1)
    rewrite(out / "dc-b" / "joined" / "part-0.parquet", lambda t: pa.concat_tables([t, row]))
    bad = runner.invoke(app, ["audit", "--out", str(out), "--logs", str(logs), "--json"])
    assert bad.exit_code == 1
    report = json.loads(bad.output)
    assert report["ok"] is False and report["duplicate_clicks"] == 1


def test_logs_mode_reads_the_same_truth_as_the_manifest(logs: Path, out: Path, spark: Any) -> None:
    clicks, files = input_from_logs(logs, spark)
    manifest = pq.read_table(logs / "_manifest" / "clicks.parquet")
    assert set(clicks["click_id"].to_pylist()) == set(manifest["click_id"].to_pylist())
    expected = {
        (r["dc"], r["kind"], r["name"]): r["malformed"]
        for r in pq.read_table(logs / "_manifest" / "files.parquet").to_pylist()
        if r["malformed"]
    }
    found = {(r["dc"], r["kind"], r["name"]): r["malformed"] for r in files.to_pylist()}
    assert found == expected
    r = audit(out, logs=logs, spark=spark)
    assert r.ok and r.source == "logs", r.failures()
    row = pq.read_table(out / "dc-a" / "joined" / "part-0.parquet").slice(0, 1)
    rewrite(out / "dc-b" / "joined" / "part-0.parquet", lambda t: pa.concat_tables([t, row]))
    assert audit(out, logs=logs, spark=spark).duplicate_clicks == 1


def test_empty_output_loses_everything(tmp_path: Path, logs: Path) -> None:
    (tmp_path / "dc-a").mkdir()
    r = run(tmp_path, logs)
    assert r.lost == r.input_clicks > 0 and r.outcomes["none"] == r.input_clicks
    assert r.quarantine["missing"] == r.quarantine["expected"] > 0


MakeDb = Callable[[], str]
