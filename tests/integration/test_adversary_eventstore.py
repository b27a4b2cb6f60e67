"""Adversarial reproductions against the EventStore as an index over the query logs (Photon's LogsEventStore).

The index keeps, per query, where its line is (file, offset, length); at 6180054 a lookup took only the FIRST
stored copy of each wanted id (``_first_rows``) and read that line back. A query id may legitimately be stored more
than once (EVENTS.md: "the same event can appear more than once ... in one file or in two", a recovered query file,
a file moved from the flat layout into a partition as EVENTS.md asks). When the first copy's file was gone, the
lookup missed even though another stored copy read back fine, and a click the contract says must be joined ended
in ``unjoinable/``. These tests failed on 6180054 and pass since dbb95bf (the lookup takes the first copy that reads
back); they stay as regression tests. (A fourth reproduction, a late click whose query log was removed under the
README's old retention rule, "max-join-delay plus grace", is not kept: dbb95bf changed the contract instead,
EVENTS.md now requires query logs to be kept as long as the registry's retention.)
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from photon.joiner.common import JoinSettings
from photon.joiner.eventstore import index_of, write_index
from photon.joiner.lease import Joiner
from photon.joiner.tasks import join_partition
from photon.logs.layout import log_path
from photon.logs.parse import parse_file_located
from tests.integration import output
from tests.integration.test_hostile_input import candidates, outputs, query_line
from tests.integration.test_joiner import partition_task

pytestmark = pytest.mark.integration
US = 1_000_000
MINUTE = 60 * US


def _index(logs: Path, rel: str, store: Path, name: str, bucket_s: int) -> int:
    """Index one query log file ``<logs>/<rel>`` into ``store`` exactly as a batch's first stage does."""
    content = (logs / rel).read_bytes()
    good, bad, offsets, lengths = parse_file_located(rel, content, "queries")
    assert bad.num_rows == 0
    write_index(index_of(good, rel, offsets, lengths), store, "", name, bucket_s)
    return good.num_rows


def _write(path: Path, content: bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path.name


def _rel(task: Any, path: Path) -> str:
    return str(path.relative_to(Path(task.logs)))


def test_lookup_finds_a_query_through_its_second_stored_copy_when_the_first_copys_file_is_gone(
    tmp_path: Path,
) -> None:
    """The mechanism alone, on the cache (no registry, no Spark): a query stored twice, from two log files holding
    the same line; the first file is gone. The second copy is indexed and reads back as itself, so the lookup must
    find the query. It does not: ``_first_rows`` keeps only the first stored row per id, and ``lookup`` never looks
    at another copy when ``_read_lines`` reports that one missing."""
    from photon.joiner.eventstore import EventStoreCache

    logs, store = tmp_path / "logs", tmp_path / "store"
    ts = 1_763_737_200_123_456
    line = query_line(ts) + b"\n"
    _write(logs / "20251121" / "1500" / "first.jsonl", line)
    _write(logs / "20251121" / "1520" / "recovered-1763738400000000.jsonl", line)
    _index(logs, "20251121/1500/first.jsonl", store, "b0000000001-e1-q000000", 10)
    _index(logs, "20251121/1520/recovered-1763738400000000.jsonl", store, "b0000000002-e1-q000000", 10)
    (logs / "20251121" / "1500" / "first.jsonl").unlink()
    queries, found, stats = EventStoreCache(store, logs, 10).lookup(pa.array([f"10.0.0.2-6-{ts}"]), 10)
    assert found.tolist() == [True], stats
    assert queries.column("user_id").to_pylist() == ["u"]


def test_a_recovered_click_joins_through_the_recovered_copy_of_its_query_when_the_original_log_is_gone(
    tmp_path: Path, servers: dict[str, str]
) -> None:
    """Attack: the verifier recovers a click (its pipeline registered it and died) about 15 minutes after the fact
    and re-dispatches the click's line and its query's line into every data center (EVENTS.md, "Recovered
    events"). This pipeline indexed the query from its own replica long ago; that original query file is older than
    the README's retention for query logs (``--max-join-delay`` 120 s + the verifier's grace 600 s) and was
    removed. The recovered query file is in the logs and indexed by this very batch, so the click must be joined
    (its query reached the logs within the maximum join delay, which for a recovered click runs from its recovery).

    What happens: ``EventStoreCache.lookup`` takes only the first stored copy of the id (``_first_rows``), whose
    file is gone; ``_read_lines`` logs a miss, and the click waits and then becomes unjoinable, although the second
    stored copy (the recovered file) reads back fine."""
    now = int(time.time() * US)
    task = replace(partition_task(tmp_path, servers, now, 120 * US), tag="b0000000009-e1")
    logs = Path(task.logs)
    t0 = now - 15 * MINUTE  # the query and the click, 15 minutes ago
    line = query_line(t0) + b"\n"
    original = log_path(logs.parents[1], "dc-a", "queries", "10.0.0.2-6-1.jsonl", t0 + US)
    _write(original, line)
    # An earlier, committed batch indexed the original.
    assert _index(logs, _rel(task, original), Path(task.state) / "eventstore", "b0000000002-e1-q000000", 10) == 1
    original.unlink()  # older than max-join-delay + grace: the README allows removing it
    # The verifier's recovered copy, indexed by this batch's first stage.
    recovered = log_path(logs.parents[1], "dc-a", "queries", f"recovered-{now - US}.jsonl", now - US)
    _write(recovered, line)
    assert (
        _index(logs, _rel(task, recovered), Path(task.root, task.stage) / "eventstore", f"{task.tag}-q000000", 10) == 1
    )

    rows = candidates([(t0 + 2 * US, t0)], now)
    rows = rows.set_column(
        rows.schema.get_field_index("recovered_us"), "recovered_us", pa.array([now - US], pa.int64())
    )
    counts, _ = join_partition(task, rows, 0)
    assert counts["joined"] == 1, (
        f"the query is in the logs and in the index (recovered copy), but the lookup missed: {counts}"
    )
    assert [r["click_id"] for r in outputs(task, "joined")] == [f"10.0.0.1-5-{t0 + 2 * US}"]


def _rows(out: Path, kind: str) -> list[dict[str, Any]]:
    return output.rows(out, kind, "dc-a")


def test_end_to_end_moving_a_flat_query_file_into_a_partition_as_events_md_asks_keeps_its_clicks_joinable(
    tmp_path: Path, servers: dict[str, str], spark: Any
) -> None:
    """Attack, with the real Joiner: a query file sits directly in ``queries/`` (the layout before partitions; the
    joiner reads and indexes it). EVENTS.md says of such files: "listing them costs whatever the folder holds:
    move them into partitions". The operator moves it, unchanged, into the partition of the moment (where a file
    arriving now belongs); the joiner takes it as a new file and indexes its queries again, under the new name.
    Then a click on one of those queries arrives. Its query is in the logs, unchanged, and indexed (twice): it must
    be joined.

    What happens: the lookup reads back only the first stored copy, under the old name, finds the file gone, misses
    on every retry, and the click ends in ``unjoinable/`` once its join delay passes."""
    logs, out = tmp_path / "logs", tmp_path / "out"
    now = int(time.time() * US)
    tq = now - 3 * US
    flat = logs / "dc-a" / "queries" / "10.0.0.2-6-1.jsonl"
    _write(flat, query_line(tq) + b"\n")
    settings = JoinSettings(max_join_delay_s=6, retry_base_s=0.2, retry_max_s=1.0, trigger_interval_s=0.1)
    joiner = Joiner("dc-a", logs, out, servers, spark, settings)
    first = joiner.run(until_caught_up=True)
    assert sum(r.metrics["queries"] for r in first) == 1  # the flat file was read and its query indexed

    moved = log_path(logs, "dc-a", "queries", flat.name, int(time.time() * US))
    moved.parent.mkdir(parents=True, exist_ok=True)
    flat.rename(moved)  # the same bytes, now in a partition, as EVENTS.md asks
    click_ts = int(time.time() * US) - US
    click = (
        f'{{"click_id": "10.0.0.1-5-{click_ts}", "ts_us": {click_ts}, "query_id": "10.0.0.2-6-{tq}", "ad_id": "a1"}}'
    )
    _write(log_path(logs, "dc-a", "clicks", "10.0.0.1-5-1.jsonl", int(time.time() * US)), click.encode() + b"\n")
    joiner.run(until_caught_up=True, drain=True)

    joined = [r["click_id"] for r in _rows(out, "joined")]
    unjoinable = [(r["click_id"], r["reason"]) for r in _rows(out, "unjoinable")]
    assert joined == [f"10.0.0.1-5-{click_ts}"], f"joined {joined}, unjoinable {unjoinable}"
