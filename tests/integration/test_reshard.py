"""Resharding against real PostgreSQL (two servers): planned, acknowledged, activated or aborted; a client on the old
configuration is refused; and a reshard from 4 to 12 shards across two servers while two joiners run."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg2
import psycopg2.errors
import pytest

from photon.joiner.common import JoinSettings
from photon.joiner.lease import Joiner
from photon.joiner.state import PipelineState
from photon.logs.ids import make_id
from photon.pg import autocommit, connect
from photon.registry import reshard as reshard_mod
from photon.registry.admin import init_registry, status
from photon.registry.client import IdRegistry, Outcome, RegistryOptions, StaleLayoutError
from photon.registry.owners import create_owner
from photon.registry.reshard import (
    Plan,
    ReshardError,
    ReshardInProgressError,
    abort,
    activate,
    plan,
    reshard,
    resume,
)
from photon.tools.audit import audit
from photon.tools.generator import GeneratorSettings, generate

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


def test_a_reshard_completes_while_both_joiners_are_live_but_idle_and_they_then_route_by_it(
    tmp_path: Path, servers: dict[str, str], spark: Any, login_as: Callable[[str, str], str]
) -> None:
    """A quiet night: both data centers' joiners run (heartbeating) but no log arrives, so no batch commits. Each
    acknowledges the plan between batches, fenced by its lease, and the reshard activates (it aborted before: "not
    acknowledged before the deadline by: dc-a, dc-b"). The logs that come after ``valid_from`` are then registered
    in the new configuration's shards only, on both servers, each click once."""
    as_joiner = {name: login_as(dsn, "photon_joiner") for name, dsn in servers.items()}
    as_reshard = {name: login_as(dsn, "photon_reshard") for name, dsn in servers.items()}
    logs, out = tmp_path / "logs", tmp_path / "out"
    for dc in ("dc-a", "dc-b"):
        for kind in ("queries", "clicks"):
            (logs / dc / kind).mkdir(parents=True)
    settings = JoinSettings(max_join_delay_s=30, trigger_interval_s=0.2, heartbeat_s=0.5, max_clock_skew_s=1)
    joiners = {dc: Joiner(dc, logs, out, as_joiner, spark, settings) for dc in ("dc-a", "dc-b")}
    results: dict[str, list[Any]] = {}
    threads = [
        threading.Thread(target=lambda dc=dc: results.update({dc: joiners[dc].run(run_for_s=8)})) for dc in joiners
    ]
    for t in threads:
        t.start()
    time.sleep(1)  # both leases started, idle
    report = reshard(as_reshard, num_shards=12, placement=["main", "pg2"], lead_s=4, max_clock_skew_s=1)
    for t in threads:
        t.join()
    assert report.state == "active", report.reason
    assert report.acknowledged == {"dc-a": 2, "dc-b": 2}
    assert results == {"dc-a": [], "dc-b": []}  # no batch: acknowledged while idle

    # Clicks stamped after valid_from, joined by the joiners that acknowledged v2 while idle.
    time.sleep(max(0.0, report.valid_from_us / US + 6 - time.time()))
    gen = GeneratorSettings(
        events_per_s=400,
        max_join_delay_s=30,
        max_clock_skew_s=1.0,
        late_query_file_fraction=0.0,
        late_click_fraction=0.0,
    )
    generate(gen, logs, start_us=report.valid_from_us + 2 * US, end_us=report.valid_from_us + 5 * US)
    for j in joiners.values():
        j.run(until_caught_up=True, drain=True)
    rows = rows_by_config(servers)
    assert rows.get((1, "main"), 0) == 0  # nothing went by the old layout
    assert rows.get((2, "main"), 0) > 0 and rows.get((2, "pg2"), 0) > 0
    audited = audit(out, manifest=logs / "_manifest")
    assert audited.ok and audited.duplicate_clicks == 0 and audited.lost == 0, audited.failures()


# Bad days: two reshards at once, a crash or a slow lock in the middle of activation, a server whose clock is past
# the deadline, and resharding as a least-privilege login.


@pytest.fixture
def spread(make_db: Callable[[], str]) -> dict[str, str]:
    """Configuration 1 already on both servers, so an old-layout client writes to pg2 as well as main."""
    s = {"main": make_db(), "pg2": make_db()}
    init_registry(s, num_shards=4, placement=["main", "pg2"])
    return s


def enforced(servers: dict[str, str]) -> dict[str, int]:
    out = {}
    for name, dsn in servers.items():
        with autocommit(dsn) as conn, conn.cursor() as cur:
            cur.execute("SELECT version FROM photon.layout_enforced")
            out[name] = int(cur.fetchone()[0])
    return out


def states(servers: dict[str, str]) -> dict[str, dict[int, str]]:
    out = {}
    for name, dsn in servers.items():
        with autocommit(dsn) as conn, conn.cursor() as cur:
            cur.execute("SELECT version, state FROM photon.shard_config ORDER BY version")
            out[name] = {int(v): str(s) for v, s in cur.fetchall()}
    return out


def tables(dsn: str) -> set[str]:
    with autocommit(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT c.relname FROM pg_class c WHERE c.relname ~ '^ids_c[0-9]+_s[0-9]+$'")
        return {str(r[0]) for r in cur.fetchall()}


def ids_on(servers: dict[str, str], layout_of: IdRegistry, server: str, n: int = 50) -> list[str]:
    """Ids stamped now that the client's layout routes to ``server``."""
    now = int(time.time() * US)
    layout = layout_of.layout()
    ids = [make_id("10.9.0.1", 1, now + i) for i in range(2_000)]
    return [i for i in ids if layout.server_of(layout.shard_of(i)) == server][:n]


def test_two_reshards_at_once_take_one_version_and_the_loser_is_refused(servers: dict[str, str]) -> None:
    barrier, got = threading.Barrier(2), []

    def start() -> None:
        barrier.wait()
        try:
            got.append(plan(servers, num_shards=8, placement=["main", "pg2"], lead_s=60, max_clock_skew_s=1))
        except ReshardInProgressError as exc:
            got.append(exc)

    threads = [threading.Thread(target=start) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    plans = [g for g in got if isinstance(g, Plan)]
    assert len(plans) == 1 and len(got) == 2, got  # today's code gave both the same version 2
    assert "v2 is already planned" in str(next(g for g in got if isinstance(g, ReshardInProgressError)))
    assert states(servers)["main"] == {1: "active", 2: "planned"}
    # A third reshard (the CLI while the DAG's plan waits) is refused too, and takes nothing.
    with pytest.raises(ReshardInProgressError):
        reshard(servers, num_shards=12, lead_s=60, max_clock_skew_s=1)
    assert states(servers)["main"] == {1: "active", 2: "planned"}


def test_abort_never_removes_an_active_configuration(servers: dict[str, str]) -> None:
    report = reshard(servers, num_shards=8, placement=["main", "pg2"], lead_s=3, max_clock_skew_s=1)
    assert report.state == "active"
    before = tables(servers["main"]) | tables(servers["pg2"])
    assert {f"ids_c2_s{i}" for i in range(8)} <= before
    with pytest.raises(ReshardError, match="active"):
        abort(servers, 2)
    for dsn in servers.values():  # each server refuses on its own, too
        with autocommit(dsn) as conn, conn.cursor() as cur, pytest.raises(psycopg2.Error, match="active"):
            cur.execute("SELECT photon.abort_plan(2, 1)")
    assert tables(servers["main"]) | tables(servers["pg2"]) == before
    assert states(servers) == {"main": {1: "active", 2: "active"}, "pg2": {1: "active", 2: "active"}}
    assert enforced(servers) == {"main": 2, "pg2": 2}


def test_a_server_whose_clock_is_past_the_deadline_never_enforces_and_the_plan_aborts(
    servers: dict[str, str],
) -> None:
    with autocommit(servers["pg2"]) as conn, conn.cursor() as cur:  # pg2's clock runs an hour ahead
        cur.execute(
            "CREATE OR REPLACE FUNCTION photon.clock_us() RETURNS bigint LANGUAGE sql VOLATILE AS"
            " $$ SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint + 3600000000 $$"
        )
    report = reshard(servers, num_shards=8, placement=["main", "pg2"], lead_s=3, max_clock_skew_s=1)
    assert report.state == "aborted" and "too late to enforce v2" in report.reason
    assert enforced(servers) == {"main": 0, "pg2": 0}  # main rolled back, pg2 refused (0: as init left them)
    assert states(servers) == {"main": {1: "active", 2: "aborted"}, "pg2": {1: "active", 2: "aborted"}}
    assert not {t for t in tables(servers["main"]) | tables(servers["pg2"]) if t.startswith("ids_c2_")}


def test_activation_waits_for_writers_in_flight_only_until_the_deadline(servers: dict[str, str]) -> None:
    writer = connect(servers["main"])  # a register transaction in flight holds the layout row FOR SHARE
    try:
        with writer.cursor() as cur:
            cur.execute("SELECT version FROM photon.layout_enforced FOR SHARE")
        report = reshard(servers, num_shards=8, lead_s=3, max_clock_skew_s=1, lock_timeout_s=0.3)
    finally:
        writer.rollback()
        writer.close()
    assert report.state == "aborted" and "deadline" in report.reason
    assert enforced(servers) == {"main": 0, "pg2": 0}
    assert states(servers)["main"] == {1: "active", 2: "aborted"}


def crash_after_first_enforcement(monkeypatch: pytest.MonkeyPatch) -> None:
    """The activator dies right after pg2 enforced v, before main commits (main's transaction rolls back)."""
    real = reshard_mod._enforce

    def enforce_then_crash(dsn: str, version: int, *, activate: bool, lock_timeout_s: float) -> None:
        real(dsn, version, activate=activate, lock_timeout_s=lock_timeout_s)
        raise SystemExit("activator killed")

    monkeypatch.setattr(reshard_mod, "_enforce", enforce_then_crash)


def crashed_mid_activation(spread: dict[str, str], monkeypatch: pytest.MonkeyPatch, lead_s: float) -> tuple[Any, Any]:
    """A client held on the old layout, and a plan to 8 shards whose activator died after pg2 enforced it."""
    held = IdRegistry(spread, RegistryOptions(follow_layout=False))
    held.layout()
    p = plan(spread, num_shards=8, placement=["main", "pg2"], lead_s=lead_s, max_clock_skew_s=1)
    crash_after_first_enforcement(monkeypatch)
    with pytest.raises(SystemExit):
        activate(spread, p.version)
    monkeypatch.undo()
    return held, p


def test_a_crash_mid_activation_refuses_old_clients_and_resume_activates_everywhere(
    spread: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    held, p = crashed_mid_activation(spread, monkeypatch, lead_s=30)
    # The partial state: pg2 enforces v2, main does not say active. An old-layout client may not write there.
    assert enforced(spread) == {"main": 0, "pg2": 2} and states(spread)["main"][2] == "planned"
    owner = create_owner(spread["main"], "dc-a")
    with pytest.raises(StaleLayoutError):
        held.register(ids_on(spread, held, "pg2"), owner.token(1))
    assert resume(spread, p.version) == "active"
    assert enforced(spread) == {"main": 2, "pg2": 2}
    assert states(spread) == {"main": {1: "active", 2: "active"}, "pg2": {1: "active", 2: "active"}}
    reg = IdRegistry(spread)
    assert (reg.register(ids_on(spread, reg, "pg2"), owner.token(2)).outcomes == Outcome.WON).all()


def test_a_crash_mid_activation_past_the_deadline_is_aborted_and_old_clients_write_again(
    spread: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    held, p = crashed_mid_activation(spread, monkeypatch, lead_s=3)
    time.sleep(max(0.0, p.activate_by_us / US - time.time()) + 0.2)
    assert resume(spread, p.version) == "aborted"  # main cannot enforce v2 in time any more
    assert enforced(spread) == {"main": 0, "pg2": 1}  # pg2 withdrawn to v1, the newest active before v2
    assert states(spread) == {"main": {1: "active", 2: "aborted"}, "pg2": {1: "active", 2: "aborted"}}
    owner = create_owner(spread["main"], "dc-a")
    assert (held.register(ids_on(spread, held, "pg2"), owner.token(1)).outcomes == Outcome.WON).all()


def test_a_new_reshard_aborts_a_plan_left_past_its_deadline(servers: dict[str, str]) -> None:
    left = plan(servers, num_shards=8, placement=["main", "pg2"], lead_s=3, max_clock_skew_s=1)  # then it crashed
    time.sleep(max(0.0, left.activate_by_us / US - time.time()) + 0.2)
    report = reshard(servers, num_shards=6, placement=["main", "pg2"], lead_s=3, max_clock_skew_s=1)
    assert report.state == "active" and report.version == 3
    assert states(servers)["main"] == {1: "active", 2: "aborted", 3: "active"}


def test_reshard_and_abort_as_a_login_holding_only_photon_reshard(
    spread: dict[str, str], login_as: Callable[[str, str], str]
) -> None:
    as_reshard = {name: login_as(dsn, "photon_reshard") for name, dsn in spread.items()}
    report = reshard(as_reshard, num_shards=8, placement=["main", "pg2"], lead_s=3, max_clock_skew_s=1)
    assert report.state == "active" and report.version == 2
    assert enforced(spread) == {"main": 2, "pg2": 2}

    state = PipelineState(spread["main"], "dc-a")  # a live joiner that never acknowledges v3
    lease = state.start_lease()
    state.commit(lease, 1, [], None, config_version=2)
    report = reshard(as_reshard, num_shards=12, placement=["main", "pg2"], lead_s=3, max_clock_skew_s=1)
    assert report.state == "aborted" and "dc-a" in report.reason
    assert states(spread)["main"] == {1: "active", 2: "active", 3: "aborted"}
    assert not {t for t in tables(spread["main"]) | tables(spread["pg2"]) if t.startswith("ids_c3_")}
    assert enforced(spread) == {"main": 2, "pg2": 2}
    reg = IdRegistry(spread)
    now = int(time.time() * US)
    assert (reg.register([make_id("10.0.0.1", 1, now + i) for i in range(100)], lease.token(2)).outcomes == 0).all()


def test_the_reshard_login_cannot_drop_or_deactivate_an_active_configuration(
    servers: dict[str, str], login_as: Callable[[str, str], str]
) -> None:
    as_reshard = {name: login_as(dsn, "photon_reshard") for name, dsn in servers.items()}
    with pytest.raises(ReshardError, match="active"):
        abort(as_reshard, 1)
    for statement in (
        "DROP TABLE photon.ids_c1_s0",
        "TRUNCATE photon.ids_c1_s0",
        "DELETE FROM photon.ids_c1_s0",
        "UPDATE photon.shard_config SET state = 'aborted' WHERE version = 1",
        "UPDATE photon.layout_enforced SET version = 0",
        "DELETE FROM photon.shard_map",
        "INSERT INTO photon.shard_config (version, valid_from_us, num_shards) VALUES (9, 1, 1)",
    ):
        with (
            autocommit(as_reshard["main"]) as conn,
            conn.cursor() as cur,
            pytest.raises(psycopg2.errors.InsufficientPrivilege),
        ):
            cur.execute(statement)
    with (
        autocommit(as_reshard["main"]) as conn,
        conn.cursor() as cur,
        pytest.raises(psycopg2.Error, match="active: it is never aborted"),
    ):
        cur.execute("SELECT photon.abort_plan(1, 0)")
    assert {f"ids_c1_s{i}" for i in range(4)} <= tables(servers["main"])
    assert states(servers)["main"] == {1: "active"}
