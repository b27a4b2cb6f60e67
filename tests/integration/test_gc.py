"""Registry garbage collection against real PostgreSQL: dry run, partitions dropped and rows freed, thresholds that
never go back under racing GC runs, refused old ids, and GC running while two joiners replay old logs."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from photon.joiner.common import REASON_GC, JoinSettings
from photon.joiner.lease import Joiner
from photon.logs.ids import make_id
from photon.logs.layout import log_path, partition_of
from photon.registry.admin import init_registry, status
from photon.registry.client import IdRegistry, Outcome
from photon.registry.gc import collect_garbage
from photon.registry.owners import create_owner
from photon.tools.audit import audit
from photon.tools.generator import GeneratorSettings, generate
from photon.tools.report import render_report
from tests.integration import output

pytestmark = pytest.mark.integration
US = 1_000_000
HOUR = 3_600 * US


@pytest.fixture
def servers(make_db: Callable[[], str]) -> dict[str, str]:
    dsn = make_db()
    init_registry({"main": dsn}, num_shards=4)
    return {"main": dsn}


def rows_total(servers: dict[str, str]) -> int:
    return sum(sh["rows"] for cfg in status(servers)["configs"] for sh in cfg["shards"])


def test_gc_frees_whole_partitions_and_stragglers_and_refuses_old_ids(servers: dict[str, str]) -> None:
    now = (int(time.time()) // 3600) * HOUR - 30 * 60 * US  # half past an hour, in the past: ids may not be ahead
    ids = [make_id("10.0.0.1", 7, now - h * HOUR + i) for h in range(6) for i in range(0, 1_000 * 1_000, 1_000)]
    reg = IdRegistry(servers)
    assert (reg.register(ids, create_owner(servers["main"], "dc-a").token(1)).outcomes == Outcome.WON).all()
    assert rows_total(servers) == 6_000

    # Keep 2.5 hours: the partitions of hours -5, -4 and -3 go whole, hour -2 holds no row below the cut.
    dry = collect_garbage(servers, retention_s=2.5 * 3600, max_clock_skew_s=0, now_us=now, dry_run=True)
    assert dry.rows_freed == 3_000 and dry.bytes_freed > 0
    assert sum(len(s.partitions) for s in dry.shards) == 3 * 4
    assert rows_total(servers) == 6_000  # nothing changed
    assert all(s.threshold_before_us == 0 for s in dry.shards)

    report = collect_garbage(servers, retention_s=2.5 * 3600, max_clock_skew_s=0, now_us=now)
    assert report.rows_freed == 3_000 and sum(len(s.partitions) for s in report.shards) == 12
    assert rows_total(servers) == 3_000
    assert {s.threshold_after_us for s in report.shards} == {now - int(2.5 * HOUR)}

    # A cut through a partition: stragglers below it are deleted, the partition stays.
    report = collect_garbage(servers, retention_s=2 * 3600 - 0.25, max_clock_skew_s=0, now_us=now)
    assert sum(s.straggler_rows for s in report.shards) == 250 and report.rows_freed == 250
    assert rows_total(servers) == 2_750

    # Old ids are refused, whoever asks; new ones are still taken.
    res = reg.register(
        [make_id("10.0.0.2", 1, now - 2 * HOUR), make_id("10.0.0.2", 1, now)],
        create_owner(servers["main"], "dc-b").token(1),
    )
    assert res.outcomes.tolist() == [Outcome.TOO_OLD, Outcome.WON]


def test_racing_gc_runs_never_move_a_threshold_back(servers: dict[str, str]) -> None:
    now = int(time.time() * US)
    results: list[Any] = []

    def run(retention_h: float) -> None:
        for _ in range(5):
            results.append(collect_garbage(servers, retention_s=retention_h * 3600, max_clock_skew_s=0, now_us=now))

    threads = [threading.Thread(target=run, args=(h,)) for h in (1, 2, 3, 1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 25
    for report in results:
        for s in report.shards:
            assert s.threshold_after_us >= s.threshold_before_us
            assert s.threshold_after_us >= report.target_us
    final = {sh["gc_threshold_us"] for cfg in status(servers)["configs"] for sh in cfg["shards"]}
    assert final == {now - HOUR}


def test_gc_while_two_joiners_replay_old_logs(tmp_path: Path, servers: dict[str, str], spark: Any) -> None:
    """Old logs are joined, GC runs repeatedly while both joiners take new logs and a replay of the old ones under
    new names: nothing is duplicated, and every replayed click that the registry refused is in unjoinable/ with the
    GC reason."""
    now = int(time.time() * US)
    settings = GeneratorSettings(events_per_s=600, malformed_fraction=0.0, late_click_fraction=0.0)
    old, new = tmp_path / "old", tmp_path / "new"
    generate(settings, old, start_us=now - 2 * HOUR, end_us=now - 2 * HOUR + 15 * US)
    generate(settings.with_overrides(["seed=2"]), new, start_us=now - 300 * US, end_us=now - 285 * US)
    logs, out = tmp_path / "logs", tmp_path / "out"
    shutil.copytree(old, logs, ignore=shutil.ignore_patterns("_manifest"))
    js = JoinSettings(trigger_interval_s=0.2, max_join_delay_s=120)
    for dc in ("dc-a", "dc-b"):
        Joiner(dc, logs, out, servers, spark, js).run(until_caught_up=True, drain=True)
    first = audit(out, manifest=old / "_manifest")
    assert first.ok, first.failures()

    stop = threading.Event()
    gc_runs: list[Any] = []

    def gc_loop() -> None:
        while not stop.is_set():
            gc_runs.append(collect_garbage(servers, retention_s=3600, max_clock_skew_s=10))
            time.sleep(0.2)

    gc = threading.Thread(target=gc_loop)
    gc.start()
    replayed = 0
    try:
        for dc in ("dc-a", "dc-b"):  # the old logs again under new names, and the new logs
            for kind in ("queries", "clicks"):
                for f in sorted((old / dc / kind).rglob("*.jsonl")):
                    shutil.copy(f, logs / dc / kind / f"replay-{f.name}")
                    replayed += kind == "clicks"
                for f in sorted((new / dc / kind).rglob("*.jsonl")):
                    target = log_path(logs, dc, kind, f.name, int(time.time() * US))  # arriving now
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(f, target)
        errors: list[BaseException] = []

        def join(dc: str) -> None:
            try:
                Joiner(dc, logs, out, servers, spark, js).run(until_caught_up=True, drain=True)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=join, args=(dc,)) for dc in ("dc-a", "dc-b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
    finally:
        stop.set()
        gc.join()
    assert len(gc_runs) >= 2 and gc_runs[-1].rows_freed == 0 and gc_runs[0].rows_freed > 0

    joined = output.ids(out, "joined")
    assert len(joined) == len(set(joined)), "a click was joined twice"
    unjoinable = output.rows(out, "unjoinable")
    assert all(r["reason"] for r in unjoinable)
    refused = {r["click_id"] for r in unjoinable if r["reason"] == REASON_GC}
    old_clicks = set(pq.read_table(old / "_manifest" / "clicks.parquet")["click_id"].to_pylist())
    assert refused and refused <= old_clicks  # only the replayed old clicks, each with the GC reason
    second = audit(out, manifest=new / "_manifest")
    assert second.duplicate_clicks == 0 and second.lost == 0 and second.wrong_query == 0

    # The run's metrics and the GC runs' shard sizes draw the report's charts.
    charts = render_report(servers["main"], tmp_path / "report").written
    assert [c.name for c in charts] == ["latency.png", "shares.png", "registry_batching.png", "shard_sizes.png"]
    for c in charts:
        data = c.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_gc_takes_now_from_the_registry_server_not_from_a_host_clock_far_ahead(
    servers: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = time.time
    recent = make_id("10.0.0.1", 7, int((real() - 600) * US))  # ten minutes old: inside a one-hour retention
    monkeypatch.setattr(time, "time", lambda: real() + 30 * 86_400)  # the GC host believes it is a month later
    report = collect_garbage(servers, retention_s=3600, max_clock_skew_s=10)
    server_now = real() * US
    for s in report.shards:  # the thresholds follow the server's time, not the host's
        assert abs(s.threshold_after_us - (server_now - 3610 * US)) < 60 * US
    assert abs(report.target_us - (server_now - 3610 * US)) < 60 * US
    res = IdRegistry(servers).register([recent], create_owner(servers["main"], "dc-a").token(1))
    assert res.outcomes.tolist() == [Outcome.WON]  # a host clock ahead would have made it TOO_OLD for good


def test_gc_runs_as_a_login_holding_only_photon_gc(
    servers: dict[str, str], login_as: Callable[[str, str], str]
) -> None:
    now = (int(time.time()) // 3600) * HOUR - 30 * 60 * US
    ids = [make_id("10.0.0.1", 7, now - h * HOUR + i) for h in range(4) for i in range(0, 500 * 1_000, 1_000)]
    IdRegistry(servers).register(ids, create_owner(servers["main"], "dc-a").token(1))
    as_gc = {"main": login_as(servers["main"], "photon_gc")}
    dry = collect_garbage(as_gc, retention_s=2.5 * 3600, max_clock_skew_s=0, now_us=now, dry_run=True)
    assert dry.rows_freed == 500 and sum(len(s.partitions) for s in dry.shards) == 4  # the hour-3 partitions
    report = collect_garbage(as_gc, retention_s=2 * 3600 - 0.25, max_clock_skew_s=0, now_us=now)
    assert report.rows_freed == 500 + 250 and sum(len(s.partitions) for s in report.shards) == 4
    assert sum(s.straggler_rows for s in report.shards) == 250 and rows_total(servers) == 1_250
    again = collect_garbage(as_gc, retention_s=3600, max_clock_skew_s=10)  # now from the server, as the DAG runs it
    assert abs(again.target_us - (time.time() - 3610) * US) < 60 * US
    assert all(s.threshold_after_us >= s.threshold_before_us for s in again.shards)
    assert rows_total(servers) == 1_250 - again.rows_freed


def test_gc_drops_consumed_file_records_behind_each_pipelines_mark_and_the_horizon(
    servers: dict[str, str], login_as: Callable[[str, str], str]
) -> None:
    """The consumed-file table stays as large as the retention, not as a pipeline's history: a record goes once its
    partition is older than the horizon and behind the listing mark its pipeline's last batch recorded. A record a
    joiner may still list (at or after its mark, a file directly in <kind>/, a pipeline without marks) stays."""
    from photon.joiner.state import PipelineState

    now = int(time.time() * US)
    old, mark, fresh = (partition_of(now - h * 3_600 * US) for h in (100, 90, 1))
    joiner = login_as(servers["main"], "photon_joiner")
    a = PipelineState(joiner, "dc-a")
    lease = a.start_lease()
    a.commit(lease, 1, [("clicks", f"{old}/c1.jsonl"), ("queries", f"{old}/q1.jsonl"), ("clicks", "flat.jsonl")])
    a.commit(lease, 2, [("clicks", f"{mark}/c2.jsonl"), ("clicks", f"{fresh}/c3.jsonl")], marks={"clicks": mark})
    b = PipelineState(joiner, "dc-b")  # no marks recorded: it lists everything, so nothing of it may go
    b.commit(b.start_lease(), 1, [("clicks", f"{old}/c1.jsonl")])
    as_gc = {"main": login_as(servers["main"], "photon_gc")}
    dry = collect_garbage(as_gc, retention_s=3_600, dry_run=True)
    assert dry.consumed_files_freed == 1
    report = collect_garbage(as_gc, retention_s=3_600)
    assert report.consumed_files_freed == 1
    assert a.consumed() == {
        ("queries", f"{old}/q1.jsonl"),  # dc-a records no queries mark: kept
        ("clicks", "flat.jsonl"),
        ("clicks", f"{mark}/c2.jsonl"),
        ("clicks", f"{fresh}/c3.jsonl"),
    }
    assert b.consumed() == {("clicks", f"{old}/c1.jsonl")}
