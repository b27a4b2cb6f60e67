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
from typer.testing import CliRunner

from photon.cli import app
from photon.joiner.common import batch_tag
from photon.joiner.state import PipelineState
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
    result = CliRunner().invoke(app, ["status", "--logs", str(logs), "--out", str(out), "--json"])
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
    result = CliRunner().invoke(app, ["status", "--logs", str(logs), "--out", str(out)], env={"COLUMNS": "80"})
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
    wide = CliRunner().invoke(app, ["status", "--wide", "--logs", str(logs)], env={"COLUMNS": "80"})
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
    record = json.loads(CliRunner().invoke(app, ["status", "--out", str(out), "--json"]).output)[0]
    assert (record["last_batch"], record["retries"], record["state"]) == (0, {"waiting": 0, "due": 0}, "finished")
    for wide, columns in (([], "80"), (["--wide"], "200")):
        text = CliRunner().invoke(app, ["status", "--out", str(out), *wide], env={"COLUMNS": columns}).output
        assert "none yet" in text and "?" not in text and "0 waiting" in text, text


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
