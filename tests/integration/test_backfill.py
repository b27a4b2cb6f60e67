"""Backfills look up the same horizon as a live pipeline: a click whose query is anywhere in the logs within the
registry's horizon is joined, across hour boundaries, through the shared per-data-center query index
(``<out>/_query_index/<dc>``), built once per sealed query partition."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from photon.joiner.common import JoinSettings
from photon.joiner.lease import Joiner
from photon.joiner.query_index import REASON_QUERY_GC
from photon.logs.layout import log_path
from photon.registry.admin import advance_gc_threshold, init_registry
from photon.registry.client import read_layout
from photon.tools.audit import audit, pipelines_in
from photon.tools.generator import GeneratorSettings, generate
from tests.integration import output

US = 1_000_000
HOUR_US = 3_600 * US


def test_hourly_backfills_join_late_clicks_across_hours(tmp_path: Path, servers: dict[str, str], spark: Any) -> None:
    """Three hours of history with many late clicks (up to an hour after their query), backfilled hour by hour as
    photon_backfill runs them (dc-a's window, then dc-b's): nothing lost, nothing twice. Before the shared index a
    window read queries from only 240 s before its start, and every click more than that after its query, in the
    hour after its query's, was given up as "query not found"."""
    logs, out = tmp_path / "logs", tmp_path / "out"
    h0 = (int(time.time()) // 3_600 - 5) * HOUR_US
    settings = GeneratorSettings(
        events_per_s=0.6,
        query_servers=2,
        click_servers=2,
        clicks_per_query=0.5,
        late_click_fraction=0.3,
        rotate_s=60,
        chunk_s=60,
        malformed_fraction=0.0,
    )
    generate(settings, logs, start_us=h0, end_us=h0 + 3 * HOUR_US)
    built: dict[tuple[int, str], dict[str, Any]] = {}
    took: dict[tuple[int, str], float] = {}
    for h in range(3):
        for dc in ("dc-a", "dc-b"):
            t0 = time.monotonic()
            window = h0 + h * HOUR_US
            name = f"backfill-{dc}-{datetime.fromtimestamp(window / US, UTC):%Y%m%d%H%M}"
            s = JoinSettings(window_start_us=window, window_end_us=window + HOUR_US, trigger_interval_s=0.1)
            joiner = Joiner(dc, logs, out, servers, spark, s, pipeline=name)
            joiner.run(until_caught_up=True, drain=True)
            joiner.release()
            built[h, dc], took[h, dc] = joiner.index_stats, time.monotonic() - t0
    report = audit(out, manifest=logs / "_manifest")
    assert report.lost == 0 and report.duplicate_clicks == 0, (report.failures(), report.unjoinable_by_reason)
    assert report.ok, report.failures()
    # Every reader of the output skips the shared index's folder; each replica has its own index.
    assert "_query_index" not in pipelines_in(out) and sorted(os.listdir(out / "_query_index")) == ["dc-a", "dc-b"]
    # Each sealed query partition is parsed once per replica: a later hour parses only what arrived since.
    for dc in ("dc-a", "dc-b"):
        assert built[0, dc]["already"] == 0 and built[0, dc]["indexed"] > 0
        for h in (1, 2):
            assert built[h, dc]["already"] == sum(built[i, dc]["indexed"] for i in range(h)), built
            assert 0 < built[h, dc]["indexed"] <= 60 + 5, built  # an hour's minutes, and the join delay's few
    print(f"outcomes {report.outcomes}; unjoinable {report.unjoinable_by_reason}; index {built}; seconds {took}")


def _query(ts: int) -> bytes:
    ad = {"ad_id": "a1", "advertiser_id": "adv1", "bid_micros": 1}
    q = {"query_id": f"10.0.0.1-7-{ts}", "ts_us": ts, "user_id": "u", "query_text": "q", "country": "DE", "ads": [ad]}
    return json.dumps(q).encode() + b"\n"


def _click(ts: int, query_ts: int) -> bytes:
    c = {"click_id": f"10.0.0.2-8-{ts}", "ts_us": ts, "query_id": f"10.0.0.1-7-{query_ts}", "ad_id": "a1"}
    return json.dumps(c).encode() + b"\n"


def _write(logs: Path, kind: str, name: str, arrival_us: int, data: bytes) -> None:
    path = log_path(logs, "dc-a", kind, name, arrival_us)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def test_live_store_pruned_behind_the_horizon_and_older_queries_unjoinable(
    tmp_path: Path, make_db: Callable[[], str], login_as: Callable[[str, str], str], spark: Any
) -> None:
    """A live pipeline stores two queries; GC moves the registry's horizon between them. At its next lease the
    pipeline's EventStore keeps only what is at or after the horizon minus the clock skew; a click on the recent query
    is joined (its lookup still hits), a click on the older one is unjoinable with the horizon as its reason (before,
    the store kept every query forever and joined it)."""
    dsn = make_db()
    init_registry({"main": dsn}, num_shards=2)
    servers, gc = {"main": login_as(dsn, "photon_joiner")}, {"main": login_as(dsn, "photon_gc")}
    logs, out = tmp_path / "logs", tmp_path / "out"
    now = int(time.time()) * US
    old = (now - 1_200 * US) // (10 * US) * (10 * US)  # a bucket's first microsecond
    recent = old + 60 * US
    _write(logs, "queries", "10.0.0.1-7-1.jsonl", old + 1 * US, _query(old) + _query(recent))
    settings = JoinSettings(trigger_interval_s=0.1)
    first = Joiner("dc-a", logs, out, servers, spark, settings)
    first.run(until_caught_up=True, drain=True)
    first.release()
    store = out / "dc-a" / "_state" / "eventstore"
    assert {p.name for p in store.iterdir()} == {f"bucket={old // (10 * US)}", f"bucket={recent // (10 * US)}"}

    horizon = old + 30 * US  # between the two queries, and more than the skew after the older one
    layout, _ = read_layout(gc["main"])
    for ref in layout.shards():
        assert advance_gc_threshold(gc, ref, horizon) == horizon
    _write(logs, "clicks", "10.0.0.2-8-1.jsonl", now, _click(now - 2 * US, old) + _click(now - 1 * US, recent))
    second = Joiner("dc-a", logs, out, servers, spark, settings)
    second.run(until_caught_up=True, drain=True)
    second.release()

    joined = output.rows(out, "joined", "dc-a")
    unjoinable = output.rows(out, "unjoinable", "dc-a")
    assert [(r["click_id"], r["query_ts_us"]) for r in joined] == [(f"10.0.0.2-8-{now - 1 * US}", recent)]
    assert [(r["click_id"], r["reason"]) for r in unjoinable] == [(f"10.0.0.2-8-{now - 2 * US}", REASON_QUERY_GC)]
    assert {p.name for p in store.iterdir()} == {f"bucket={recent // (10 * US)}"}
    assert second.batches.horizon_us == horizon


def _join(argv: list[str], monkeypatch: Any, capsys: Any) -> tuple[int, str]:
    """``photon join`` as a person runs it (its one-line errors and exit status 2 included): (status, output)."""
    import sys

    import pytest

    from photon.cli import main

    monkeypatch.setattr(sys, "argv", ["photon", "join", *argv])
    with pytest.raises(SystemExit) as exited:
        main()
    captured = capsys.readouterr()
    return int(exited.value.code or 0), captured.out + captured.err


def test_a_backfill_of_a_window_without_logs_or_past_the_horizon_says_so_and_fails(
    tmp_path: Path, servers: dict[str, str], spark: Any, monkeypatch: Any, capsys: Any
) -> None:
    """A window whose replica holds no click file, or that ends before the registry's horizon, joins nothing: the
    backfill says so in one line naming the window and the horizon, and fails (exit 2, before Spark starts), unless
    --allow-empty accepts it. Was: success with 0 batches, silently."""
    monkeypatch.setenv("PHOTON_REGISTRY_DSN", servers["main"])
    logs, out = tmp_path / "logs", tmp_path / "out"
    (logs / "dc-a" / "clicks").mkdir(parents=True)
    hour = (int(time.time() * US) // HOUR_US - 2) * HOUR_US
    old = hour - 8 * 24 * HOUR_US  # the README's fixed dates, 8 days later: past the 3-day retention's horizon
    # A click file of the old window: it has logs, but lies before the horizon.
    stale = log_path(logs, "dc-a", "clicks", "10.0.0.1-1-0.jsonl", old + 60 * US)
    stale.parent.mkdir(parents=True)
    stale.write_text(json.dumps({"click_id": f"10.0.0.1-1-{old + 5}", "ts_us": old + 5, "query_id": "q", "ad_id": "a"}))

    def iso(ts: int) -> str:
        return datetime.fromtimestamp(ts / US, UTC).strftime("%Y-%m-%dT%H:%M:%S")

    def backfill(start: int, *more: str) -> list[str]:
        args = ["--dc", "dc-a", "--logs", str(logs), "--out", str(out), "--pipeline", f"backfill-dc-a-{start}"]
        return [*args, "--until-caught-up", "--window-start", iso(start), "--window-end", iso(start + HOUR_US), *more]

    code, said = _join(backfill(hour), monkeypatch, capsys)
    assert code == 2 and len(said.strip().splitlines()) == 1, said
    assert (
        f"backfill of dc-a [{iso(hour)}Z, {iso(hour + HOUR_US)}Z): no click file in {logs / 'dc-a' / 'clicks'}" in said
    )
    assert "the registry's horizon is" in said and "--allow-empty" in said
    code, said = _join(backfill(old), monkeypatch, capsys)
    assert code == 2 and "the window ends before the registry's horizon" in said and "no click file" not in said, said
    code, said = _join(backfill(hour, "--allow-empty"), monkeypatch, capsys)
    assert code == 0 and "run all the same (allow_empty)" in said and "0 batch(es) committed" in said, said
