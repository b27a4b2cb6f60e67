"""The log generator: deterministic, faithful to its settings, and to EVENTS.md's layout and rules."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from photon.logs.layout import partition_of
from photon.tools.generator import MALFORMED_KINDS, GeneratorSettings, Outage, expectation, generate

START = 1_763_700_000_000_000
US = 1_000_000
NAME = re.compile(r"^\d+\.\d+\.\d+\.\d+-\d+-\d+\.jsonl$")


def read_tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_same_seed_gives_byte_identical_logs_and_manifest(tmp_path: Path) -> None:
    s = GeneratorSettings(events_per_s=3_000, malformed_fraction=0.01, duplicate_fraction=0.02)
    generate(s, tmp_path / "one", start_us=START, end_us=START + 20 * US)
    generate(s, tmp_path / "two", start_us=START, end_us=START + 20 * US)
    one, two = read_tree(tmp_path / "one"), read_tree(tmp_path / "two")
    assert one.keys() == two.keys() and len(one) > 50
    assert all(one[k] == two[k] for k in one)
    generate(GeneratorSettings(events_per_s=3_000, seed=2), tmp_path / "three", start_us=START, end_us=START + 20 * US)
    three = read_tree(tmp_path / "three")
    assert three[next(k for k in sorted(three) if k.startswith("dc-a/clicks/"))] != b""
    assert three.keys() != one.keys() or any(three[k] != one[k] for k in one)


@pytest.fixture(scope="module")
def stats_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[GeneratorSettings, Path, dict]:
    s = GeneratorSettings(
        events_per_s=5_000,
        duplicate_fraction=0.02,
        malformed_fraction=0.01,
        lost_query_fraction=0.05,
        malformed_weights=dict.fromkeys(MALFORMED_KINDS, 1.0) | {"huge": 0.01},
    )
    root = tmp_path_factory.mktemp("gen")
    report = generate(s, root, start_us=START, end_us=START + 120 * US)
    return s, root, {"report": report}


def parse_dc(root: Path, dc: str, kind: str) -> tuple[list[dict], int, int]:
    valid, bad, total = [], 0, 0
    for f in sorted((root / dc / kind).rglob("*.jsonl")):
        for line in f.read_bytes().split(b"\n")[:-1]:
            total += 1
            try:
                obj = json.loads(line.decode("utf-8"))
                key = "click_id" if kind == "clicks" else "query_id"
                assert isinstance(obj, dict) and isinstance(obj["ts_us"], int)
                assert re.match(r"^\d+\.\d+\.\d+\.\d+-\d+-\d+$", obj[key])
                if kind == "clicks":
                    assert re.match(r"^\d+\.\d+\.\d+\.\d+-\d+-\d+$", obj["query_id"]) and isinstance(obj["ad_id"], str)
                else:
                    assert isinstance(obj["ads"], list) and obj["ads"]
                assert len(line) < 1 << 20  # a line of megabytes is malformed
                valid.append(obj)
            except (ValueError, KeyError, AssertionError, TypeError, UnicodeDecodeError):
                bad += 1
    return valid, bad, total


def test_statistics_match_the_settings(stats_run: tuple[GeneratorSettings, Path, dict]) -> None:
    s, root, info = stats_run
    report = info["report"]
    queries, q_bad, q_total = parse_dc(root, "dc-a", "queries")
    clicks, c_bad, c_total = parse_dc(root, "dc-a", "clicks")
    manifest = pq.read_table(root / "_manifest" / "clicks.parquet").to_pandas()
    q_ids = {q["query_id"] for q in queries}
    c_ids = {c["click_id"] for c in clicks}
    # rate: logged queries plus clicks per second, over 120 s (lost queries are not logged)
    events = len(q_ids) / (1 - s.lost_query_fraction) + len(manifest)
    assert events / 120 == pytest.approx(s.events_per_s, rel=0.05)
    # the manifest holds each click once, every click id in the logs, and nothing else
    assert set(manifest["click_id"]) == c_ids and manifest["click_id"].is_unique
    # duplicates: valid lines beyond the first of each id
    dups = (len(queries) - len(q_ids)) + (len(clicks) - len(c_ids))
    assert dups / (len(q_ids) + len(c_ids)) == pytest.approx(s.duplicate_fraction, rel=0.15)
    # malformed lines: fraction of all lines, every kind present, counted per file in the manifest
    assert (q_bad + c_bad) / (q_total + c_total) == pytest.approx(s.malformed_fraction, rel=0.15)
    files = pq.read_table(root / "_manifest" / "files.parquet").to_pandas()
    assert files[files.dc == "dc-a"].malformed.sum() == q_bad + c_bad == report.malformed_lines
    by_kind = json.loads((root / "_manifest" / "manifest.json").read_text())["malformed_by_kind"]
    assert set(by_kind) == set(MALFORMED_KINDS)
    # queries never logged: their clicks are in the logs, their queries are not, and they must be unjoinable
    unlogged = ~manifest["query_id"].isin(q_ids)
    assert unlogged.mean() == pytest.approx(s.lost_query_fraction, rel=0.25)
    assert (manifest.loc[unlogged, "expect"] == "unjoinable").all()
    assert (manifest.loc[~unlogged, "expect"] == "join").all()  # historical: every logged query is there in time


def test_click_delays_and_clocks_follow_the_settings(tmp_path: Path) -> None:
    s = GeneratorSettings(events_per_s=1_500, max_clock_skew_s=0.0, late_click_fraction=0.05, late_click_max_s=600)
    generate(s, tmp_path, start_us=START, end_us=START + 900 * US)
    m = pq.read_table(tmp_path / "_manifest" / "clicks.parquet").to_pandas()
    early = m[m.query_ts_us < START + 200 * US]  # queries early enough that their late clicks fit in the window
    delay = (early.click_ts_us - early.query_ts_us) / US
    assert (delay >= 0).all()
    assert np.median(delay) == pytest.approx(s.click_delay_median_s, rel=0.12)
    assert (delay > 60).mean() == pytest.approx(s.late_click_fraction, rel=0.3)
    assert delay.max() <= 600


def test_contract_rules_hold_with_skewed_clocks(tmp_path: Path) -> None:
    s = GeneratorSettings(events_per_s=4_000, max_clock_skew_s=10.0)
    generate(s, tmp_path, start_us=START, end_us=START + 30 * US)
    m = pq.read_table(tmp_path / "_manifest" / "clicks.parquet").to_pandas()
    assert (m.click_ts_us >= m.query_ts_us - 10 * US).all()  # a click happens after its query, up to the skew
    assert not (m.click_ts_us >= m.query_ts_us).all()  # ... and the skew really shows
    for dc in s.dcs:
        for kind in ("queries", "clicks"):
            names = [p.name for p in (tmp_path / dc / kind).rglob("*") if p.is_file()]
            assert names and all(NAME.match(n) for n in names)  # closed files only, named <ip>-<pid>-<seq>.jsonl
    # a process never logs two events with the same ts_us: ids are unique within each process
    ids = m.click_id.str.rsplit("-", n=1).str[0] + "/" + m.click_ts_us.astype(str)
    assert ids.is_unique
    # every replica holds the same files with the same bytes
    assert read_tree(tmp_path / "dc-a") == read_tree(tmp_path / "dc-b")


def test_expectation_rule() -> None:
    click = np.array([0, 0, 0, 0, 0], dtype=np.int64)
    arrival = np.array([50, 118, 121, 200, 10], dtype=np.int64) * US
    logged = np.array([True, True, True, True, False])
    got = expectation(click, arrival, logged, max_join_delay_s=120, margin_s=5).tolist()
    assert got == ["join", "either", "either", "unjoinable", "unjoinable"]


def test_live_mode_writes_files_as_they_arrive_and_outages_catch_up(tmp_path: Path) -> None:
    import time

    s = GeneratorSettings(
        events_per_s=500,
        rotate_s=1.0,
        chunk_s=1.0,
        query_lag_median_s=0.2,
        click_lag_median_s=0.1,
        late_query_file_fraction=0.0,
        outages=(Outage("dc-b", 1.0, 2.0),),
    )
    start = int(time.time() * US)
    report = generate(s, tmp_path, start_us=start, end_us=start + 4 * US, live=True)
    files = pq.read_table(tmp_path / "_manifest" / "files.parquet").to_pandas()
    outage_begin, outage_end = report.start_us + 1 * US, report.start_us + 3 * US
    b = files[files.dc == "dc-b"]
    assert not ((b.arrival_us >= outage_begin) & (b.arrival_us < outage_end)).any()
    assert (b.arrival_us >= outage_end).sum() > 0
    for row in files.itertuples():
        path = tmp_path / row.dc / row.kind / row.name
        assert path.exists() and path.stat().st_mtime * US >= row.arrival_us - 50_000
    assert not list(tmp_path.rglob("*.inprogress"))
    assert report.seconds >= 4


def test_a_stalled_live_writer_records_when_its_files_really_arrived(tmp_path: Path) -> None:
    """A writer held up (a stalled process, a store down past its retry budget) puts files after their planned
    arrival. The manifest must say when each file was there and put it in that minute's partition: a checker that
    believed the plan demanded joins of clicks whose query in truth arrived after their deadline (nemesis seed
    71212, s3: 20 clicks)."""
    import time

    stalls = iter([2.5])

    def stalling_sleep(s: float) -> None:  # the third second in: the generator stops for 2.5 s once
        if time.time() * US > start + 1.5 * US:
            time.sleep(next(stalls, s))
        else:
            time.sleep(s)

    s = GeneratorSettings(
        events_per_s=400,
        rotate_s=0.5,
        chunk_s=1.0,
        query_lag_median_s=0.2,
        click_lag_median_s=0.1,
        late_query_file_fraction=0.0,
        max_join_delay_s=2.0,
        boundary_margin_s=0.2,
        click_delay_median_s=0.3,
    )
    start = int(time.time() * US)
    generate(s, tmp_path, start_us=start, end_us=start + 3 * US, live=True, sleep=stalling_sleep)
    files = pq.read_table(tmp_path / "_manifest" / "files.parquet").to_pandas()
    late = 0
    for row in files.itertuples():
        path = tmp_path / row.dc / row.kind / row.name
        assert path.exists(), row.name
        # There when the manifest says, not later; in the partition of a moment it was being written.
        assert row.arrival_us * 1000 >= path.stat().st_mtime_ns, row.name
        assert row.name.rsplit("/", 1)[0] in {partition_of(row.arrival_us), partition_of(row.arrival_us - US)}
        late += row.arrival_us > row.close_us + 2 * US
    assert late > 0  # the stall held files up
    clicks = pq.read_table(tmp_path / "_manifest" / "clicks.parquet").to_pandas()
    arrived = {}
    for row in files[files.kind == "queries"].itertuples():
        for line in (tmp_path / row.dc / row.kind / row.name).read_bytes().splitlines():
            try:
                qid = json.loads(line)["query_id"]
            except (ValueError, KeyError, TypeError):
                continue
            arrived[qid] = min(arrived.get(qid, row.arrival_us), row.arrival_us)
    must = clicks[clicks.expect == "join"]
    assert len(must) > 0
    for c in must.itertuples():  # a click the manifest says must join had its query there in time, truly
        assert arrived[c.query_id] <= c.click_ts_us + (s.max_join_delay_s - s.boundary_margin_s) * US, c.click_id
    assert (clicks.expect == "unjoinable").sum() > 0  # and some that the stall made too late are owed nothing


def test_cli_generates_historical_logs_with_overrides(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from photon.cli import app

    result = CliRunner().invoke(
        app,
        [
            "generate",
            "--logs",
            str(tmp_path),
            "--start",
            "2026-11-20T00:00:00Z",
            "--duration",
            "5",
            "--rate",
            "1000",
            "--dcs",
            "dc-a,dc-b,dc-c",
            "--set",
            "duplicate_fraction=0.1",
            "--set",
            'dc_lag_factor={"dc-c": 3}',
        ],
    )
    assert result.exit_code == 0, result.output
    assert "historical:" in result.output and "expected outcomes" in result.output
    manifest = json.loads((tmp_path / "_manifest" / "manifest.json").read_text())
    assert manifest["settings"]["duplicate_fraction"] == 0.1 and manifest["settings"]["dcs"] == ["dc-a", "dc-b", "dc-c"]
    assert manifest["start_us"] == 1_795_132_800_000_000  # 2026-11-20T00:00:00Z
    assert all((tmp_path / dc / "clicks").is_dir() for dc in ("dc-a", "dc-b", "dc-c"))
    bad = CliRunner().invoke(app, ["generate", "--logs", str(tmp_path / "x"), "--set", "nonsense=1"])
    assert bad.exit_code != 0 and "nonsense" in str(bad.exception)


def test_a_second_run_adds_to_the_manifest_instead_of_replacing_it(tmp_path: Path) -> None:
    """Was: generating more logs into the same folder replaced `_manifest/`, so the audit of output joined from the
    first run's logs reported those clicks as unexpected."""
    s = GeneratorSettings(events_per_s=2_000)
    first = generate(s, tmp_path, start_us=START, end_us=START + 20 * US)
    second = generate(s, tmp_path, start_us=START + 3_600 * US, end_us=START + 3_620 * US)
    m = pq.read_table(tmp_path / "_manifest" / "clicks.parquet")
    assert m.num_rows == first.clicks + second.clicks and len(set(m["click_id"].to_pylist())) == m.num_rows
    files = pq.read_table(tmp_path / "_manifest" / "files.parquet")
    assert files.num_rows == 2 * (first.files + second.files)  # two replicas
    summary = json.loads((tmp_path / "_manifest" / "manifest.json").read_text())
    assert len(summary["runs"]) == 2 and summary["clicks"] == first.clicks + second.clicks
    assert summary["start_us"] == START and summary["end_us"] == START + 3_620 * US
    # The same run again replaces its own part: nothing counted twice.
    generate(s, tmp_path, start_us=START, end_us=START + 20 * US)
    assert pq.read_table(tmp_path / "_manifest" / "clicks.parquet").num_rows == m.num_rows


def test_a_manifest_from_before_parts_is_kept_as_one_run(tmp_path: Path) -> None:
    s = GeneratorSettings(events_per_s=2_000)
    first = generate(s, tmp_path, start_us=START, end_us=START + 20 * US)
    mdir = tmp_path / "_manifest"
    # Rewrite it in the old layout: one clicks.parquet file, one files.parquet file, manifest.json, no runs/.
    for name in ("clicks.parquet", "files.parquet"):
        table = pq.read_table(mdir / name)
        shutil.rmtree(mdir / name)
        pq.write_table(table, mdir / name)
    old = json.loads((mdir / "runs" / next(p.name for p in (mdir / "runs").iterdir())).read_text())
    shutil.rmtree(mdir / "runs")
    (mdir / "manifest.json").write_text(json.dumps({k: v for k, v in old.items() if k != "run"}))
    second = generate(s, tmp_path, start_us=START + 3_600 * US, end_us=START + 3_620 * US)
    assert pq.read_table(mdir / "clicks.parquet").num_rows == first.clicks + second.clicks
    summary = json.loads((mdir / "manifest.json").read_text())
    assert "legacy" in summary["runs"] and summary["clicks"] == first.clicks + second.clicks


def test_a_live_run_writes_each_chunks_clicks_once_its_queries_landed_not_at_the_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The clicks' outcomes wait for their queries' true arrivals, chunk by chunk: held for as long as query files
    are late, never for the whole run (an hour's live run would hold an hour of clicks in memory)."""
    import time

    import photon.tools.generator as generator

    written: list[float] = []
    real = generator._add_manifest_rows

    def timed(*args: object, **kwargs: object) -> None:
        written.append(time.time())
        real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(generator, "_add_manifest_rows", timed)
    s = GeneratorSettings(events_per_s=300, rotate_s=0.5, chunk_s=1.0, query_lag_median_s=0.1, click_lag_median_s=0.1,
                          late_query_file_fraction=0.0)  # fmt: skip
    start = int(time.time() * US)
    generate(s, tmp_path, start_us=start, end_us=start + 4 * US, live=True)
    assert len(written) >= 4 and written[0] < start / US + 3, [round(t - start / US, 1) for t in written]
