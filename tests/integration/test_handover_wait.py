"""The end of a lease, as the hand-over needs it: a lease never leaves the pipeline idle while its successor is still
starting its Spark session (it joins on until the standby is ready, within a bound), ends right after a batch rather
than idle through one more trigger, and a standby's warm-up runs the batch's own job without writing anything the
pipeline reads. Each failed before: the lease ended on time whatever the standby's state (a gap of a Spark start
when the standby was late: 22 s once with 30 s leases), and the warm-up left the first batch after a take-over to
pay for the first shuffle and the workers' imports (2-3 s against 0.3-0.5 s for a batch)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from psycopg2 import sql

from photon.joiner.common import JoinSettings
from photon.joiner.lease import Joiner
from photon.joiner.state import PipelineState, StandbyAnnouncement
from photon.pg import autocommit
from photon.registry.admin import init_registry

pytestmark = pytest.mark.integration


@contextmanager
def standby(state: PipelineState) -> Iterator[StandbyAnnouncement]:
    """A standby announcing itself from another thread, as a `photon join --standby` process does from its start."""
    entered = threading.Event()
    leave = threading.Event()
    box: list[StandbyAnnouncement] = []

    def run() -> None:
        with state.standing_by(every_s=0.2) as announcement:
            assert announcement.announced.wait(10)  # made from a thread, never holding up the standby
            box.append(announcement)
            entered.set()
            leave.wait()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert entered.wait(10)
    try:
        yield box[0]
    finally:
        leave.set()
        thread.join(10)


def joiner(tmp_path: Path, servers: dict[str, str], trigger_s: float = 0.1, spark: Any = None) -> Joiner:
    (tmp_path / "logs" / "dc-a" / "clicks").mkdir(parents=True, exist_ok=True)
    settings = JoinSettings(parallelism=1, trigger_interval_s=trigger_s, heartbeat_s=0.5)
    return Joiner("dc-a", tmp_path / "logs", tmp_path / "out", servers, spark, settings)


def test_a_lease_joins_on_past_its_term_while_its_standby_starts_and_ends_once_it_is_ready(
    tmp_path: Path, servers: dict[str, str]
) -> None:
    j = joiner(tmp_path, servers)
    j.start()
    state = PipelineState(servers["main"], "dc-a")
    with standby(state) as announcement:
        assert state.successor() == "starting"
        threading.Timer(3.0, announcement.ready).start()  # warm 3 s from now: 2 s after the lease's term
        t0 = time.monotonic()
        j.run(run_for_s=1.0, hand_over_wait_s=60)
        took = time.monotonic() - t0
        assert state.successor() == "ready"
    assert 2.8 <= took < 8.0, took  # was: 1 s, the standby still starting (the bound only says: not the 60 s)
    assert 1.5 <= j.held_s < 4.0, j.held_s
    assert state.successor() is None  # withdrawn at its take-over (here: the block's end)


def test_the_wait_is_bounded_and_only_for_a_standby_that_is_coming(tmp_path: Path, servers: dict[str, str]) -> None:
    j = joiner(tmp_path, servers)
    j.start()
    state = PipelineState(servers["main"], "dc-a")
    t0 = time.monotonic()
    j.run(run_for_s=1.0, hand_over_wait_s=60)  # nobody is coming: on time
    assert time.monotonic() - t0 < 2.0 and j.held_s < 0.5
    with standby(state):  # starting, and never ready
        t0 = time.monotonic()
        j.run(run_for_s=1.0, hand_over_wait_s=1.5)
        assert 2.3 <= time.monotonic() - t0 < 6.0
        t0 = time.monotonic()
        j.run(run_for_s=1.0)  # no wait asked for (a backfill, a test): on time
        assert time.monotonic() - t0 < 2.0
    # A standby that died while starting (its announcement no longer refreshed) is not waited for.
    state.announce_standby("starting", holder="elsewhere:1")
    assert state.successor(fresh_s=0.5) == "starting"
    time.sleep(1.0)
    assert state.successor(fresh_s=0.5) is None


def test_a_lease_ends_right_after_a_batch_when_its_term_ends_before_the_next_trigger(
    tmp_path: Path, servers: dict[str, str]
) -> None:
    """Was: it slept through one more trigger interval and listed the logs again before it noticed its term was over,
    and only then released the pipeline to the standby waiting for it."""
    j = joiner(tmp_path, servers, trigger_s=3.0)
    j.start()
    t0 = time.monotonic()
    j.run(run_for_s=2.0, hand_over_wait_s=60)
    assert time.monotonic() - t0 < 2.5  # was: more than 3 s (one empty batch, then a whole trigger interval)


def test_the_standby_warm_up_runs_a_batch_job_and_writes_nothing_the_pipeline_reads(
    tmp_path: Path,
    make_db: Callable[[], str],
    login_as: Callable[[str, str], str],
    spark: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    dsn = make_db()
    init_registry({"main": dsn}, num_shards=2)
    j = joiner(tmp_path, {"main": login_as(dsn, "photon_joiner")}, spark=spark)
    out = tmp_path / "out"
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    # The joiner made its empty tables; the warm-up must add no file anywhere under --out.
    assert "dc-a/joined/_delta_log/00000000000000000000.json" in before
    with caplog.at_level(logging.WARNING, logger="photon.joiner"):
        j.warm_up()
    assert not [r for r in caplog.records if "warm-up" in r.getMessage()], caplog.text  # it ran, and as expected
    # Its own folder under _staging, removed after.
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == sorted([*before, "dc-a/_staging"])
    with autocommit(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT table_name FROM photon.shard_state")
        tables = [t for (t,) in cur.fetchall()]
        rows = 0
        for t in tables:
            cur.execute(sql.SQL("SELECT count(*) FROM photon.{}").format(sql.Identifier(t)))
            rows += int(cur.fetchone()[0])
        cur.execute("SELECT count(*) FROM photon.pipelines")
        pipelines = int(cur.fetchone()[0])
    assert tables and rows == 0 and pipelines == 0  # nothing registered, no lease taken
