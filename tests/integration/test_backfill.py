"""Backfills look up the same horizon as a live pipeline: a click whose query is anywhere in the logs within the
registry's horizon is joined, across hour boundaries, through the shared per-data-center query index
(``<out>/_query_index/<dc>``), built once per sealed query partition."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from photon.audit import audit
from photon.generator import GeneratorSettings, generate
from photon.joiner import Joiner, JoinSettings

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
    for h in range(3):
        for dc in ("dc-a", "dc-b"):
            window = h0 + h * HOUR_US
            name = f"backfill-{dc}-{datetime.fromtimestamp(window / US, UTC):%Y%m%d%H%M}"
            s = JoinSettings(window_start_us=window, window_end_us=window + HOUR_US, trigger_interval_s=0.1)
            joiner = Joiner(dc, logs, out, servers, spark, s, pipeline=name)
            joiner.run(until_caught_up=True, drain=True)
            joiner.release()
    report = audit(out, manifest=logs / "_manifest")
    assert report.lost == 0 and report.duplicate_clicks == 0, (report.failures(), report.unjoinable_by_reason)
    assert report.ok, report.failures()
    late = report.outcomes
    print(f"outcomes {late}; unjoinable {report.unjoinable_by_reason}")
