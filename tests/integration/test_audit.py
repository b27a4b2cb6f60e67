"""The auditor passes a correct output and catches every planted fault, from the manifest and from the raw logs."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable
from rich.console import Console
from typer.testing import CliRunner

from photon.cli import app
from photon.joiner.common import JoinSettings
from photon.joiner.lease import Joiner
from photon.logs.schemas import UNJOINABLE_SCHEMA
from photon.logs.tables import OutputTableError
from photon.storage import open_store
from photon.tools.audit import audit, input_from_logs, print_audit
from photon.tools.generator import GeneratorSettings, generate
from tests.integration.audit_fixtures import late_in_one_replica, perfect_output, pipeline_output, read, rewrite
from tests.integration.helpers import to_bucket
from tests.integration.test_joiner import make_logs
from tests.nemesis import checker

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
    row = read(out / "dc-a" / "joined" / "part-0.parquet").slice(0, 1)
    rewrite(out / "dc-b" / "joined" / "part-0.parquet", lambda t: pa.concat_tables([t, row]))
    r = run(out, logs)
    assert r.duplicate_clicks == 1 and r.duplicate_extra_rows == 1
    assert r.samples["duplicates"] == [row["click_id"][0].as_py()]
    assert not r.ok and "joined more than once" in r.failures()[0]


def test_lost_click_fails(out: Path, logs: Path) -> None:
    path = out / "dc-a" / "joined" / "part-0.parquet"
    gone = read(path)["click_id"][3].as_py()
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
    t = read(path)
    gone = t.slice(0, 1)
    rewrite(path, lambda t: t.slice(1))
    rewrite(
        out / "dc-a" / "unjoinable" / "part-0.parquet",
        lambda u: pa.concat_tables(
            [
                u.select(UNJOINABLE_SCHEMA.names),
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
                    schema=UNJOINABLE_SCHEMA,
                ),
            ]
        ),
    )
    r = run(out, logs)
    assert r.lost == 1 and r.outcomes["unjoinable"] > 0


def test_unexpected_click_fails(out: Path, logs: Path) -> None:
    path = out / "dc-b" / "joined" / "part-0.parquet"
    t = read(path)
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
    dropped = read(path).slice(0, 1).to_pylist()[0]
    rewrite(path, lambda t: t.slice(1))
    r = run(out, logs)
    assert r.quarantine["missing"] == 1 and r.quarantine["extra"] == 0 and not r.ok
    assert r.quarantine["files_mismatched"][0].startswith(f"dc-b/{dropped['kind']}/{dropped['file']}")


def test_data_files_no_commit_names_are_not_read(out: Path, logs: Path) -> None:
    """A crashed batch leaves whole data files in the table's folder, named as any other, and an interrupted write a
    temporary one: the auditor reads the tables' commits, so neither counts (a reader of the folder's Parquet files
    would count every such click twice)."""
    row = read(out / "dc-a" / "joined" / "part-0.parquet").slice(0, 1)
    hour = row["hour"][0].as_py()
    pq.write_table(
        row.drop_columns(["hour"]), out / "dc-b" / "joined" / f"hour={hour}" / f"b0000000099-e1-p0000-{hour}.parquet"
    )
    pq.write_table(row, out / "dc-b" / "joined" / "_part-1.parquet.tmp")
    globbed = ds.dataset(sorted(out.glob("*/joined/hour=*/*.parquet")), format="parquet").to_table(columns=["click_id"])
    assert pc.count_distinct(globbed["click_id"]).as_py() < globbed.num_rows  # the folders do hold a duplicate
    assert run(out, logs).ok


def test_a_real_joins_table_with_a_crashed_batchs_data_file_audits_without_duplicates(
    tmp_path: Path, servers: dict[str, str], spark: Any
) -> None:
    """Issue 34: data files no commit names are never counted. Two pipelines join for real; then a committed data
    file of dc-a's joined table is copied, whole and valid, under a name of a batch that crashed before its registry
    commit, into its hour's folder (where that batch's task would have left it). A reader of the folder's Parquet
    files sees every click of that file twice; the auditor and the nemesis checker read the table and see none."""
    logs = make_logs(tmp_path / "logs", seconds=6, malformed_fraction=0.0, duplicate_fraction=0.0)
    out, settings = tmp_path / "out", JoinSettings(trigger_interval_s=0.2)
    for dc in ("dc-a", "dc-b"):
        Joiner(dc, logs, out, servers, spark, settings).run(until_caught_up=True, drain=True)
    before = audit(out, manifest=logs / "_manifest")
    assert before.ok and before.duplicate_clicks == 0 and before.joined_rows > 0, before.failures()

    table = out / "dc-a" / "joined"
    committed = Path(unquote(urlparse(DeltaTable(str(table)).file_uris()[0]).path))
    hour = committed.parent.name.removeprefix("hour=")
    crashed = committed.with_name(f"b0000009999-e1-p0000-{hour}.parquet")
    shutil.copyfile(committed, crashed)
    copied = pq.read_metadata(crashed).num_rows
    assert copied > 0 and crashed.parent.name == f"hour={hour}"

    globbed = pq.read_table(table, columns=["click_id"])  # the old way: every Parquet file in the folder
    assert globbed.num_rows - pc.count_distinct(globbed["click_id"]).as_py() == copied
    after = audit(out, manifest=logs / "_manifest")
    assert after.ok, after.failures()
    assert after.duplicate_clicks == after.duplicate_extra_rows == 0 and after.joined_rows == before.joined_rows
    assert checker.duplicates(out) == []


def test_an_output_folder_of_plain_parquet_files_is_refused_in_one_line(out: Path, logs: Path) -> None:
    """An older version's layout (Parquet files straight in ``joined/``) is not read as empty, which would call
    every click of that pipeline lost: it is refused, naming the folder."""
    old = out / "dc-c" / "joined"
    old.mkdir(parents=True)
    pq.write_table(read(out / "dc-a" / "joined" / "part-0.parquet").slice(0, 1), old / "part-0.parquet")
    with pytest.raises(OutputTableError, match=f"{old} holds Parquet files but is not a Delta table"):
        run(out, logs)
    bad = CliRunner().invoke(app, ["audit", "--out", str(out), "--logs", str(logs)])
    assert bad.exit_code != 0 and isinstance(bad.exception, OutputTableError)


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
    row = read(out / "dc-a" / "joined" / "part-0.parquet").slice(0, 1)
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
    row = read(out / "dc-a" / "joined" / "part-0.parquet").slice(0, 1)
    rewrite(out / "dc-b" / "joined" / "part-0.parquet", lambda t: pa.concat_tables([t, row]))
    assert audit(out, logs=logs, spark=spark).duplicate_clicks == 1


def test_empty_output_loses_everything(tmp_path: Path, logs: Path) -> None:
    (tmp_path / "dc-a").mkdir()
    r = run(tmp_path, logs)
    assert r.lost == r.input_clicks > 0 and r.outcomes["none"] == r.input_clicks
    assert r.quarantine["missing"] == r.quarantine["expected"] > 0


@pytest.fixture
def dc_a_alone(logs: Path, tmp_path: Path) -> tuple[Path, Path, set[str]]:
    """The README's order, generate, join dc-a only, audit: logs whose manifest says three query files reached dc-a's
    replica an hour late and dc-b's in time, and dc-a's output alone, which gave their must-join clicks up. Returns
    the logs, the output and those clicks."""
    copy, out = tmp_path / "logs", tmp_path / "out"
    late = late_in_one_replica(logs, copy, "dc-a", 3)
    m = pq.read_table(logs / "_manifest" / "clicks.parquet")
    files = pq.read_table(logs / "_manifest" / "files.parquet").to_pylist()
    gave_up = pc.is_in(m["click_id"], value_set=pa.array(sorted(late), pa.string()))
    join = pc.and_(pc.is_in(m["expect"], value_set=pa.array(["join", "either"])), pc.invert(gave_up))
    pipeline_output(out, "dc-a", m.filter(join), m.filter(pc.invert(join)), files)
    return copy, out, late


def test_lost_clicks_another_data_center_could_still_join_are_named(dc_a_alone: tuple[Path, Path, set[str]]) -> None:
    """It printed "FAIL: 430 lost click(s)", which reads as data loss: those clicks' query reached dc-a's replica
    after their deadline and dc-b's before it, and dc-b's pipeline has not run."""
    logs, out, late = dc_a_alone
    n = len(late)
    assert n > 0
    r = audit(out, manifest=logs / "_manifest")
    assert r.lost == r.still_joinable == n and r.joinable_by == {"dc-b": n}
    assert r.data_centers == ["dc-a", "dc-b"] and r.data_centers_run == ["dc-a"] and not r.run_declared
    assert set(r.samples["still_joinable"]) <= late
    # Still a failure: no output holds them, and nothing says dc-b will run.
    assert r.failures() == [
        f"{n} lost click(s): {n} could still be joined by dc-b (its replica had the query in time; no dc-b pipeline "
        "output yet)"
    ]
    # Told that only dc-a ran, they are pending in dc-b, not lost.
    told = audit(out, manifest=logs / "_manifest", ran=["dc-a"])
    assert told.ok and told.lost == 0 and told.still_joinable == n and told.run_declared
    runner = CliRunner()
    cmd = ["audit", "--out", str(out), "--logs", str(logs)]
    failed = runner.invoke(app, cmd)
    assert failed.exit_code == 1 and f"could still be joined by dc-b (dc-b {n}: its replica" in failed.output
    passed = runner.invoke(app, [*cmd, "--dcs", "dc-a"])
    assert passed.exit_code == 0, passed.output
    assert "PASS" in passed.output and f"pending: {n} clicks only dc-b could join" in passed.output


def test_a_click_its_own_replica_had_in_time_stays_lost_when_told_who_ran(
    dc_a_alone: tuple[Path, Path, set[str]],
) -> None:
    """dc-b could join it too, but dc-a had its query in time and did not: dc-a's loss (EVENTS.md: a click whose
    query reached its data center's logs in time must be joined), not pending."""
    logs, out, late = dc_a_alone
    path = out / "dc-a" / "joined" / "part-0.parquet"
    m = pq.read_table(logs / "_manifest" / "clicks.parquet")
    must = set(m.filter(pc.equal(m["expect"], "join"))["click_id"].to_pylist())
    gone = next(c for c in read(path)["click_id"].to_pylist() if c in must)
    rewrite(path, lambda t: t.filter(pc.not_equal(t["click_id"], gone)))
    r = audit(out, manifest=logs / "_manifest", ran=["dc-a"])
    assert r.lost == 1 and r.samples["lost"] == [gone] and r.still_joinable == len(late) and not r.ok


def test_unjoinable_records_of_clicks_another_pipeline_joined_are_counted(
    dc_a_alone: tuple[Path, Path, set[str]],
) -> None:
    """dc-a's unjoinable/ keeps its records of the clicks dc-b then joined: a reader of unjoinable/ alone cannot
    tell them apart, so the audit counts them (a click's outcome is joined if any pipeline joined it)."""
    logs, out, late = dc_a_alone
    m = pq.read_table(logs / "_manifest" / "clicks.parquet")
    files = pq.read_table(logs / "_manifest" / "files.parquet").to_pylist()
    joined_by_b = m.filter(pc.is_in(m["click_id"], value_set=pa.array(sorted(late), pa.string())))
    pipeline_output(out, "dc-b", joined_by_b, m.slice(0, 0), files)
    r = audit(out, manifest=logs / "_manifest")
    assert r.ok, r.failures()
    assert r.unjoinable_records_joined_elsewhere == r.joined_and_unjoinable == len(late)
    assert r.still_joinable == 0 and r.data_centers_run == ["dc-a", "dc-b"]
    console = Console(record=True, width=300)
    print_audit(r, console)
    assert (
        f"; {len(late):,} of them of clicks another pipeline joined: their outcome is joined)" in console.export_text()
    )
    with pytest.raises(ValueError, match="also holds output of dc-b"):
        audit(out, manifest=logs / "_manifest", ran=["dc-a"])


MakeDb = Callable[[], str]


def test_logs_in_a_bucket_are_read_as_the_same_folder_is(logs: Path, out: Path, spark: Any, bucket: str) -> None:
    """Without a manifest the audit reads the logs themselves: from a bucket, the same valid clicks and the same
    malformed lines per file as from the folder; and `photon audit --logs s3://...` with the manifest passes."""
    to_bucket(logs, f"s3://{bucket}/logs")
    clicks, files = input_from_logs(logs, spark)
    remote_clicks, remote_files = input_from_logs(open_store(f"s3://{bucket}/logs"), spark)
    assert sorted(remote_clicks["click_id"].to_pylist()) == sorted(clicks["click_id"].to_pylist())
    assert sorted(remote_files.to_pylist(), key=str) == sorted(files.to_pylist(), key=str) and files.num_rows
    r = audit(out, logs=f"s3://{bucket}/logs", spark=spark)
    assert r.ok and r.source == "logs" and r.input_clicks == clicks.num_rows, r.failures()
    cli = CliRunner().invoke(
        app, ["audit", "--out", str(out), "--logs", f"s3://{bucket}/logs", "--manifest", str(logs / "_manifest")]
    )
    assert cli.exit_code == 0 and "PASS" in cli.output, cli.output
    missing = CliRunner().invoke(app, ["audit", "--out", str(out), "--logs", f"s3://{bucket}-gone/logs"])
    # One line before Spark starts (cli.main prints the StorageError as "error: ...")
    assert missing.exit_code != 0 and f"the bucket '{bucket}-gone' does not exist" in str(missing.exception)


def test_a_manifest_apart_from_logs_in_a_bucket_reads_its_query_files_there(
    dc_a_alone: tuple[Path, Path, set[str]], bucket: str, tmp_path: Path
) -> None:
    """With the logs in a bucket the manifest is a folder of its own (the generator's --manifest): which replica had
    a lost click's query in time is read from the query files in the bucket, not from beside the manifest."""
    logs, out, late = dc_a_alone
    to_bucket(logs, f"s3://{bucket}/logs")
    manifest = shutil.copytree(logs / "_manifest", tmp_path / "manifest-alone")
    r = audit(out, manifest=manifest, logs=f"s3://{bucket}/logs")
    assert r.lost == r.still_joinable == len(late) and r.joinable_by == {"dc-b": len(late)}, r.failures()
    told = audit(out, manifest=manifest, logs=f"s3://{bucket}/logs", ran=["dc-a"])
    assert told.ok and told.still_joinable == len(late)
