"""`photon status` and `photon report` on a registry holding a live pipeline and a backfill, read as a read-only
login (the verifier's), never as the owner."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable
from typer.testing import CliRunner

from photon.cli import app
from photon.joiner.common import batch_tag
from photon.joiner.state import PipelineState
from photon.logs.layout import partition_of
from photon.logs.schemas import JOINED_SCHEMA, UNJOINABLE_SCHEMA
from photon.logs.tables import append_rows, ensure_tables
from photon.registry.admin import init_registry

pytestmark = pytest.mark.integration
US = 1_000_000
METRIC_COLUMNS = [
    "query_files",
    "click_files",
    "queries",
    "clicks",
    "retries_in",
    "prefiltered",
    "joined",
    "won_again",
    "wasted",
    "retried",
    "unjoinable",
    "quarantined",
    "cache_hits",
    "cache_lookups",
    "registry_txns",
    "registry_rows",
    "registry_retries",
]


def metrics(clicks: int, joined: int, wasted: int, latency_s: float) -> dict[str, float]:
    m: dict[str, float] = dict.fromkeys(METRIC_COLUMNS, 0)
    m |= {"clicks": clicks, "joined": joined, "wasted": wasted, "registry_txns": 2, "registry_rows": clicks}
    return m | {
        "started_at_us": int(time.time() * US),
        "duration_s": 1.5,
        "latency_p50_s": latency_s,
        "latency_p90_s": latency_s * 2,
        "latency_p99_s": latency_s * 3,
    }


@pytest.fixture
def registry(
    make_db: Callable[[], str], login_as: Callable[[str, str], str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Path, Path]:
    """dc-a: two batches (the second left 3 clicks waiting, 1 due) and one older closed click file not consumed yet;
    backfill-dc-a-202611200000: one batch with hours of latency, its run over (lease released). The CLI reads as the
    verifier's login."""
    dsn = make_db()
    init_registry({"main": dsn}, num_shards=1)
    joiner = login_as(dsn, "photon_joiner")
    logs, out = tmp_path / "logs", tmp_path / "out"
    clicks = logs / "dc-a" / "clicks"
    clicks.mkdir(parents=True)
    (logs / "dc-a" / "queries").mkdir()
    for name, age_s in (("c-1.jsonl", 900), ("c-2.jsonl", 800), ("c-3.jsonl", 600), ("c-4.jsonl.inprogress", 999)):
        (clicks / name).write_text("")
        os.utime(clicks / name, (time.time() - age_s, time.time() - age_s))
    live = PipelineState(joiner, "dc-a")
    lease = live.start_lease()
    live.commit(lease, 1, [("clicks", "c-1.jsonl")], metrics(100, 90, 5, 2.0))
    live.commit(lease, 2, [("clicks", "c-3.jsonl")], metrics(100, 95, 0, 4.0))
    retries = out / "dc-a" / "_state" / "retries" / batch_tag(2, lease.epoch)
    retries.mkdir(parents=True)
    now = int(time.time() * US)
    pq.write_table(pa.table({"due_us": [now - US, now + 60 * US, now + 120 * US]}), retries / "part-0.parquet")
    other = PipelineState(joiner, "dc-b")  # two leases: one hand-over, 3.5 s without a batch
    first = other.start_lease()
    other.commit(first, 1, [("clicks", "d-1.jsonl")], metrics(10, 10, 0, 1.0) | {"started_at_us": now - 10 * US})
    other.commit(
        other.start_lease(), 2, [("clicks", "d-2.jsonl")], metrics(10, 10, 0, 1.0) | {"started_at_us": now - 5 * US}
    )
    back = PipelineState(joiner, "backfill-dc-a-202611200000")
    bl = back.start_lease()
    back.commit(bl, 1, [("clicks", "c-1.jsonl")], metrics(50, 50, 45, 160_000.0))
    back.release(bl)
    monkeypatch.setenv("PHOTON_REGISTRY_DSN", login_as(dsn, "photon_verifier"))
    monkeypatch.setenv("PHOTON_HOME", str(tmp_path / "home"))
    return logs, out


def test_status_reports_each_pipeline_as_json_and_as_a_table(registry: tuple[Path, Path]) -> None:
    logs, out = registry
    result = CliRunner().invoke(app, ["status", "--logs", str(logs), "--out", str(out), "--json", "--all"])
    assert result.exit_code == 0, result.output
    records = {r["pipeline"]: r for r in json.loads(result.output)}
    assert list(records) == ["dc-a", "dc-b", "backfill-dc-a-202611200000"]  # live first
    assert records["dc-b"]["recent"]["handover_gaps_s"] == [3.5] and records["dc-a"]["recent"]["handover_gaps_s"] == []
    a = records["dc-a"]
    assert a["kind"] == "live" and a["dc"] == "dc-a" and a["last_batch"] == 2
    assert 0 <= a["last_batch_age_s"] < 60 and 0 <= a["heartbeat_age_s"] < 60 and a["lease_holder"]
    # The oldest closed file not consumed: c-2 (c-1 and c-3 consumed; an .inprogress file is not closed).
    assert a["lag"]["clicks"]["file"] == "c-2.jsonl" and 790 < a["lag"]["clicks"]["waiting_s"] < 900
    assert a["lag"]["queries"] is None
    assert a["retries"] == {"waiting": 3, "due": 1}
    assert a["recent"]["batches"] == 2 and a["recent"]["joined"] == 185 and a["recent"]["wasted_share"] == 0.025
    assert a["recent"]["latency_p99_s"] == 12.0
    b = records["backfill-dc-a-202611200000"]
    assert b["kind"] == "backfill" and b["dc"] == "dc-a" and b["recent"]["wasted_share"] == 0.9
    assert b["retries"] == {"waiting": 0, "due": 0}
    assert (a["state"], records["dc-b"]["state"], b["state"]) == ("running", "running", "finished")
    assert b["lag"] is None  # the files outside its window (c-2) are not its lag

    table = CliRunner().invoke(app, ["status", "--logs", str(logs), "--out", str(out)], env={"COLUMNS": "200"})
    assert table.exit_code == 0, table.output
    assert "c-2" not in table.output and "clicks: oldest waiting" in table.output and "3 waiting" in table.output
    only = CliRunner().invoke(app, ["status", "--pipeline", "dc-a", "--json"])
    assert [r["pipeline"] for r in json.loads(only.output)] == ["dc-a"]
    assert json.loads(only.output)[0]["lag"] is None  # no --logs and no $PHOTON_HOME/logs: lag unknown, not zero


def test_status_at_80_columns_shows_names_whole_and_a_finished_backfill_as_finished(
    registry: tuple[Path, Path],
) -> None:
    """Was a seven-column table whose cells cut the backfill's name to `backfil…`, six lines to a row, and a finished
    backfill shown as waiting for the data center's newest file (`clicks: oldest waiting 852 s`)."""
    logs, out = registry
    result = CliRunner().invoke(app, ["status", "--logs", str(logs), "--out", str(out), "--all"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert max(len(line) for line in lines) <= 80, result.output
    assert [line for line in lines if line != line.rstrip()] == []  # no block padded to its widest line
    blocks = {b.splitlines()[0].split()[0]: b for b in result.output.split("\n\n")[1:]}
    assert list(blocks) == ["dc-a", "dc-b", "backfill-dc-a-202611200000"], result.output
    assert blocks["backfill-dc-a-202611200000"].splitlines()[0].endswith("backfill, dc-a, finished")
    assert "waiting" not in blocks["backfill-dc-a-202611200000"].replace("0 waiting", ""), result.output
    assert "lag clicks: oldest waiting" in " ".join(blocks["dc-a"].split())
    assert blocks["dc-a"].splitlines()[0].endswith("live, dc-a, running")
    wide = CliRunner().invoke(app, ["status", "--wide", "--all", "--logs", str(logs)], env={"COLUMNS": "80"})
    assert wide.exit_code == 0 and "backfill-dc-a-202611200000" in wide.output, wide.output


def test_status_of_a_backfill_that_committed_no_batch_says_so(
    make_db: Callable[[], str], login_as: Callable[[str, str], str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A newcomer's pass: a backfill hour that found nothing to join showed `last batch 0, -` and `retries ?` (the
    `?` the README explains only for a status without logs). It has no batch and no retry set: it says none."""
    dsn = make_db()
    init_registry({"main": dsn}, num_shards=1)
    back = PipelineState(login_as(dsn, "photon_joiner"), "backfill-dc-b-202611200000")
    back.release(back.start_lease())
    monkeypatch.setenv("PHOTON_REGISTRY_DSN", login_as(dsn, "photon_verifier"))
    monkeypatch.setenv("PHOTON_HOME", str(tmp_path / "home"))
    out = tmp_path / "out"
    out.mkdir()
    record = json.loads(CliRunner().invoke(app, ["status", "--out", str(out), "--json", "--all"]).output)[0]
    assert (record["last_batch"], record["retries"], record["state"]) == (0, {"waiting": 0, "due": 0}, "finished")
    for wide, columns in (([], "80"), (["--wide"], "200")):
        text = CliRunner().invoke(app, ["status", "--out", str(out), "--all", *wide], env={"COLUMNS": columns}).output
        assert "none yet" in text and "?" not in text and "0 waiting" in text, text


def test_status_shows_finished_backfills_only_when_asked(registry: tuple[Path, Path]) -> None:
    """It listed every finished backfill, empty ones too (a day of hourly backfills: 24 blocks before any news of the
    live pipelines). Now the live pipelines and running backfills; --all or --pipeline for the rest."""
    logs, out = registry
    runner = CliRunner()
    plain = runner.invoke(app, ["status", "--logs", str(logs), "--out", str(out)], env={"COLUMNS": "200"})
    assert plain.exit_code == 0, plain.output
    assert "backfill-dc-a-202611200000" not in plain.output and "dc-b" in plain.output
    assert plain.output.rstrip().endswith("(1 finished backfill not shown: --all shows them)"), plain.output
    records = json.loads(runner.invoke(app, ["status", "--out", str(out), "--json"]).output)
    assert [r["pipeline"] for r in records] == ["dc-a", "dc-b"]
    named = runner.invoke(app, ["status", "--pipeline", "backfill-dc-a-202611200000", "--json"])
    assert [r["state"] for r in json.loads(named.output)] == ["finished"]


def test_status_wide_into_a_pipe_is_one_tab_separated_line_per_pipeline(registry: tuple[Path, Path]) -> None:
    """`status --wide | less` was a box-drawn table folded at 80 columns, each row over several lines."""
    logs, out = registry
    result = CliRunner().invoke(
        app, ["status", "--wide", "--all", "--logs", str(logs), "--out", str(out)], env={"COLUMNS": "80"}
    )
    assert result.exit_code == 0, result.output
    rows = [line.split("\t") for line in result.output.splitlines()]
    assert rows[0][:4] == ["pipeline", "kind", "dc", "state"] and {len(r) for r in rows} == {10}, result.output
    by_name = {r[0]: r for r in rows[1:]}
    assert list(by_name) == ["dc-a", "dc-b", "backfill-dc-a-202611200000"]
    assert by_name["dc-a"][1:4] == ["live", "dc-a", "running"] and by_name["dc-a"][7] == "3 waiting, 1 due"
    assert by_name["backfill-dc-a-202611200000"][3] == "finished"
    assert not any(c in result.output for c in "┃│━─┏"), result.output


def test_idle_time_between_leases_is_not_a_handover_gap(
    make_db: Callable[[], str], login_as: Callable[[str, str], str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A quiet data center: dc-a's lease ended 15 minutes ago and the next, started since, joined its first batch
    when a file came; status called the 15 minutes a hand-over gap (an 851.8 s one in a newcomer's trial). dc-b hands
    over with input waiting: the gap is how long its first file waited (from its arrival, 5 s before the next lease's
    first batch, not from the last lease's end, 8.5 s)."""
    dsn = make_db()
    init_registry({"main": dsn}, num_shards=1)
    joiner = login_as(dsn, "photon_joiner")
    logs = tmp_path / "logs"
    now = int(time.time() * US)

    def arrived(dc: str, name: str, at_us: int) -> tuple[str, str]:
        path = logs / dc / "clicks" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
        os.utime(path, (at_us / US, at_us / US))
        return ("clicks", name)

    for dc, old, new, new_at in (
        ("dc-a", now - 900 * US, now + 3 * US, now + 2 * US),
        ("dc-b", now - 10 * US, now, now - 5 * US),
    ):
        state = PipelineState(joiner, dc)
        first = state.start_lease()
        files = [arrived(dc, f"{partition_of(old)}/{dc}-1.jsonl", old - US)]
        state.commit(first, 1, files, metrics(10, 10, 0, 1.0) | {"started_at_us": old})
        state.release(first)
        second = state.start_lease()  # the lease running now, started before dc-a's file came
        files = [arrived(dc, f"{partition_of(new_at)}/{dc}-2.jsonl", new_at)]
        state.commit(second, 2, files, metrics(10, 10, 0, 1.0) | {"started_at_us": new})
    monkeypatch.setenv("PHOTON_REGISTRY_DSN", login_as(dsn, "photon_verifier"))
    result = CliRunner().invoke(app, ["status", "--logs", str(logs), "--json"])
    assert result.exit_code == 0, result.output
    gaps = {r["pipeline"]: r["recent"]["handover_gaps_s"] for r in json.loads(result.output)}
    assert gaps == {"dc-a": [], "dc-b": [5.0]}


def test_status_names_an_unknown_pipeline_and_a_missing_folder(registry: tuple[Path, Path], tmp_path: Path) -> None:
    unknown = CliRunner().invoke(app, ["status", "--pipeline", "dc-z"])
    assert unknown.exit_code != 0 and "no pipeline named dc-z" in str(unknown.exception)
    missing = CliRunner().invoke(app, ["status", "--logs", str(tmp_path / "nope")])
    assert missing.exit_code != 0 and "no such folder" in str(missing.exception)


def test_report_draws_live_pipelines_by_default_and_skips_charts_without_data(
    registry: tuple[Path, Path], tmp_path: Path
) -> None:
    """Was: every pipeline ever run on one chart (a backfill's 45-hour latency flattening the live ones), empty axes
    before any GC, and a report/ folder written into the clone."""
    result = CliRunner().invoke(app, ["report"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    home = tmp_path / "home" / "report"
    assert "pipelines: dc-a, dc-b" in result.output and "backfill" not in result.output.split("\n")[0]
    assert "dc-b: 2 batches, 20 joined, wasted 0.0% of 20 clicks; 1 hand-over(s), gaps max 3.5 s" in result.output
    assert sorted(p.name for p in home.iterdir()) == ["latency.png", "registry_batching.png", "shares.png"]
    assert "latency.png (linear axis)" in result.output  # the live pipelines' 1-12 s
    assert "not drawn: shard_sizes.png" in result.output
    chosen = CliRunner().invoke(
        app, ["report", "--pipeline", "backfill-dc-a-202611200000", "--to", str(tmp_path / "b")]
    )
    assert chosen.exit_code == 0 and "pipelines: backfill-dc-a-202611200000" in chosen.output
    # One pipeline days behind beside seconds-fast ones: a linear axis would flatten them all against zero.
    both = CliRunner().invoke(
        app, ["report", "--pipeline", "dc-a", "--pipeline", "backfill-dc-a-202611200000", "--to", str(tmp_path / "c")]
    )
    assert both.exit_code == 0, both.output
    assert "latency.png (log axis: 3 of 9 latencies far above the rest, up to 5.6 days)" in both.output
    # Nothing in the range: no chart at all, and an older run's charts in the same folder are removed.
    empty = CliRunner().invoke(app, ["report", "--since", "2099-01-01T00:00:00Z"])
    assert empty.exit_code == 0 and "none with batches in the range" in empty.output
    assert list(home.iterdir()) == []
    bad = CliRunner().invoke(app, ["report", "--since", "yesterday"])
    assert bad.exit_code != 0 and "ISO-8601" in str(bad.exception)


def _rows(schema: pa.Schema, n: int, ts_us: int) -> pa.Table:
    return pa.table(
        {
            f.name: pa.array([f"10.0.0.1-1-{i}" for i in range(n)])
            if f.type == pa.string()
            else pa.array([ts_us + i for i in range(n)], f.type)
            for f in schema
        },
        schema=schema,
    )


def test_status_shows_each_output_tables_version_published_batch_and_size(registry: tuple[Path, Path]) -> None:
    """After N batches published the joiner's way (data files, then one commit per table under the batch's txn),
    status's figures are the table's own: its version, its txn version, the files and bytes of its snapshot, its
    last commit; a crashed batch's file on disk is not among them."""
    logs, out = registry
    hour, next_hour = 1_764_300_000_000_000, 1_764_300_000_000_000 + 3_600 * US  # 2025-11-28 03:20 and 04:20 UTC
    batches = 4
    for batch in range(1, batches + 1):
        # Every batch joins clicks of two hours (two files), every second one gives up on one click too.
        rows = pa.concat_tables([_rows(JOINED_SCHEMA, 2 + batch, hour), _rows(JOINED_SCHEMA, 1, next_hour)])
        append_rows(out / "dc-a", "joined", rows, batch)
        if batch % 2 == 0:
            append_rows(out / "dc-a", "unjoinable", _rows(UNJOINABLE_SCHEMA, 1, hour), batch)
    ensure_tables(out / "dc-a")
    # A crashed batch's data file: on disk, named by no commit.
    crashed = out / "dc-a" / "joined" / "hour=2025112803" / "b0000000005-e1-p0000-2025112803.parquet"
    pq.write_table(_rows(JOINED_SCHEMA, 5, hour), crashed)
    result = CliRunner().invoke(app, ["status", "--logs", str(logs), "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    found = {r["pipeline"]: r for r in json.loads(result.output)}["dc-a"]["tables"]
    assert list(found) == ["joined", "unjoinable", "quarantine"]
    for kind, version, published, files in (
        ("joined", batches, batches, 2 * batches),  # created by the first publish, then one commit per batch
        ("unjoinable", batches // 2, batches, batches // 2),
        ("quarantine", 0, None, 0),  # created empty, never committed to
    ):
        table = DeltaTable(str(out / "dc-a" / kind))
        got = found[kind]
        assert got["version"] == table.version() == version, (kind, got)
        assert got["published_batch"] == table.transaction_version("photon/dc-a") == published, (kind, got)
        uris = table.file_uris()
        assert got["files"] == len(uris) == files, (kind, got)
        assert got["bytes"] == sum(Path(u.removeprefix("file://")).stat().st_size for u in uris), (kind, got)
        assert got["last_commit_at_us"] == table.history(1)[0]["timestamp"] * 1000 and got["last_commit_age_s"] >= 0
    assert found["joined"]["files_on_disk"] == 2 * batches + 1 and found["unjoinable"]["files_on_disk"] == 2
    text = CliRunner().invoke(app, ["status", "--logs", str(logs), "--out", str(out)], env={"COLUMNS": "80"})
    assert text.exit_code == 0 and max(len(line) for line in text.output.splitlines()) <= 80, text.output
    flat = " ".join(text.output.split())
    assert "joined v4, batch 4, 8 files" in flat and "(1 more on disk)" in flat, text.output
    assert "unjoinable v2, batch 4, 2 files" in flat and "quarantine v0, batch -, 0 files" in flat, text.output
    assert "last commit: joined " in flat and " ago" in flat, text.output
    wide = CliRunner().invoke(app, ["status", "--wide", "--logs", str(logs), "--out", str(out)])
    rows = {r[0]: r for r in (line.split("\t") for line in wide.output.splitlines())}
    assert rows["pipeline"][-1] == "tables" and rows["dc-a"][-1].startswith("joined v4, batch 4, 8 files"), wide.output
    assert rows["dc-b"][-1] == "none yet", wide.output  # no table of its own under --out
