"""Leases and batch commits: fencing by epoch (DistributedLog) and in-order, idempotent commits (Pravega)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from photon.joiner.state import FencedError, PipelineState
from photon.pg import autocommit
from photon.registry.admin import init_registry

pytestmark = pytest.mark.integration


@pytest.fixture
def state(make_db: Callable[[], str], login_as: Callable[[str, str], str]) -> PipelineState:
    dsn = make_db()
    init_registry({"main": dsn}, num_shards=1)
    return PipelineState(login_as(dsn, "photon_joiner"), "dc-a")  # as a joiner runs: never the owner


def test_a_zombie_lease_can_never_commit_after_its_successor_started(state: PipelineState) -> None:
    old = state.start_lease()
    assert state.commit(old, 1, [("clicks", "f1.jsonl")]) is True
    new = state.start_lease()
    assert new.epoch == old.epoch + 1 and new.last_batch == 1
    with pytest.raises(FencedError, match=f"epoch {old.epoch} was fenced by lease epoch {new.epoch}, held by "):
        state.commit(old, 2, [("clicks", "f2.jsonl")])
    with pytest.raises(FencedError):
        state.heartbeat(old)
    assert state.consumed() == {("clicks", "f1.jsonl")}  # the zombie moved nothing
    assert state.commit(new, 2, [("clicks", "f2.jsonl")]) is True
    assert [b for b, _, _ in state.batches()] == [1, 2]


def test_commits_are_in_order_and_idempotent(state: PipelineState) -> None:
    lease = state.start_lease()
    assert state.commit(
        lease,
        1,
        [("queries", "q1.jsonl")],
        {
            "started_at_us": 1,
            "duration_s": 0.5,
            "query_files": 1,
            "click_files": 0,
            "queries": 3,
            "clicks": 0,
            "retries_in": 0,
            "prefiltered": 0,
            "joined": 0,
            "won_again": 0,
            "wasted": 0,
            "retried": 0,
            "unjoinable": 0,
            "quarantined": 0,
            "cache_hits": 0,
            "cache_lookups": 0,
            "registry_txns": 0,
            "registry_rows": 0,
            "registry_retries": 0,
        },
    )
    assert state.commit(lease, 1, [("queries", "q1.jsonl")]) is False  # the same batch again: a no-op
    with pytest.raises(FencedError, match="out of order"):
        state.commit(lease, 3, [])
    with autocommit(state.dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT last_batch FROM photon.pipelines WHERE pipeline = 'dc-a'")
        assert cur.fetchone()[0] == 1
        cur.execute("SELECT queries FROM photon.batch_metrics WHERE pipeline = 'dc-a' AND batch_seq = 1")
        assert cur.fetchone()[0] == 3


def test_tokens_name_the_pipeline_and_batch_not_the_lease(state: PipelineState) -> None:
    first, second = state.start_lease(), state.start_lease()
    assert first.token(7) == second.token(7)  # a re-run of batch 7 reclaims its own registrations
    assert first.token(7) != first.token(8)
