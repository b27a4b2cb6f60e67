"""Consecutive leases as the join DAG runs them (one `photon join` process per lease, the next one a standby started
beside it): each hand-over happens when the current lease releases the pipeline, never by fencing a live one, and
the clicks of the whole run are joined exactly once, and no hand-over waits for a Spark start. (`make bench-handover`
measures the gaps and latency.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from bench.handover import run_leases

from photon.registry.admin import init_registry

pytestmark = pytest.mark.integration


def test_standby_leases_hand_over_on_release_and_join_everything_once(
    tmp_path: Path, make_db: Callable[[], str], login_as: Callable[[str, str], str]
) -> None:
    dsn = make_db()
    init_registry({"main": dsn}, num_shards=2)
    result = run_leases(tmp_path, login_as(dsn, "photon_joiner"), mode="standby", lease_s=10, seconds=30, rate=300)
    print(result)
    assert result["audit_ok"], result["failures"]
    assert result["leases"] >= 2  # at least one hand-over while the logs flowed (usually three leases)
    # The first lease found a new pipeline; every later one took over from a lease that released it.
    assert result["took_over"][0] == "new" and set(result["took_over"][1:]) == {"released"}, result["took_over"]
    # No hand-over waited for a Spark start (14-21 s here, cold; more under load): the next lease was warm, or the
    # lease before held on until it was. The goal is 2 s, which `make bench-handover` measures (0.2-0.9 s even at
    # load 12); 5 s leaves a loaded CI machine its scheduling hiccups and still fails any cold take-over.
    # (After the logs end a new lease's first batch waits for a retry to be due: only the hand-overs before count.)
    assert all(gap < 5.0 for gap in result["handover_gaps_s"]), result
