"""Where a live pipeline starts reading, and the history before it left to the backfills, exactly once across the
boundary (README, "Where a live pipeline starts"): real PostgreSQL as least-privilege logins, real local Spark,
generated logs, the independent auditor."""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg2
import pytest
from typer.testing import CliRunner

from photon.cli import app
from photon.joiner.common import NOW, JoinSettings
from photon.joiner.discovery import first_event_us
from photon.joiner.lease import Joiner
from photon.joiner.state import PipelineState
from photon.logs.layout import log_path, part_of_name, partition_of
from photon.pg import autocommit
from photon.registry.admin import init_registry
from photon.tools.audit import audit
from photon.tools.generator import GeneratorSettings, generate
from photon.tools.status import lag_lines, pipeline_status
from tests.integration import output

pytestmark = pytest.mark.integration
US = 1_000_000
MINUTE_US = 60 * US
HOUR_US = 3_600 * US


def consumed_clicks(dsn: str, pipeline: str) -> set[str]:
    with autocommit(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT name FROM photon.consumed_files WHERE pipeline = %s AND kind = 'clicks'", (pipeline,))
        return {str(n) for (n,) in cur.fetchall()}


def joined(out: Path, pipeline: str) -> list[dict[str, Any]]:
    return output.rows(out, "joined", pipeline)


def test_a_pipelines_start_is_recorded_once_and_never_moves(
    make_db: Callable[[], str], login_as: Callable[[str, str], str]
) -> None:
    """'now' is the registry server's clock in the transaction that creates the pipeline; a later lease asking for
    another start keeps the recorded one; the joiner's login cannot move it, and neither can the owner's."""
    dsn = make_db()
    init_registry({"main": dsn}, num_shards=1)
    joiner = login_as(dsn, "photon_joiner")
    with autocommit(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT photon.clock_us()")
        before = int(cur.fetchone()[0])
    state = PipelineState(joiner, "dc-a")
    first = state.start_lease(start=NOW)
    assert first is not None and first.start_us is not None and before <= first.start_us < before + 10 * US
    again = state.start_lease(start=before - HOUR_US)  # a later lease (a restart with other options) asks again
    assert again is not None and again.start_us == first.start_us and again.epoch == first.epoch + 1
    beginning = PipelineState(joiner, "dc-b").start_lease()  # the default: the beginning of the logs
    assert beginning is not None and beginning.start_us is None
    for who, error in ((joiner, psycopg2.errors.InsufficientPrivilege), (dsn, psycopg2.errors.CheckViolation)):
        with pytest.raises(error), autocommit(who) as conn, conn.cursor() as cur:
            cur.execute("UPDATE photon.pipelines SET start_us = 0 WHERE pipeline = 'dc-a'")
    last = state.start_lease()
    assert last is not None and last.start_us == first.start_us


def test_join_refuses_a_start_for_a_backfill_window(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    args = ["join", "--dc", "dc-a", "--logs", str(tmp_path / "logs"), "--out", str(tmp_path / "out")]
    args += ["--until-caught-up", "--start", "now"]
    args += ["--window-start", "2026-11-20T00:00", "--window-end", "2026-11-20T01:00"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code != 0 and "--start is a live pipeline's" in str(result.exception)


def test_history_before_the_start_is_the_backfills_exactly_once(
    tmp_path: Path,
    make_db: Callable[[], str],
    login_as: Callable[[str, str], str],
    spark: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Twenty-four minutes of dc-a history (clicks up to 10 minutes after their query), then a live pipeline
    created with a start in its middle. It joins only what arrived from its start on, history stays for the
    backfill, and `photon status` names the hour nobody has consumed yet. Two history click files turn up after the
    start: one in its old partition (a historical copy, as `photon generate --mode historical` writes after a live
    start), one in the partition of now (a replica catching up). The live pipeline joins the late one (the rules
    for late files hold); the backfill of the hour then joins the rest of the history. Audit: nothing lost, nothing
    twice. Last, a pipeline started at the beginning of the same logs is about to chew the history: it says so, and
    status shows it behind the logs."""
    dsn = make_db()
    init_registry({"main": dsn}, num_shards=2)
    servers = {"main": login_as(dsn, "photon_joiner")}
    verifier = login_as(dsn, "photon_verifier")
    logs, out = tmp_path / "logs", tmp_path / "out"
    h0 = (int(time.time() * US) // HOUR_US - 2) * HOUR_US  # an hour that ended more than an hour ago
    generated = GeneratorSettings(
        dcs=("dc-a",),
        events_per_s=1.5,
        query_servers=2,
        click_servers=2,
        clicks_per_query=0.5,
        late_click_fraction=0.3,
        late_click_max_s=600.0,
        rotate_s=30.0,
        chunk_s=60.0,
        malformed_fraction=0.0,
    )
    generate(generated, logs, start_us=h0, end_us=h0 + 24 * MINUTE_US)
    start = h0 + 12 * MINUTE_US + 30 * US
    clicks = logs / "dc-a" / "clicks"
    files = sorted(str(p.relative_to(clicks)) for p in clicks.rglob("*.jsonl"))
    history = [f for f in files if (part_of_name(f) or "") < partition_of(start) and first_event_us(clicks / f) < start]
    # Two history files held back, to turn up after the start: the oldest one, and one from just before the start.
    held = {f: tmp_path / "held" / f for f in (history[0], history[-1])}
    for f, to in held.items():
        to.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(clicks / f, to)

    live = Joiner("dc-a", logs, out, servers, spark, JoinSettings(trigger_interval_s=0.1, start=start))
    live.run(until_caught_up=True, drain=True)
    live.release()
    taken = consumed_clicks(dsn, "dc-a")
    mine = [(part_of_name(f) or "") >= partition_of(start) or first_event_us(clicks / f) >= start for f in taken]
    assert taken and all(mine)
    assert not taken & set(history)
    # Clicks after the start whose query came before it: found in the shared query index its first lease built.
    rows = joined(out, "dc-a")
    assert rows and min(r["click_ts_us"] for r in rows) >= start - 2 * MINUTE_US  # a file spans 30 s, and skew
    assert any(r["query_ts_us"] < start - 2 * MINUTE_US for r in rows), "no click joined to a query before the start"

    # History turns up after the start: in its old, sealed partition, and (a replica catching up) in the one of now.
    old, late = held
    shutil.move(held[old], clicks / old)
    now_path = log_path(logs, "dc-a", "clicks", Path(late).name, int(time.time() * US))
    now_path.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(held[late], now_path)
    late_rel = str(now_path.relative_to(clicks))
    live = Joiner("dc-a", logs, out, servers, spark, JoinSettings(trigger_interval_s=0.1, start=start))
    live.run(until_caught_up=True, drain=True)
    live.release()
    assert late_rel in consumed_clicks(dsn, "dc-a") and old not in consumed_clicks(dsn, "dc-a")

    # Status, as the verifier's login: the live pipeline is caught up, and the history before its start that no
    # pipeline has consumed is named by the hour of its first events.
    record = {r["pipeline"]: r for r in pipeline_status(verifier, logs=logs, out=out)}["dc-a"]
    assert record["start_us"] == start and record["behind_s"] == 0.0
    hour = datetime.fromtimestamp(h0 / US, UTC).strftime("%Y-%m-%dT%H")
    assert record["history"]["files"] == len(history) - 1 and record["history"]["hours"] == [hour]
    assert any("history before its start" in line for line in lag_lines(record))

    # The backfill of the hour that starts before the start (photon_backfill's run for it).
    name = f"backfill-dc-a-{datetime.fromtimestamp(h0 / US, UTC):%Y%m%d%H%M}"
    window = JoinSettings(trigger_interval_s=0.1, window_start_us=h0, window_end_us=h0 + HOUR_US)
    backfill = Joiner("dc-a", logs, out, servers, spark, window, pipeline=name)
    backfill.run(until_caught_up=True, drain=True)
    backfill.release()
    assert set(history) - {late} <= consumed_clicks(dsn, name)
    report = audit(out, manifest=logs / "_manifest")
    assert report.lost == 0 and report.duplicate_clicks == 0, (report.failures(), report.unjoinable_by_reason)
    assert report.ok, report.failures()
    late_ids = {line.split('"click_id": "')[1].split('"')[0] for line in now_path.read_text().splitlines()}
    assert late_ids & {r["click_id"] for r in joined(out, "dc-a")}  # the late file's clicks: the live pipeline's
    assert not late_ids & {r["click_id"] for r in joined(out, name)}
    record = {r["pipeline"]: r for r in pipeline_status(verifier, logs=logs, out=out)}["dc-a"]
    assert record["history"]["files"] == 0 and record["history"]["hours"] == []

    # A pipeline started at the beginning of the same logs (the default) is to join the history itself: it says so
    # when it starts, and status shows how far behind the logs it is (not only, later, its latency).
    caplog.set_level(logging.WARNING, logger="photon.joiner.lease")
    replay = Joiner("dc-a", logs, tmp_path / "out-replay", servers, spark, JoinSettings(), pipeline="replay")
    replay.start()
    replay.release()
    assert any("joins their history itself" in r.getMessage() for r in caplog.records)
    record = {r["pipeline"]: r for r in pipeline_status(verifier, logs=logs, out=tmp_path / "out-replay")}["replay"]
    assert record["start_us"] is None and record["history"] is None
    assert record["behind_s"] >= 30 * 60, record
    assert lag_lines(record)[0].endswith("behind the logs")


def test_a_new_pipelines_first_lease_heartbeats_while_it_indexes_the_queries_before_its_start(
    tmp_path: Path,
    make_db: Callable[[], str],
    login_as: Callable[[str, str], str],
    spark: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first lease of a pipeline created with a start indexes every sealed query partition from the horizon to
    its start before its first batch: minutes for two hours of history on a loaded machine (issue 22's newcomer
    pass through `make airflow`). Without a heartbeat meanwhile, the other lease slot's standby took it for dead
    after 15 s and fenced it, built the same index again, and the first lease's task failed with FencedError. So the
    lease heartbeats while it builds: the real build is held here until the registry shows a heartbeat after the
    lease's start (never, on the code before)."""
    import photon.joiner.query_index as query_index

    dsn = make_db()
    init_registry({"main": dsn}, num_shards=1)
    servers = {"main": login_as(dsn, "photon_joiner")}
    logs, out = tmp_path / "logs", tmp_path / "out"
    h0 = (int(time.time() * US) // HOUR_US - 1) * HOUR_US
    history = GeneratorSettings(
        dcs=("dc-a",), events_per_s=1.0, query_servers=1, click_servers=1, rotate_s=30.0, chunk_s=60.0
    )
    generate(history, logs, start_us=h0, end_us=h0 + 4 * MINUTE_US)
    build = query_index.ensure_indexed
    beat_while_building: list[bool] = []

    def held_build(*args: Any, **kwargs: Any) -> dict[str, Any]:
        built = build(*args, **kwargs)
        deadline = time.monotonic() + 20  # 100 heartbeat periods
        with autocommit(dsn) as conn, conn.cursor() as cur:
            while time.monotonic() < deadline:
                cur.execute("SELECT heartbeat_at > lease_started_at FROM photon.pipelines WHERE pipeline = 'dc-a'")
                if cur.fetchone()[0]:
                    beat_while_building.append(True)
                    break
                time.sleep(0.05)
        return built

    monkeypatch.setattr(query_index, "ensure_indexed", held_build)
    settings = JoinSettings(trigger_interval_s=0.1, heartbeat_s=0.2, start=h0 + 3 * MINUTE_US)
    live = Joiner("dc-a", logs, out, servers, spark, settings)
    live.start()
    live.release()
    assert beat_while_building, "the lease's heartbeat never moved while it built the shared query index"
    assert Path(query_index.index_root(out, "dc-a").url).is_dir()  # the real build ran


def test_a_start_asked_of_an_existing_pipeline_warns_that_it_resumes_from_its_committed_position(
    tmp_path: Path, servers: dict[str, str], spark: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """`--start now` (or a time) on a pipeline that exists is ignored, and says so, 'now' as well as a time."""
    (tmp_path / "logs" / "dc-a" / "clicks").mkdir(parents=True)
    state = PipelineState(servers["main"], "dc-a")
    first = state.start_lease(start=NOW)
    state.commit(first, 1, [])
    caplog.set_level(logging.WARNING, logger="photon.joiner.lease")
    for asked, said in ((NOW, "(now)"), (first.start_us - HOUR_US, "T")):
        caplog.clear()
        Joiner("dc-a", tmp_path / "logs", tmp_path / "out", servers, spark, JoinSettings(start=asked)).start()
        lines = [r.getMessage() for r in caplog.records]
        assert any(
            "dc-a: resumes from its committed position (after batch 1); the start asked for (" in m and said in m
            for m in lines
        ), lines
    caplog.clear()
    Joiner("dc-a", tmp_path / "logs", tmp_path / "out", servers, spark, JoinSettings()).start()  # the default
    assert not [r for r in caplog.records if "start asked for" in r.getMessage()]
