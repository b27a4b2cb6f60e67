"""The joiner end to end: real PostgreSQL registry, real local Spark, generated logs, the independent auditor."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from photon.joiner.common import JoinSettings
from photon.joiner.lease import Joiner
from photon.logs.layout import log_path
from photon.pg import autocommit
from photon.tools.audit import audit
from photon.tools.generator import GeneratorSettings, generate
from tests.integration import output

pytestmark = pytest.mark.integration
US = 1_000_000
ROOT = Path(__file__).resolve().parents[2]


def make_logs(root: Path, seconds: float = 20, rate: float = 600, **overrides: Any) -> Path:
    start = (int(time.time()) - 600) * US  # ten minutes ago: historical, older than the join delay
    base: dict[str, Any] = {"malformed_fraction": 0.01, "duplicate_fraction": 0.02, "lost_query_fraction": 0.05}
    settings = GeneratorSettings(events_per_s=rate, **(base | overrides))
    generate(settings, root, start_us=start, end_us=start + int(seconds * US))
    return root


def registered_under(dsn: str, pipeline: str, shards: int = 4) -> int:
    """Ids the registry holds under the pipeline's owner (configuration 1's shards)."""
    with autocommit(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT owner_id FROM photon.pipelines WHERE pipeline = %s", (pipeline,))
        owner = cur.fetchone()[0]
        registered = 0
        for shard in range(shards):
            cur.execute(f"SELECT count(*) FROM photon.ids_c1_s{shard} WHERE token >> 32 = %s", (owner,))
            registered += cur.fetchone()[0]
    return int(registered)


def joined_ids(out: Path) -> list[str]:
    return output.ids(out, "joined")


def test_two_pipelines_racing_over_the_same_logs(tmp_path: Path, servers: dict[str, str], spark: Any) -> None:
    logs = make_logs(tmp_path / "logs")
    out = tmp_path / "out"
    settings = JoinSettings(max_click_files=25, trigger_interval_s=0.2)
    errors: list[BaseException] = []

    def run(dc: str) -> None:
        try:
            Joiner(dc, logs, out, servers, spark, settings).run(until_caught_up=True, drain=True)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(dc,)) for dc in ("dc-a", "dc-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    report = audit(out, manifest=logs / "_manifest")
    assert report.ok, report.failures()
    assert report.duplicate_clicks == 0 and report.lost == 0 and report.outcomes["none"] == 0
    assert report.quarantine["found"] == report.quarantine["expected"] > 0
    assert sum(v["joined"] for v in report.shares.values()) == report.outcomes["joined"]
    with autocommit(servers["main"]) as conn, conn.cursor() as cur:
        cur.execute(
            "SELECT pipeline, count(*), sum(joined), sum(prefiltered + wasted) FROM photon.batch_metrics"
            " GROUP BY pipeline ORDER BY 1"
        )
        rows = cur.fetchall()
    assert [r[0] for r in rows] == ["dc-a", "dc-b"] and all(r[1] >= 2 for r in rows)
    assert sum(r[2] for r in rows) == report.outcomes["joined"]


def test_delayed_primary_is_joined_on_a_later_retry(tmp_path: Path, servers: dict[str, str], spark: Any) -> None:
    logs = make_logs(tmp_path / "logs", seconds=10, lost_query_fraction=0.0, malformed_fraction=0.0)
    held = tmp_path / "held"
    shutil.move(str(logs / "dc-a" / "queries"), str(held))  # the queries have not arrived yet
    (logs / "dc-a" / "queries").mkdir()
    out = tmp_path / "out"
    # A long join delay: historical clicks would otherwise be given up at once.
    settings = JoinSettings(max_join_delay_s=86_400, retry_base_s=0.1, retry_max_s=0.5, trigger_interval_s=0.1)
    joiner = Joiner("dc-a", logs, out, servers, spark, settings)
    first = joiner.run(until_caught_up=True)
    assert first and first[0].metrics["joined"] == 0 and first[0].metrics["retried"] > 0
    assert joined_ids(out) == []
    for f in sorted(held.rglob("*.jsonl")):  # the delayed primary arrives: in the partition of its arrival, now
        target = log_path(logs, "dc-a", "queries", f.name, int(time.time() * US))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(f), str(target))
    second = joiner.run(until_caught_up=True, drain=True)  # the same lease again: batch numbers go on
    assert second and second[0].batch_seq == first[-1].batch_seq + 1
    report = audit(out, manifest=logs / "_manifest")
    assert report.ok, report.failures()
    assert report.outcomes["joined"] == report.input_clicks


def test_replayed_input_and_restarts_add_nothing(tmp_path: Path, servers: dict[str, str], spark: Any) -> None:
    logs = make_logs(tmp_path / "logs", seconds=10)
    out = tmp_path / "out"
    settings = JoinSettings(trigger_interval_s=0.1)
    Joiner("dc-a", logs, out, servers, spark, settings).run(until_caught_up=True, drain=True)
    before = sorted(joined_ids(out))
    assert before
    # A restart (new lease) finds nothing new: every file was consumed, every retry resolved.
    assert Joiner("dc-a", logs, out, servers, spark, settings).run(until_caught_up=True, drain=True) == []
    # The same input files replayed under new names: every click is registered already.
    for f in sorted((logs / "dc-a" / "clicks").rglob("*.jsonl")):
        target = log_path(logs, "dc-a", "clicks", "replay-" + f.name, int(time.time() * US))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(f, target)
    again = Joiner("dc-a", logs, out, servers, spark, settings).run(until_caught_up=True, drain=True)
    assert again and sum(r.metrics["joined"] for r in again) == 0
    assert sum(r.metrics["prefiltered"] for r in again) == len(set(before))
    assert sorted(joined_ids(out)) == before


@pytest.mark.parametrize(
    "crash_points", [["after_register@2", "before_commit@3", "after_commit@3", "after_register@5"]]
)
def test_sigkilled_joiner_restarted_loses_and_duplicates_nothing(
    tmp_path: Path, servers: dict[str, str], crash_points: list[str], warm_spark: Path
) -> None:
    logs = make_logs(tmp_path / "logs", seconds=10)
    out = tmp_path / "out"
    env = {**os.environ, "PHOTON_REGISTRY_DSN": servers["main"], "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}"}
    env["PHOTON_HOME"] = str(warm_spark)  # each lease a process of its own on the warm server, as under Airflow
    cmd = [
        sys.executable,
        "-m",
        "photon",
        "join",
        "--dc",
        "dc-a",
        "--logs",
        str(logs),
        "--out",
        str(out),
        "--until-caught-up",
        "--drain",
        "--trigger-interval",
        "0.1",
        "--connect",
    ]
    # Small batches, so the crash points fall inside the run.
    env["PHOTON_TEST_MAX_CLICK_FILES"] = "4"
    for point in crash_points:
        proc = subprocess.run(
            cmd, env={**env, "PHOTON_CRASH_AT": point}, capture_output=True, text=True, timeout=300, check=False
        )
        assert proc.returncode == -9, proc.stdout + proc.stderr  # it really died by SIGKILL at that point
        # Between crashes, at every moment: no click in joined/ twice.
        ids = joined_ids(out)
        assert len(ids) == len(set(ids))
    final = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert final.returncode == 0, final.stdout + final.stderr
    report = audit(out, manifest=logs / "_manifest")
    assert report.ok, report.failures()
    assert report.duplicate_clicks == 0 and report.lost == 0
    # Every id registered under this pipeline's tokens is in the output: the re-run batches reclaimed the ids their
    # killed attempts had registered (same token, WON_AGAIN), so nothing is left for the verifier.
    assert registered_under(servers["main"], "dc-a") == len(set(joined_ids(out)))


def test_a_waiting_click_gets_a_last_look_at_its_deadline(tmp_path: Path, servers: dict[str, str]) -> None:
    """Backoff grows to 16 s, but the contract says a click whose query arrives within the maximum join delay must be
    joined: the next look may not be scheduled past the click's deadline, or a query arriving in its last seconds
    would be missed. A recovered click's deadline runs from its recovery."""
    import pyarrow as pa

    from photon.joiner.tasks import CANDIDATE, join_partition

    now = int(time.time() * US)
    delay = 20 * US
    rows = pa.table(
        {
            "click_id": [f"10.0.0.1-5-{now - 10 * US}", f"10.0.0.1-5-{now - 600 * US}"],
            "click_ts_us": [now - 10 * US, now - 600 * US],
            "query_id": [f"10.0.0.2-6-{now - 11 * US}", f"10.0.0.2-6-{now - 601 * US}"],
            "ad_id": ["a1", "a1"],
            "attempts": pa.array([4, 4], pa.int32()),  # the next backoff would be 16 s
            "first_seen_us": [now - 10 * US, now - 5 * US],
            "due_us": [now, now],
            "recovered_us": pa.array([None, now - 5 * US], pa.int64()),  # the second one: re-dispatched 5 s ago
        },
        CANDIDATE,
    )
    task = partition_task(tmp_path, servers, now, delay)
    counts, _ = join_partition(task, rows, 0)
    assert counts["retried"] == 2 and counts["unjoinable"] == 0
    waiting = pq.read_table(tmp_path / "state" / "retries" / task.tag).sort_by("click_ts_us")
    # The first waits for its deadline (now + 10 s), not now + 16 s; the second, 600 s old but recovered 5 s ago,
    # for its recovery's deadline (now + 15 s).
    assert sorted(waiting["due_us"].to_pylist()) == [now + 10 * US, now + 15 * US]


def test_a_retried_task_that_decides_its_clicks_otherwise_leaves_no_record_of_the_first_try(
    tmp_path: Path, servers: dict[str, str]
) -> None:
    """Found by review: a task's first try staged its clicks joined and died; Spark ran it again, and the retry gave
    them up (their queries' log lines gone, an adapter failing now): 0 joined rows, so no joined record written, and
    the first try's record, under the same key, was published beside the retry's unjoinable rows: each click decided
    twice. A retry writes a record of no files for each kind it has no rows of, and an empty retry file (the first
    try's clicks left waiting would be looked up again by the next batch)."""
    import pyarrow as pa

    from photon.joiner.publish import publish_files
    from photon.joiner.tasks import CANDIDATE, join_partition
    from photon.logs.schemas import JOINED_SCHEMA
    from photon.logs.tables import ensure_tables, stage_rows

    now = int(time.time() * US)
    task = partition_task(tmp_path, servers, now, 20 * US)
    root = tmp_path / "out" / "dc-a"
    ensure_tables(root)
    clicks = [f"10.0.0.1-5-{now - (600 + i) * US}" for i in range(3)]
    first = {f.name: [f"{f.name}-{i}" for i in range(3)] for f in JOINED_SCHEMA}
    first |= {"click_id": clicks, "click_ts_us": [now] * 3, "query_ts_us": [now] * 3, "joined_at_us": [now] * 3}
    first |= {"bid_micros": [1] * 3, "pipeline": ["dc-a"] * 3}
    assert stage_rows(root, "joined", task.stage, f"{task.tag}-p0000", pa.table(first, JOINED_SCHEMA), 1) == 3
    rows = pa.table(
        {
            "click_id": clicks, "click_ts_us": [now - (600 + i) * US for i in range(3)],
            "query_id": [f"10.0.0.2-6-{now - (601 + i) * US}" for i in range(3)], "ad_id": ["a1"] * 3,
            "attempts": pa.array([0] * 3, pa.int32()), "first_seen_us": [now - 600 * US] * 3, "due_us": [now] * 3,
            "recovered_us": pa.array([None] * 3, pa.int64()),
        },
        CANDIDATE,
    )  # fmt: skip
    waiting = tmp_path / "state" / "retries" / task.tag / f"{task.tag}-p0000.parquet"  # the first try's, too
    waiting.parent.mkdir(parents=True)
    pq.write_table(rows.slice(0, 1), waiting)
    counts, _ = join_partition(task, rows, 0, rerun=True)  # past their deadline, no query: given up
    assert (counts["joined"], counts["unjoinable"], counts["retried"]) == (0, 3, 0)
    assert pq.read_table(waiting).num_rows == 0  # none waits: the next batch does not look the click up again
    publish_files(root, "dc-a", 1, 1, expect={"joined": 0, "unjoinable": 3})
    assert output.ids(tmp_path / "out", "joined") == []
    assert sorted(output.ids(tmp_path / "out", "unjoinable")) == sorted(clicks)


def partition_task(tmp_path: Path, servers: dict[str, str], now: int, delay: int) -> Any:
    from photon.joiner.tasks import _Task

    return _Task(
        dc="dc-a",
        tag="b0000000001-e1",
        batch=1,
        root=str(tmp_path / "out" / "dc-a"),
        now=now,
        stage="_staging/b0000000001-e1",
        state=str(tmp_path / "state"),
        logs=str(tmp_path / "logs" / "dc-a" / "queries"),
        servers=tuple(servers.items()),
        token=(1 << 32) | 1,
        bucket_s=10,
        cache_buckets=4,
        cache_max_rows=1000,
        max_join_delay_us=delay,
        retry_base_s=1.0,
        retry_max_s=16.0,
        adapter="photon.joiner.adapter:default_adapter",
        max_future_s=60.0,
    )


def test_a_recovered_copy_lends_its_deadline_to_the_copy_kept(tmp_path: Path, servers: dict[str, str]) -> None:
    """A click waits in the retry set, past its own deadline (its pipeline's lease had stopped), when the verifier
    re-dispatches it: the two copies meet in one batch. Whichever is kept, its deadline runs from the recovery."""
    import pyarrow as pa

    from photon.joiner.tasks import CANDIDATE, join_partition

    now = int(time.time() * US)
    click, query = f"10.0.0.1-5-{now - 300 * US}", f"10.0.0.2-6-{now - 301 * US}"
    rows = pa.table(
        {
            "click_id": [click, click],
            "click_ts_us": [now - 300 * US, now - 300 * US],
            "query_id": [query, query],
            "ad_id": ["a1", "a1"],
            "attempts": pa.array([3, 0], pa.int32()),
            "first_seen_us": [now - 290 * US, now],  # the retry copy was seen first: it is the one kept
            "due_us": [now - 1, now],
            "recovered_us": pa.array([None, now], pa.int64()),
        },
        CANDIDATE,
    )
    counts, _ = join_partition(partition_task(tmp_path, servers, now, 20 * US), rows, 0)
    assert counts["unjoinable"] == 0 and counts["retried"] == 1
