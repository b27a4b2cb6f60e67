"""Resharding against real PostgreSQL (two servers): planned, acknowledged, activated or aborted; a client on the old
configuration is refused; and a reshard from 4 to 12 shards across two servers while two joiners run."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from photon.audit import audit
from photon.generator import GeneratorSettings, generate
from photon.ids import make_id
from photon.joiner import Joiner, JoinSettings
from photon.owners import create_owner
from photon.pipeline_state import PipelineState
from photon.registry import IdRegistry, Outcome, RegistryOptions, StaleLayoutError
from photon.registry_admin import init_registry, status
from photon.reshard import reshard

pytestmark = pytest.mark.integration
US = 1_000_000


@pytest.fixture
def servers(make_db: Callable[[], str]) -> dict[str, str]:
    s = {"main": make_db(), "pg2": make_db()}
    init_registry(s, num_shards=4)
    return s


def rows_by_config(servers: dict[str, str]) -> dict[tuple[int, str], int]:
    out: dict[tuple[int, str], int] = {}
    for cfg in status(servers)["configs"]:
        for sh in cfg["shards"]:
            key = (cfg["version"], sh["server"])
            out[key] = out.get(key, 0) + sh["rows"]
    return out


def test_activation_routes_by_timestamp_and_refuses_a_held_client(servers: dict[str, str]) -> None:
    held = IdRegistry(servers, RegistryOptions(follow_layout=False))
    held.layout()  # loaded before the reshard, and never reloaded
    report = reshard(servers, num_shards=12, placement=["main", "pg2"], lead_s=3, max_clock_skew_s=1)
    assert report.state == "active" and report.version == 2
    before, after = report.valid_from_us - 1_000, report.valid_from_us + 1_000
    owner = create_owner(servers["main"], "dc-a")
    with pytest.raises(StaleLayoutError):
        held.register([make_id("10.0.0.1", 1, after)], owner.token(1))
    ids = [make_id("10.0.0.1", 1, before + i) for i in range(200)] + [
        make_id("10.0.0.2", 1, after + i) for i in range(600)
    ]
    res = IdRegistry(servers).register(ids, owner.token(2))
    assert (res.outcomes == Outcome.WON).all()
    rows = rows_by_config(servers)
    assert rows[(1, "main")] == 200  # before valid_from: the old configuration's shards
    assert rows[(2, "main")] + rows[(2, "pg2")] == 600 and rows[(2, "pg2")] > 100  # after: 12 shards, two servers
    # The held client is refused for any id, so it can never write to a shard the new layout does not name.
    with pytest.raises(StaleLayoutError):
        held.register([make_id("10.0.0.3", 1, before)], owner.token(3))


def test_a_live_joiner_that_does_not_acknowledge_aborts_the_plan(servers: dict[str, str]) -> None:
    state = PipelineState(servers["main"], "dc-a")
    lease = state.start_lease()
    state.commit(lease, 1, [], None, config_version=1)  # alive (just committed), on configuration 1
    report = reshard(servers, num_shards=8, lead_s=3, max_clock_skew_s=1)
    assert report.state == "aborted" and "dc-a" in report.reason and report.acknowledged == {"dc-a": 1}
    st = status(servers)
    assert [(c["version"], c["state"]) for c in st["configs"]] == [(1, "active"), (2, "aborted")]
    assert st["configs"][1]["shards"] == []  # the plan's shard tables and map are gone
    res = IdRegistry(servers).register([make_id("10.0.0.1", 1, int(time.time() * US) + 10 * US)], lease.token(2))
    assert res.outcomes.tolist() == [Outcome.WON]  # still the old layout, nothing refused


def test_reshard_4_to_12_across_two_servers_while_two_joiners_run(
    tmp_path: Path, servers: dict[str, str], spark: Any
) -> None:
    logs, out = tmp_path / "logs", tmp_path / "out"
    settings = GeneratorSettings(
        events_per_s=800, max_join_delay_s=30, late_query_file_fraction=0.0, late_click_fraction=0.0
    )
    now = int(time.time() * US)
    done, errors, reports = threading.Event(), [], []

    def gen() -> None:
        generate(settings, logs, start_us=now, end_us=now + 40 * US, live=True)
        done.set()

    def join(dc: str) -> None:
        try:
            j = Joiner(dc, logs, out, servers, spark, JoinSettings(max_join_delay_s=30))
            while not done.is_set():
                j.run(run_for_s=3)
            j.run(until_caught_up=True, drain=True)
        except BaseException as exc:
            errors.append(exc)

    def plan() -> None:
        time.sleep(6)  # both joiners are committing batches by now
        reports.append(reshard(servers, num_shards=12, placement=["main", "pg2"], lead_s=25, max_clock_skew_s=10))

    threads = [
        threading.Thread(target=f, args=a) for f, a in ((gen, ()), (join, ("dc-a",)), (join, ("dc-b",)), (plan, ()))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert reports[0].state == "active" and set(reports[0].acknowledged) == {"dc-a", "dc-b"}
    report = audit(out, manifest=logs / "_manifest")
    assert report.ok, report.failures()
    assert report.duplicate_clicks == 0 and report.lost == 0
    rows = rows_by_config(servers)
    assert rows.get((1, "main"), 0) > 0 and rows.get((2, "main"), 0) > 0 and rows.get((2, "pg2"), 0) > 0
