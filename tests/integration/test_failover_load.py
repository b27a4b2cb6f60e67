"""Failover under load (issue 21): both joiners, real `photon join` processes on live logs, each as a login holding
only photon_joiner with PHOTON_REGISTRY_REPLICATION=required, against the local three-node Patroni cluster. The
primary's PostgreSQL and its Patroni are SIGKILLed while batches run; Patroni promotes a standby and the joiners carry
on, unrestarted, on their multi-host DSN; the old primary comes back as a streaming standby. The input stops, the
joiners drain and exit by themselves; then verify as photon_verifier, and the nemesis's file-only checker against
the generator's manifest: no duplicate, nothing lost.

And the guard's other side: the same cluster switched to asynchronous streaming (Patroni's synchronous_mode off,
failover still automatic) is refused by a joiner in one line naming the setting.

The parts (registry set-up, generator, leases, drain, verify, checker) are the nemesis's (tests/nemesis/run.py);
`make chaos CHAOS_ARGS="--registry cluster"` draws the same fault at random moments."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg2
import psycopg2.extensions
import pytest
from psycopg2 import sql

from photon.pg import autocommit, create_database
from photon.registry.admin import init_registry
from photon.registry.cluster import LocalCluster
from photon.registry.owners import Token
from photon.registry.sharding import ShardRef
from tests.nemesis.run import DCS, ROOT, ClusterRegistry, Nemesis, Plan, first_commits_after

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

# Live logs come in generator runs until the primary is lost: a first one about as long as the joiners take to start
# and commit two batches on an idle machine, then short ones as long as they need more.
FIRST_RUN_S = 45.0
SEGMENT_S = 10.0
BEFORE_KILL = 2  # batches each pipeline commits before the primary is lost
AFTER_PROMOTION = 2  # and at least this many after the promotion, in the same process


@pytest.fixture(scope="module", autouse=True)
def roles_at_up(registry_cluster: LocalCluster) -> dict[str, str]:
    """Patroni's view of each node the moment the module's cluster came up (autouse: before any test of the module
    runs, whichever runs first on this worker)."""
    return {node.name: node.role for node in registry_cluster.status()}


def _batches(dsn: str) -> dict[str, list[tuple[int, float, float]]]:
    """pipeline -> [(batch_seq, started, committed)] in Unix seconds (the batch's start by the registry's clock, as
    the joiner measured it; its commit transaction's start on the server), or {} while the registry is away."""
    with (
        contextlib.suppress(psycopg2.Error),
        autocommit(dsn, guard=False, connect_timeout=2) as conn,
        conn.cursor() as cur,
    ):
        cur.execute(
            "SELECT b.pipeline, b.batch_seq, m.started_at_us / 1e6, extract(epoch FROM b.committed_at)::float8"
            " FROM photon.batches b JOIN photon.batch_metrics m USING (pipeline, batch_seq) ORDER BY 1, 2"
        )
        out: dict[str, list[tuple[int, float, float]]] = {}
        for pipeline, seq, started, committed in cur.fetchall():
            out.setdefault(str(pipeline), []).append((int(seq), float(started), float(committed)))
        return out
    return {}


def _registered_not_committed(cur: Any, pipeline: str) -> bool:
    """Whether ``pipeline``'s next batch holds registry rows (its token: owner << 32 | batch) but is not committed:
    mid-batch, between registering its clicks and committing the batch."""
    cur.execute("SELECT owner_id, last_batch FROM photon.pipelines WHERE pipeline = %s", (pipeline,))
    row = cur.fetchone()
    if row is None:
        return False
    token = Token(int(row[0]), int(row[1]) + 1).value
    cur.execute("SELECT config_version, shard_no FROM photon.shard_map")
    for version, shard in cur.fetchall():
        table = sql.Identifier(ShardRef(int(version), int(shard)).table)
        cur.execute(sql.SQL("SELECT EXISTS (SELECT 1 FROM photon.{} WHERE token = %s)").format(table), (token,))
        if cur.fetchone()[0]:
            return True
    return False


class LiveInput:
    """The generator's live logs as runs one after another, each starting as the last one's logs end (another seed:
    other servers, other ids; each run adds its part to the manifest), until stopped: the input lasts as long as the
    test needs it, however slow the machine is to start the joiners, instead of one run whose length would have to
    guess."""

    def __init__(self, n: Nemesis):
        self.n = n
        self.runs: list[subprocess.Popen[bytes]] = []
        self.next_at = 0.0
        self.stopped = False

    def tend(self) -> None:
        if not self.stopped and time.monotonic() >= self.next_at:
            seconds = SEGMENT_S if self.runs else FIRST_RUN_S
            self.runs.append(self.n.generator(seed=self.n.p.seed + len(self.runs), seconds=seconds))
            self.next_at = time.monotonic() + seconds
        assert all(r.poll() in (None, 0) for r in self.runs), f"a generator run failed: see {self.n.proc_logs}"

    def finish(self, timeout: float) -> None:
        """No new run; the last ones write their logs out (their latest files arrive) and exit."""
        self.stopped = True
        for r in self.runs:
            assert r.wait(timeout=timeout) == 0, f"a generator run failed: see {self.n.proc_logs}"


class Joiners:
    """Both pipelines' `photon join --until-caught-up --drain` processes. On a live input such a joiner may find no
    new file at a look and no retry left, and exit 0, caught up (the input comes in files, a second or so apart):
    Airflow would start the next one, and so does ``tend``, before the primary is lost and after the joiner has
    carried on across the failover. An exit in between (the process that ran at the kill, before it committed
    ``AFTER_PROMOTION`` batches after the promotion) fails the test: it must never need a restart."""

    def __init__(self, n: Nemesis):
        self.n = n
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}
        self.restarts: dict[str, int] = dict.fromkeys(DCS, 0)
        self.killed_unix: float | None = None  # the primary's loss
        self.promoted_unix: float | None = None

    def start(self, dc: str) -> None:
        self.procs[dc] = self.n.lease(dc, until_drained=True)
        self.logs[dc] = self.n.last_log

    def restart(self, dc: str) -> None:
        """The next joiner of a pipeline whose last one exited 0, caught up."""
        self.restarts[dc] += 1
        self.start(dc)

    def carried_on(self, dc: str) -> bool:
        after = self.promoted_unix
        return after is not None and sum(c > after for _, _, c in _batches(self.n.owner).get(dc, [])) >= AFTER_PROMOTION

    def tend(self, what: str) -> None:
        for dc, proc in self.procs.items():
            if proc.poll() is None:
                continue
            if proc.returncode == 0 and (self.killed_unix is None or self.carried_on(dc)):
                self.restart(dc)
                continue
            raise AssertionError(f"{dc}'s joiner exited ({proc.returncode}) while waiting for {what}")


def _wait(what: str, timeout: float, done: Any, joiners: Joiners | None, live: LiveInput, every_s: float = 0.2) -> None:
    """Poll ``done()`` until true, the input going on meanwhile (and the joiners, see ``Joiners``)."""
    deadline = time.monotonic() + timeout
    while True:
        live.tend()
        if done():
            return
        if joiners is not None:
            joiners.tend(what)
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s"
        time.sleep(every_s)


def test_both_joiners_carry_on_across_a_lost_primary(
    registry_cluster: LocalCluster, roles_at_up: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # In quorum mode Patroni promotes only a standby that its /sync key in etcd lists. `up` used to return once
    # PostgreSQL named a quorum, seconds before that key listed anyone: a primary lost then left the cluster without
    # one for good ("following a different leader because i am not the healthiest node").
    assert sorted(roles_at_up.values()) == ["leader", "quorum_standby", "quorum_standby"], roles_at_up
    monkeypatch.setenv("PHOTON_REGISTRY_REPLICATION", "required")  # the verify pass in this process, too
    p = Plan(
        seed=21,
        seconds=SEGMENT_S,  # (each run says its own)
        rate=300.0,
        grace_s=10.0,
        lease_s=(0.0, 0.0),  # unused: the joiners run until the input stops and they have drained
        outage=None,
        lost="",
        faults=[],
        registry="cluster",
        max_join_delay_s=10.0,  # the joiners drain this long at most after the input stops
        # Shipping lags with a short tail: a run's last file arrives about 5 s after its logs end.
        late_query_lag_max_s=5.0,
        generator_set=("query_lag_median_s=1.0", "query_lag_sigma=0.4"),
    )
    n = Nemesis(p, tmp_path, registry=ClusterRegistry(registry_cluster, owned=False))
    n.setup_registry()
    live = LiveInput(n)
    joiners = Joiners(n)
    try:
        # A joiner that finds no file at its first look has caught up: both start once the logs have some.
        _wait("click files", 30, lambda: all(any((n.logs / dc / "clicks").rglob("*.jsonl")) for dc in DCS), None, live)
        for dc in DCS:
            joiners.start(dc)

        def committed(at_least: int) -> bool:
            return all(len(_batches(n.owner).get(dc, [])) >= at_least for dc in DCS)

        _wait(f"{BEFORE_KILL} batches of each pipeline", 240, lambda: committed(BEFORE_KILL), joiners, live)
        # Mid-batch: dc-a has registered its next batch's clicks and not committed the batch yet (dc-b is wherever
        # its own batches are).
        # The primary found first: between a batch's registration and its commit there is a moment only (CI: the
        # commit slipped in while the kill asked Patroni for the primary, and no batch was in flight at the kill).
        target = registry_cluster.primary()
        with autocommit(n.owner, guard=False) as conn, conn.cursor() as cur:
            _wait("dc-a mid-batch", 60, lambda: _registered_not_committed(cur, "dc-a"), joiners, live, 0.02)
        killed_unix, killed = time.time(), time.monotonic()
        joiners.killed_unix = killed_unix
        old = registry_cluster.kill_primary(target)
        # The input goes on through the failover and after it, until each joiner has shown it carries on: batches
        # of new input committed after the promotion. (It used to stop at the kill: a joiner quick enough to join
        # the failover's backlog in one batch then had one batch after the promotion and nothing more to do.)
        _wait("a new primary", 90, lambda: registry_cluster.primary() not in (None, old), joiners, live)
        promoted_unix, promoted_s, new = time.time(), time.monotonic() - killed, registry_cluster.primary()
        joiners.promoted_unix = promoted_unix
        registry_cluster.restart_node(old)  # the old primary comes back at once: rewound, it follows the new one
        restarted = time.monotonic()
        _wait(f"{old} streaming again", 90, lambda: registry_cluster.streams(old), joiners, live, 0.5)
        rejoined_s = time.monotonic() - restarted

        def carried_on() -> bool:
            return all(joiners.carried_on(dc) for dc in DCS)

        _wait(f"{AFTER_PROMOTION} batches of each pipeline after the promotion", 180, carried_on, joiners, live)
        live.stopped = True  # the input ends (its last run within SEGMENT_S); the joiners drain and exit
        live.finish(timeout=60)
        # A joiner that caught up and exited before the last input arrived: its next one joins the rest.
        for dc in [dc for dc, proc in joiners.procs.items() if proc.poll() is not None]:
            assert joiners.procs[dc].returncode == 0, joiners.logs[dc].read_text()[-3000:]
            joiners.restart(dc)
        for dc, proc in joiners.procs.items():  # each joins on, drains, and exits by itself
            assert proc.wait(timeout=120) == 0, f"{dc}'s joiner failed: {joiners.logs[dc].read_text()[-3000:]}"
    finally:
        for proc in [*joiners.procs.values(), *live.runs]:
            n.sigkill(proc)

    gaps = first_commits_after(n.owner, killed_unix)
    batches = _batches(n.owner)
    # The batch each joiner had running at the kill (started before, committed after): carried over the failover.
    in_flight = {dc: [s for s, st, c in batches[dc] if st < killed_unix < c] for dc in DCS}
    after = {dc: sum(c > promoted_unix for _, _, c in batches[dc]) for dc in DCS}
    for dc in DCS:
        print(
            f"\n{dc}: {len(batches[dc])} batches, {sum(c < killed_unix for _, _, c in batches[dc])} before the kill, "
            f"{after[dc]} after the promotion; first commit {gaps[dc]} s after the kill; in flight at the kill: "
            f"{in_flight[dc] or 'none'}"
        )
    print(
        f"failover: {old} SIGKILLed, {new} promoted {promoted_s:.1f} s later; {old} restarted then, streaming "
        f"{rejoined_s:.1f} s after; input: {len(live.runs)} generator runs; joiners caught up and started again "
        f"(before the kill or after carrying on): {joiners.restarts}"
    )
    assert new != old and set(gaps) == set(DCS), gaps
    assert all(k >= AFTER_PROMOTION for k in after.values()), after
    assert any(in_flight.values()), f"the kill landed between batches of both pipelines: {batches}"

    report = n.final_verify()
    n.check()
    verdict = n.verdict()
    summary = verdict.summary()
    print(f"verify: {report['checked']} checked, {report['lost']} lost; checker: {summary}")
    assert report["lost"] == 0 and report["recovered"] == 0, report  # nothing stranded by the failover
    assert verdict.ok, summary  # no duplicate, nothing lost, every click one outcome
    assert verdict.must_join > 300, summary


def test_the_guard_refuses_the_cluster_made_asynchronous(registry_cluster: LocalCluster, tmp_path: Path) -> None:
    """Patroni with synchronous_mode off: plain asynchronous streaming, failover still automatic, commits acknowledged
    before any standby holds them. A joiner refuses it before its Spark session starts: one line naming the setting
    and the way out, exit 2. (The guard's other cases are in test_replication_guard.py, on a hand-made pair.)"""
    admin = create_database(registry_cluster.dsn(), f"photon_async_{uuid.uuid4().hex[:8]}")
    registry_cluster.wait_replayed()
    init_registry({"main": admin}, num_shards=2)
    name, password = f"photon_a_{uuid.uuid4().hex[:8]}_joiner", uuid.uuid4().hex
    with autocommit(admin, guard=False) as conn, conn.cursor() as cur:
        cur.execute(
            sql.SQL("CREATE ROLE {} LOGIN PASSWORD %s IN ROLE photon_joiner").format(sql.Identifier(name)), (password,)
        )
    registry_cluster.wait_replayed()
    (tmp_path / "logs").mkdir()
    env = {
        **os.environ,
        "PHOTON_REGISTRY_DSN": psycopg2.extensions.make_dsn(admin, user=name, password=password),
        "PHOTON_REGISTRY_REPLICATION": "required",
        "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}",
    }
    registry_cluster.set_synchronous(False)  # waits until both standbys stream asynchronously
    try:
        args = [
            "join",
            "--dc",
            "dc-a",
            "--logs",
            str(tmp_path / "logs"),
            "--out",
            str(tmp_path / "out"),
            "--run-for",
            "5",
        ]
        result = subprocess.run(
            [sys.executable, "-m", "photon", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        registry_cluster.set_synchronous(True)  # as the fixture made it, whatever runs next on this cluster
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, (result.returncode, result.stderr[-3000:])
    for text in (
        "synchronous_standby_names is empty",
        "synchronous_mode: quorum",
        "PHOTON_REGISTRY_REPLICATION=single",
    ):
        assert text in lines[0], lines[0]
    assert password not in lines[0] and "lease epoch" not in result.stdout
