"""Consecutive leases as the join DAG runs them (one `photon join` process per lease, the next one a standby started
beside it): each hand-over happens when the current lease releases the pipeline, never by fencing a live one, and
the clicks of the whole run are joined exactly once. (`make bench-handover` measures the gaps and latency.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from bench.handover import run_leases

from photon.registry_admin import init_registry

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
