"""The nemesis: Photon's guarantees under a seeded random schedule of faults, in the spirit of Jepsen and Spark's
``StreamTest`` stress tests.

Live logs for two data centers (the generator, real time), one joiner process per data center restarted like
Airflow restarts a lease (leases of random length), the registry on a PostgreSQL of its own (``--registry
embedded``, the default) or on the local three-node Patroni cluster (``--registry cluster``, quorum commit), and a
schedule drawn from the seed:

- ``kill``: SIGKILL a joiner's whole process group (driver, JVM, Python workers) at a random moment;
- ``pg_restart`` (embedded): the registry's PostgreSQL stopped hard (``pg_ctl -m immediate``) and started again
  seconds later;
- ``primary_lost`` (cluster, in place of ``pg_restart``, drawn at the same moments; it strikes once a lease has
  committed a batch, 30 s after its draw at the latest): the primary's PostgreSQL and its Patroni SIGKILLed (a
  machine lost); Patroni promotes a standby, the joiners and the verifier follow on their multi-host DSN without a
  restart, and the old primary is started again seconds after the promotion and must rejoin as a streaming
  standby. The JSON reports each failover's gaps: kill to promotion, kill to each pipeline's first batch commit
  after it, restart to streaming;
- ``verify``: ``photon verify`` beside the live joiners with a short grace period, sometimes SIGKILLed mid-pass;
- ``outage``: one replica stops receiving files for a while and catches up (the generator's outage);
- ``lose_dc``: one data center lost for good: its joiner killed and never restarted;
- ``clock``: a joiner's lease replaced by one on a skewed host clock (Debian's ``faketime``): within the maximum
  clock skew it runs (its decisions follow the registry server's clock); beyond it (the survivor, after the loss,
  as in issue 19) it must refuse at once, exit 2, and cost nothing;
- ``store_restart`` (``--storage s3``: the logs, the output tables and the pipelines' state in a bucket of a local S3
  server, SeaweedFS as `photon storage up` runs it): the S3 server SIGKILLed and started again on its endpoint
  seconds later; most outages within the requests' retry budget (a wait), some past it (PHOTON_STORAGE_RETRY_S is
  10 s here: the batch or lease start fails in one line and the next lease goes on). Table maintenance runs on the
  bucket with a 20 s lock lease (`--lock-lease-s`), so that a killed run's lock is taken over within the run.
- ``worker_kill`` (``--spark cluster``, which needs ``--storage s3``: every lease on a Spark standalone cluster of a
  master and two workers, as `photon spark up` starts them, each worker in a folder of its own and sharing nothing
  with the drivers but the bucket and the registry): a worker SIGKILLed with its executors (its process group: the
  machine gone) and started again seconds later; the tasks it ran are run again elsewhere or once it is back.

Every component runs as a login holding only its role (on the cluster with PHOTON_REGISTRY_REPLICATION=required: the
replication guard must pass there, before and after a failover). While the run goes, a checker that reads files only
asserts that no click id is in two ``joined/`` files. At the end (input stopped): verify, drain the survivors,
verify, drain, verify; then the checker asserts that every click has exactly one outcome and every click that must
be joined is.

    python -m tests.nemesis.run --seed 7 --seconds 300     (make chaos SEED=7 SECONDS=300)
    python -m tests.nemesis.run --seed 7 --seconds 120 --registry cluster
    python -m tests.nemesis.run --seed 7 --seconds 180 --storage s3        (make chaos ... CHAOS_ARGS="--storage s3")
    python -m tests.nemesis.run --seed 7 --seconds 240 --storage s3 --spark cluster

The last line printed is a JSON object: the seed, fault counts, the checker's verdict.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg2.extensions

from tests.nemesis import checker

if TYPE_CHECKING:
    from photon.registry.cluster import LocalCluster

ROOT = Path(__file__).resolve().parents[2]
DCS = ("dc-a", "dc-b")
MAX_JOIN_DELAY_S = 20.0
MARGIN_S = 5.0
SKEW_S = 10.0  # PHOTON_MAX_CLOCK_SKEW_S (the default) for every process of the run
REGISTRIES = ("embedded", "cluster")
STORAGES = ("folder", "s3")
SPARKS = ("local", "cluster")
STORAGE_RETRY_S = 10.0  # PHOTON_STORAGE_RETRY_S of an s3 run: some store outages outlast it
STORE_DOWN_MAX_S = 25.0  # the longest store outage drawn
BUCKET = "nemesis"
MAINT_LOCK_LEASE_S = 20.0  # table maintenance's lock on a bucket: a killed run's is taken over 25 s after it was taken
PROMOTION_TIMEOUT_S = 90.0  # Patroni's ttl (20 s) and a promotion, with room for a loaded machine
PRIMARY_LOST_WAIT_S = 30.0  # a drawn primary_lost waits this long at most for a lease's committed batch
# Once the input has stopped, faults still owed (no kill landed yet and one waits for its lease's first batch, a lost
# data center's last lease not yet dead at its crash point, a lease on a skewed clock not yet started) get this long
# more: on a loaded machine a lease's Spark start can outlast the schedule (CI: no kill landed in a 75 s seed).
OWED_FAULTS_S = 120.0


@dataclass(frozen=True)
class Fault:
    at_s: float
    kind: str  # kill | pg_restart | primary_lost | verify | lose_dc | clock | store_restart | worker_kill
    target: str = ""
    # pg_restart, store_restart, worker_kill: seconds down; primary_lost: seconds from the promotion to the old
    # primary's restart; verify: SIGKILL after this many seconds (0: let it finish); clock: the host clock's offset in
    # seconds
    arg: float = 0.0


@dataclass
class Plan:
    seed: int
    seconds: float
    rate: float
    grace_s: float
    lease_s: tuple[float, float]
    outage: tuple[str, float, float] | None
    lost: str
    faults: list[Fault]
    registry: str = "embedded"
    max_join_delay_s: float = MAX_JOIN_DELAY_S
    late_query_lag_max_s: float = 40.0  # the generator runs until its latest query file has arrived
    trigger_s: float = 0.5
    generator_set: tuple[str, ...] = ()  # more of the generator's settings, KEY=VALUE
    storage: str = "folder"  # folder | s3: where the logs, the output and the pipelines' state are
    spark: str = "local"  # local | cluster: where the leases' executors run


def plan(
    seed: int,
    seconds: float,
    rate: float = 300.0,
    registry: str = "embedded",
    storage: str = "folder",
    spark: str = "local",
) -> Plan:
    """The schedule a seed stands for: every fault kind at least once, at random moments. On the cluster the same
    schedule, with the primary lost where the embedded server is restarted (the draws are the same); on s3 the same
    schedule and the S3 server's restarts; on a Spark cluster the same and its workers' losses."""
    if registry not in REGISTRIES:
        raise ValueError(f"registry {registry!r}: expected one of {', '.join(REGISTRIES)}")
    if storage not in STORAGES:
        raise ValueError(f"storage {storage!r}: expected one of {', '.join(STORAGES)}")
    if spark not in SPARKS:
        raise ValueError(f"spark {spark!r}: expected one of {', '.join(SPARKS)}")
    if spark == "cluster" and storage != "s3":
        raise ValueError("--spark cluster needs --storage s3: the workers share nothing with the drivers but the store")
    rng = random.Random(seed)
    lost = rng.choice(DCS)
    loss_at = rng.uniform(0.55, 0.75) * seconds
    faults = [Fault(loss_at, "lose_dc", lost, float(rng.random() < 0.5))]  # arg 1: dies after commit
    for dc in DCS:
        t = rng.uniform(0.15, 0.35) * seconds  # each data center at least once, before any loss
        while t < seconds:
            faults.append(Fault(t, "kill", dc))
            t += rng.expovariate(3.0 / seconds)
    registry_fault = "pg_restart" if registry == "embedded" else "primary_lost"
    for _ in range(max(1, int(seconds // 120))):
        faults.append(Fault(rng.uniform(0.2, 0.85) * seconds, registry_fault, "", rng.uniform(1.0, 6.0)))
    t = rng.uniform(5.0, 12.0)
    while t < seconds:
        faults.append(Fault(t, "verify", "", rng.uniform(0.2, 2.0) if rng.random() < 0.3 else 0.0))
        t += rng.uniform(8.0, 16.0)
    outage = (rng.choice(DCS), rng.uniform(0.1, 0.4) * seconds, rng.uniform(8.0, 20.0))
    # (Drawn after the rest, so a seed's other faults stay what they were.)
    # A lease on a host within the skew (it runs), and the survivor's next lease after the loss beyond it (refused).
    within = rng.choice((-1, 1)) * rng.uniform(2.0, SKEW_S - 2.0)
    faults.append(Fault(rng.uniform(0.1, 0.45) * seconds, "clock", rng.choice(DCS), within))
    survivor = DCS[1 - DCS.index(lost)]
    beyond = rng.choice((-1, 1)) * rng.uniform(SKEW_S + 20, 150)
    faults.append(Fault(loss_at + rng.uniform(0.05, 0.15) * seconds, "clock", survivor, beyond))
    # A kill drawn for the lost data center after its loss has no lease to hit: left out of the schedule (after the
    # draws, so the rest stays as it was), not printed as a kill that never comes.
    faults = [f for f in faults if not (f.kind == "kill" and f.target == lost and f.at_s >= loss_at)]
    if storage == "s3":  # (drawn last, from a generator of their own: the rest of the seed stays what it was)
        srng = random.Random(seed + 4)
        for _ in range(max(2, int(seconds // 60))):
            down = (
                srng.uniform(1.0, 6.0) if srng.random() < 0.75 else srng.uniform(STORAGE_RETRY_S + 2, STORE_DOWN_MAX_S)
            )
            faults.append(Fault(srng.uniform(0.15, 0.85) * seconds, "store_restart", "", down))
    if spark == "cluster":  # (the same: a generator of their own)
        wrng = random.Random(seed + 5)
        for _ in range(max(2, int(seconds // 60))):
            worker = wrng.choice(("worker-1", "worker-2"))
            faults.append(Fault(wrng.uniform(0.15, 0.85) * seconds, "worker_kill", worker, wrng.uniform(1.0, 8.0)))
    faults = sorted(faults, key=lambda f: f.at_s)
    # On a cluster an application's start (its executor on a worker) takes longer: leases run longer.
    lease_s = (20.0, 45.0) if spark == "local" else (40.0, 80.0)
    return Plan(seed, seconds, rate, 10.0, lease_s, outage, lost, faults, registry, storage=storage, spark=spark)


class EmbeddedRegistry:
    """The registry's own PostgreSQL (the pgserver binaries), which this run may stop hard."""

    replication = "single"  # PHOTON_REGISTRY_REPLICATION for the processes on it: a lone server by construction

    def __init__(self, folder: Path):
        from photon.pg import EmbeddedPostgres

        self.server = EmbeddedPostgres(folder, cleanup_mode="delete")
        self.admin = ""

    def start(self) -> str:
        self.server.start()
        self.admin = self.server.admin_dsn
        return self.admin

    def replicated(self) -> None:
        """Nothing to wait for: one server."""

    def _pg_ctl(self, args: list[str]) -> None:
        from pgserver import _commands

        pg = self.server._server
        _commands.pg_ctl(args, pgdata=pg.pgdata, user=pg.system_user, timeout=60)

    def stop_hard(self) -> None:
        self._pg_ctl(["-m", "immediate", "stop"])

    def restart(self) -> None:
        pg = self.server._server
        socket_dir = psycopg2.extensions.parse_dsn(self.admin)["host"]
        self._pg_ctl(["-w", "-o", '-h ""', "-o", f"-k {socket_dir}", "-l", str(pg.log), "start"])

    def stop(self) -> None:
        self.server.stop()


class ClusterRegistry:
    """The local three-node cluster (Patroni, etcd, quorum commit), whose primary this run may lose. Started and
    stopped by this run, or one already up (a test's fixture: ``owned=False``) that it leaves running."""

    replication = "required"  # the guard must pass on the cluster, before and after a failover

    def __init__(self, cluster: LocalCluster, *, owned: bool = True):
        self.cluster, self.owned = cluster, owned

    def start(self) -> str:
        return self.cluster.up() if self.owned else self.cluster.dsn()

    def replicated(self) -> None:
        """A database or login just made exists on every node (the multi-host DSN stops at a node lacking it)."""
        self.cluster.wait_replayed()

    def stop(self) -> None:
        if self.owned and self.cluster.state:
            self.cluster.down()


@dataclass
class Failover:
    """One ``primary_lost``: when, which node, and how long each step took (seconds from the kill unless named)."""

    at_s: float
    killed_unix: float  # time.time() at the kill: the registry's commit times are on the same host's clock
    old: str
    restart_after_s: float  # from the promotion
    killed_mono: float = 0.0
    new: str | None = None
    promoted_s: float | None = None
    restarted_mono: float | None = None
    rejoined_s: float | None = None  # from the old primary's restart to its streaming as a standby
    first_commit_s: dict[str, float | None] = field(default_factory=dict)
    after_batch: bool = True  # struck once a lease had committed a batch (else: on the wait's bound)

    def summary(self) -> dict[str, Any]:
        return {
            "at_s": round(self.at_s, 1),
            "after_batch": self.after_batch,
            "old": self.old,
            "new": self.new,
            "promoted_s": self.promoted_s,
            "first_commit_s": self.first_commit_s,
            "rejoined_s": self.rejoined_s,
        }


# What `photon join` prints once a batch is committed ("dc-a batch 3: 120 clicks, ..."), not its lease's first line
# ("dc-a: lease epoch 2, resuming after batch 0").
_BATCH_LINE = re.compile(rb"^\S+ batch \d+: ", re.MULTILINE)
_LEASE_LINE = re.compile(rb"^\S+: lease epoch \d+, ", re.MULTILINE)


def ran_a_batch(log: Path) -> bool:
    return _BATCH_LINE.search(log.read_bytes()) is not None


def first_commits_after(dsn: str, unix_s: float) -> dict[str, float]:
    """Seconds from ``unix_s`` to each pipeline's first batch commit after it. ``photon.batches.committed_at`` is
    the committing transaction's start by the registry server's clock, on this same host: a batch retried across a
    failover is stamped by the new primary."""
    from photon.pg import autocommit

    with autocommit(dsn, guard=False) as conn, conn.cursor() as cur:
        cur.execute(
            "SELECT pipeline, extract(epoch FROM min(committed_at))::float8 FROM photon.batches"
            " WHERE committed_at > to_timestamp(%s) GROUP BY pipeline ORDER BY pipeline",
            (unix_s,),
        )
        return {str(p): round(float(t) - unix_s, 1) for p, t in cur.fetchall()}


@dataclass
class Outcome:
    seed: int
    seconds: float
    faults: Counter[str] = field(default_factory=Counter)
    joiner_exits: Counter[str] = field(default_factory=Counter)
    verify: Counter[str] = field(default_factory=Counter)
    duplicate_checks: int = 0
    duplicates_seen: list[str] = field(default_factory=list)
    verdict: dict[str, Any] = field(default_factory=dict)
    failovers: list[dict[str, Any]] = field(default_factory=list)
    owed_wait_s: float = 0.0  # the live phase's time after the input stopped, for faults still owed (OWED_FAULTS_S)
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.duplicates_seen and bool(self.verdict.get("ok"))

    def to_dict(self) -> dict[str, Any]:
        d = {k: dict(v) if isinstance(v, Counter) else v for k, v in vars(self).items()}
        violations = self.verdict.get("violations", {})
        # The two figures billing cares about, in front: clicks joined twice, clicks that had to be joined and were not.
        headline = {
            "duplicates": len(self.duplicates_seen) or violations.get("duplicate", {}).get("count", 0),
            "lost": violations.get("must_join_not_joined", {}).get("count", 0),
        }
        return {**d, **headline, "ok": self.ok}


class Nemesis:
    """One run of a plan. Its parts (``setup_registry``, ``generator``, ``lease``, ``drain``, ``final_verify``,
    ``check``, ``verdict``) also serve tests that stage one fault by hand (test_failover_load.py)."""

    def __init__(
        self,
        p: Plan,
        work: Path,
        spark: Any = None,
        echo: Any = print,
        registry: EmbeddedRegistry | ClusterRegistry | None = None,
    ):
        self.p, self.work, self.spark, self.echo = p, work, spark, echo
        self.logs: Path | str = work / "logs"
        self.out: Path | str = work / "out"
        self.manifest = work / "logs" / "_manifest"
        self.store_folder: Path | None = None  # the S3 server's, on s3
        self.store_up_at: float | None = None  # when the S3 server stopped hard comes back
        self.spark_folder: Path | None = None  # the Spark cluster's, on a cluster
        self.master = "local[1]"
        self.workers_up_at: dict[str, float] = {}  # worker -> when it comes back
        self.proc_logs = work / "processes"
        self.proc_logs.mkdir(parents=True, exist_ok=True)
        if registry is None and p.registry == "cluster":
            from photon.registry.cluster import LocalCluster

            registry = ClusterRegistry(LocalCluster(work / "cluster"))
        self.registry: EmbeddedRegistry | ClusterRegistry = registry or EmbeddedRegistry(work / "pg")
        self.rng = random.Random(p.seed + 1)
        # Leases that die publishing (issue 34), drawn apart so that the other draws of a seed stay what they were.
        self.publish_rng = random.Random(p.seed + 2)
        self.publishing: dict[str, str] = {}  # dc -> the crash point of its running lease, if it is to die publishing
        # Table maintenance beside the live joiners (compaction, checkpoint, vacuum), some runs SIGKILLed mid-way.
        self.maint_rng = random.Random(p.seed + 3)
        self.maintainer: subprocess.Popen[bytes] | None = None
        self.maint_next_s = self.maint_rng.uniform(8.0, 20.0)
        self.maint_kill_at: float | None = None
        self.store_past_budget = False  # the S3 server's current outage outlasts the requests' retry budget
        self.maint_saw_outage = False  # the S3 server was down past the budget while the running maintainer ran
        self.outcome = Outcome(p.seed, p.seconds)
        self.joiners: dict[str, subprocess.Popen[bytes] | None] = dict.fromkeys(DCS)
        # A kill lands a random moment after the lease's first batch (its Spark session up), so that kills hit
        # batches rather than start-ups: dc -> seconds after that batch.
        self.kill_pending: dict[str, float] = {}
        # Kills drawn for a data center while one is pending: each lands after a later lease's first batch, in turn
        # (a second kill used to replace the first, so the schedule printed more kills than the summary counted).
        self.kill_queue: dict[str, list[float]] = {dc: [] for dc in DCS}
        self.first_batch_at: dict[str, float | None] = dict.fromkeys(DCS)
        self.idle_lease: set[str] = set()  # leases a kill is due on from their lease, not a batch (_note_first_batch)
        self.lease_log: dict[str, Path] = {}
        self.lost: set[str] = set()
        self.dying: dict[str, str] = {}  # a lost data center's last lease, until it dies at its crash point
        self.verifier: subprocess.Popen[bytes] | None = None
        self.verifier_kill_at: float | None = None
        self.pg_up_at: float | None = None
        self.primary_lost_pending: Fault | None = None  # drawn, waiting for a lease's first batch
        self.failover: Failover | None = None  # the primary_lost under way, until its old primary streams again
        self.failovers: list[Failover] = []
        self.started = 0
        self.skewed: dict[str, float] = {}  # dc -> the clock offset of its running lease, if skewed
        self.next_clock: dict[str, float] = {}  # dc -> the clock offset of its next lease

    # -- setup -----------------------------------------------------------------------------------------------
    def setup_registry(self) -> None:
        """Start the registry, make the ``photon`` database (``self.owner``: its admin DSN) and one login per role
        (``self.dsn[role]``)."""
        from psycopg2 import sql

        from photon.pg import autocommit, create_database
        from photon.registry.admin import init_registry

        admin = self.registry.start()
        self.owner = owner = create_database(admin, "photon")
        self.registry.replicated()  # the new database on every node before anyone connects to it
        init_registry({"main": owner}, num_shards=4)
        self.dsn: dict[str, str] = {}
        with autocommit(admin, guard=False) as conn, conn.cursor() as cur:
            for role in ("photon_joiner", "photon_verifier"):
                name, password = f"nemesis_{role}_{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
                cur.execute(
                    sql.SQL("CREATE ROLE {} LOGIN PASSWORD %s IN ROLE {}").format(
                        sql.Identifier(name), sql.Identifier(role)
                    ),
                    (password,),
                )
                self.dsn[role] = psycopg2.extensions.make_dsn(owner, user=name, password=password)
        self.registry.replicated()  # the logins too

    def setup_storage(self) -> None:
        """On s3: the local S3 server and the run's bucket; the logs and the output are prefixes of it, the manifest
        a folder of the run. Every process of the run (this one's verify passes, drains and checks too) reaches it
        through the standard AWS variables, set in this process's environment."""
        if self.p.storage != "s3":
            return
        from photon.tools import storage_server

        self.store_folder = self.work / "s3"
        server = storage_server.start(self.store_folder, (BUCKET,))
        os.environ.update(server.env())
        os.environ["PHOTON_STORAGE_RETRY_S"] = f"{STORAGE_RETRY_S:g}"
        if self.p.seed % 2:  # odd seeds: every batch ships its own queries to its clicks (a catch-up batch's way)
            os.environ["PHOTON_SHIP_QUERIES_FROM_MIB"] = "0"
        self.logs, self.out = f"s3://{BUCKET}/logs", f"s3://{BUCKET}/out"
        self.manifest = self.work / "manifest"

    def _worker_env(self) -> dict[str, str]:
        """A worker's environment: the project's code and the store's credentials, nothing of any driver's."""
        from photon.tools import storage_server

        assert self.store_folder is not None
        return {"PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}", **storage_server.client_env(self.store_folder)}

    def setup_spark(self) -> None:
        """On a cluster: a master and two workers of one core each (`photon spark up`), the leases' applications one
        executor each, so that both pipelines run side by side, one on each worker."""
        if self.p.spark != "cluster":
            return
        from photon.tools import spark_cluster

        self.spark_folder = self.work / "spark"
        cluster = spark_cluster.start(self.spark_folder, workers=2, cores=1, memory="1g", env=self._worker_env())
        self.master = cluster.master_url
        cap = "--conf spark.cores.max=1 --conf spark.executor.cores=1 --conf spark.executor.memory=600m"
        os.environ["PYSPARK_SUBMIT_ARGS"] = f"{cap} pyspark-shell"

    def _worker_kill(self, f: Fault, now: float) -> None:
        """The worker SIGKILLed with its executors (its process group), started again ``f.arg`` seconds later."""
        from photon.tools import spark_cluster

        cluster = spark_cluster.running(self.spark_folder) if self.spark_folder is not None else None
        mine = [w for w in (cluster.processes if cluster else []) if w.get("role") == f.target]
        if not mine or f.target in self.workers_up_at:
            self.outcome.faults["worker_kill_skipped"] += 1
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(int(mine[0]["pid"]), signal.SIGKILL)
        self.workers_up_at[f.target] = now + f.arg
        self.outcome.faults["worker_kill"] += 1

    def _workers_back(self, now: float | None) -> None:
        """The killed workers started again once their time is up (``now`` None: at once)."""
        from photon.tools import spark_cluster

        due = [w for w, at in self.workers_up_at.items() if now is None or now >= at]
        if not due or self.spark_folder is None:
            return
        if self.store_up_at is not None and now is not None:
            return  # a worker starts with the store's endpoint in its environment: once the store is back
        back = spark_cluster.start(self.spark_folder, env=self._worker_env())
        if back.master_url != self.master:
            raise AssertionError(f"seed {self.p.seed}: the Spark master came back on {back.master_url}")
        for w in due:
            del self.workers_up_at[w]

    def _store_restart(self, f: Fault, now: float) -> None:
        from photon.tools import storage_server

        if self.store_folder is None or self.store_up_at is not None:
            self.outcome.faults["store_restart_skipped"] += 1
            return
        storage_server.stop(self.store_folder, hard=True)
        self.store_up_at = now + f.arg
        self.store_past_budget = f.arg > STORAGE_RETRY_S
        self.outcome.faults["store_restart"] += 1
        self.outcome.faults["store_restart_past_budget"] += f.arg > STORAGE_RETRY_S

    def _store_back(self, now: float | None) -> None:
        """The S3 server started again once its outage is over (``now`` None: at once)."""
        from photon.tools import storage_server

        if self.store_folder is None or self.store_up_at is None or (now is not None and now < self.store_up_at):
            return
        endpoint = storage_server.start(self.store_folder).endpoint
        if endpoint != os.environ["AWS_ENDPOINT_URL"]:
            raise AssertionError(f"seed {self.p.seed}: the S3 server came back on {endpoint}, not its endpoint")
        self.store_up_at = None

    def _env(self, role: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "PHOTON_REGISTRY_SERVERS"}
        env |= {"PHOTON_REGISTRY_DSN": self.dsn[role], "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}"}
        env["PHOTON_REGISTRY_REPLICATION"] = self.registry.replication
        return env

    def _spawn(
        self,
        name: str,
        args: list[str],
        role: str | None,
        extra: dict[str, str] | None = None,
        prefix: list[str] | None = None,
    ) -> subprocess.Popen[bytes]:
        self.started += 1
        self.last_log = self.proc_logs / f"{self.started:04d}-{name}.log"
        log = open(self.last_log, "wb")  # noqa: SIM115 (the child holds it)
        env = self._env(role) if role else {**os.environ, "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}"}
        env |= extra or {}
        return subprocess.Popen(
            [*(prefix or []), sys.executable, "-m", "photon", *args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @staticmethod
    def sigkill(proc: subprocess.Popen[bytes] | None) -> None:
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    # -- processes -------------------------------------------------------------------------------------------
    def generator(self, *, seed: int | None = None, seconds: float | None = None) -> subprocess.Popen[bytes]:
        """The live generator for ``p.seconds`` of logs (it returns once its latest file has arrived). Another
        ``seed`` and a few ``seconds``: one of several runs in a row (each adds its part to the manifest)."""
        seconds = self.p.seconds if seconds is None else seconds
        args = ["generate", "--logs", str(self.logs), "--mode", "live", "--duration", str(seconds)]
        args += ["--rate", str(self.p.rate), "--seed", str(self.p.seed if seed is None else seed)]
        if self.p.outage is not None:
            dc, start, length = self.p.outage
            args += ["--outage", f"{dc}:{start:.1f}:{length:.1f}"]
        args += ["--max-join-delay", str(self.p.max_join_delay_s)]
        args += ["--set", f"late_query_lag_max_s={self.p.late_query_lag_max_s:g}"]
        args += ["--set", f"boundary_margin_s={MARGIN_S}"]
        for setting in self.p.generator_set:
            args += ["--set", setting]
        if self.p.storage == "s3":
            args += ["--manifest", str(self.manifest)]
            # The log shipper outlasts every store outage (its files arrive late, as a shipper's would); only the
            # pipelines get the short budget, some outages past it. (Seed 2911292: a 16.9 s outage failed the
            # generator's put at 10 s and ended the run.)
            return self._spawn("generator", args, None, {"PHOTON_STORAGE_RETRY_S": f"{STORE_DOWN_MAX_S + 30:g}"})
        return self._spawn("generator", args, None)

    def lease(
        self, dc: str, crash_at: str | None = None, clock_s: float = 0.0, *, until_drained: bool = False
    ) -> subprocess.Popen[bytes]:
        """A `photon join` lease of ``dc`` (a length drawn from ``p.lease_s``) as the joiner's login. ``until_drained``:
        instead, until the input has stopped and no retry is left (``--until-caught-up --drain``; files must be
        there when its first batch looks, or it has caught up at once)."""
        args = ["join", "--dc", dc, "--logs", str(self.logs), "--out", str(self.out)]
        if until_drained:
            args += ["--until-caught-up", "--drain"]
        else:
            args += ["--run-for", f"{self.rng.uniform(*self.p.lease_s):.0f}"]
        args += ["--trigger-interval", f"{self.p.trigger_s:g}", "--max-join-delay", str(self.p.max_join_delay_s)]
        args += ["--master", self.master]
        extra = {"PHOTON_CRASH_AT": crash_at} if crash_at else None
        prefix = ["faketime", "-f", f"{clock_s:+.0f}s"] if clock_s else None
        return self._spawn(
            f"join-{dc}" + (f"-clock{clock_s:+.0f}s" if clock_s else ""), args, "photon_joiner", extra, prefix
        )

    def _verify(self, kill_after: float, now: float) -> None:
        if self.verifier is not None and self.verifier.poll() is None:
            return  # one pass at a time, as the DAG runs it
        args = ["verify", "--logs", str(self.logs), "--out", str(self.out), "--grace", str(self.p.grace_s), "--json"]
        self.verifier = self._spawn("verify", args, "photon_verifier")
        self.verifier_kill_at = now + kill_after if kill_after else None
        self.outcome.faults["verify"] += 1

    def _maintain(self, now: float) -> None:
        """`photon table maintain` every 10-25 s while the joiners append (one at a time, as its DAG runs it), 40% of
        them SIGKILLed 0.2-3 s in: mid-compaction, mid-checkpoint or mid-vacuum."""
        m = self.maintainer
        if m is not None:
            self.maint_saw_outage |= self.store_up_at is not None and self.store_past_budget
            if m.poll() is None and self.maint_kill_at is not None and now >= self.maint_kill_at:
                self.sigkill(m)
                self.outcome.faults["maintain_killed"] += 1
            if m.poll() is not None:
                self.outcome.faults[f"maintain_exit_{m.returncode}"] += 1
                self.maintainer = None
                log = sorted(self.proc_logs.glob("*-maintain.log"))[-1]
                if m.returncode == 2 and self.maint_saw_outage and "error: s3://" in log.read_text():
                    # the store down past the retry budget: one line naming it, the next run does the work
                    self.outcome.faults["maintain_failed_store_down"] += 1
                elif m.returncode not in (0, -signal.SIGKILL):  # it found the tables wrong, or failed: never allowed
                    raise AssertionError(f"seed {self.p.seed}: photon table maintain exited {m.returncode}: {log}")
            return
        if now < self.maint_next_s or (isinstance(self.out, Path) and not self.out.is_dir()):
            return  # no pipeline has started yet: nothing to maintain
        args = ["table", "maintain", "--out", str(self.out), "--json"]
        if not isinstance(self.out, Path):  # a killed run's lock is taken over within the run (StoreLock)
            args += ["--lock-lease-s", f"{MAINT_LOCK_LEASE_S:g}"]
        self.maintainer = self._spawn("maintain", args, None)
        self.maint_saw_outage = False
        self.maint_kill_at = now + self.maint_rng.uniform(0.2, 3.0) if self.maint_rng.random() < 0.4 else None
        self.maint_next_s = now + self.maint_rng.uniform(10.0, 25.0)
        self.outcome.faults["maintain"] += 1

    def _reap_verifier(self, now: float) -> None:
        v = self.verifier
        if v is None:
            return
        if v.poll() is None and self.verifier_kill_at is not None and now >= self.verifier_kill_at:
            self.sigkill(v)
            self.outcome.faults["verify_killed"] += 1
        if v.poll() is not None:
            self.outcome.verify["exit_" + str(v.returncode)] += 1
            self.verifier = None
            name = sorted(self.proc_logs.glob("*-verify.log"))[-1].read_text()
            if v.returncode == 0 and "{" in name:
                report = json.loads(name[name.index("{") :])
                self.outcome.verify["live_checked"] += report["checked"]
                self.outcome.verify["live_fenced"] += len(report["fenced"])
                self.outcome.verify["live_recovered"] += report["recovered"]
                self.outcome.verify["live_rolled_forward"] += len(report["rolled_forward"])

    # -- the run ---------------------------------------------------------------------------------------------
    def _apply(self, f: Fault, now: float) -> None:
        if f.kind == "lose_dc":
            # The data center's last lease dies in its first batch, after registering (clicks held by a pipeline
            # that will never commit them) or after committing (a batch that will never be published by it). (It was
            # the second batch: on a loaded machine a batch took 20-37 s, each lease ran one and ended, and the last
            # had nothing left to join: the input stopped with the death still owed; CI, seed 11.)
            self.lost.add(f.target)
            self._drop_kills(f.target)  # no lease of it will run a batch for them to follow
            self.sigkill(self.joiners[f.target])
            self.dying[f.target] = "after_commit@+1" if f.arg else "after_register@+1"
            self.joiners[f.target] = self.lease(f.target, crash_at=self.dying[f.target])
            self.outcome.faults["lose_dc"] += 1
        elif f.kind == "kill" and f.target not in self.lost:
            delay = self.rng.uniform(0.0, 6.0)
            if f.target in self.kill_pending:
                self.kill_queue[f.target].append(delay)
            else:
                self.kill_pending[f.target] = delay
        elif f.kind == "kill":
            self.outcome.faults["kill_not_landed"] += 1
        elif f.kind == "pg_restart" and self.pg_up_at is None:
            assert isinstance(self.registry, EmbeddedRegistry)
            self.registry.stop_hard()
            self.pg_up_at = now + f.arg
            self.outcome.faults["pg_restart"] += 1
        elif f.kind == "primary_lost":
            if self.failover is not None or self.primary_lost_pending is not None:  # one at a time
                self.outcome.faults["primary_lost_skipped"] += 1
                return
            self.primary_lost_pending = f
        elif f.kind == "verify":
            self._verify(f.arg, now)
        elif f.kind == "store_restart":
            self._store_restart(f, now)
        elif f.kind == "worker_kill":
            self._worker_kill(f, now)
        elif f.kind == "clock" and f.target not in self.lost:
            # Airflow's next lease of this pipeline lands on a host with a skewed clock: within the skew, whenever
            # the current lease ends; beyond it, now (the current lease killed): it must refuse before Spark starts.
            if abs(f.arg) <= SKEW_S:
                self.next_clock[f.target] = f.arg
                return
            self.sigkill(self.joiners[f.target])
            self._start_lease(f.target, f.arg)

    def _lose_primary(self, now: float, *, at_once: bool = False) -> None:
        """A pending primary_lost strikes once a live pipeline's current lease has committed a batch: it hits batches
        (their registrations and commits) rather than Spark start-ups. On a machine so loaded that no lease gets
        there, PRIMARY_LOST_WAIT_S after its draw all the same (or ``at_once``: the input stopped)."""
        f = self.primary_lost_pending
        if f is None:
            return
        batch = any(ran_a_batch(self.lease_log[dc]) for dc in self.lease_log if dc not in self.lost)
        if not (batch or at_once or now - f.at_s >= PRIMARY_LOST_WAIT_S):
            return
        assert isinstance(self.registry, ClusterRegistry)
        self.primary_lost_pending = None
        killed_unix, killed_mono = time.time(), time.monotonic()
        old = self.registry.cluster.kill_primary()
        self.failover = Failover(now, killed_unix, old, f.arg, killed_mono=killed_mono, after_batch=batch)
        self.echo(f"{now:7.1f}s primary_lost: {old} SIGKILLed ({now - f.at_s:.1f} s after its draw)")
        self.outcome.faults["primary_lost"] += 1

    def _tend_failover(self, *, wait: bool = False) -> None:
        """The primary_lost under way, one step at a time between the loop's other work: note the promotion, restart
        the old primary ``restart_after_s`` later, note when it streams again. ``wait``: to the end, now (the input
        stopped)."""
        fo = self.failover
        if fo is None:
            return
        assert isinstance(self.registry, ClusterRegistry)
        cluster = self.registry.cluster
        while True:
            mono = time.monotonic()
            if fo.new is None:
                primary = cluster.primary()
                if primary is not None and primary != fo.old:
                    fo.new, fo.promoted_s = primary, round(mono - fo.killed_mono, 1)
                    self.echo(f"  failover: {fo.new} promoted {fo.promoted_s} s after the kill")
                elif mono - fo.killed_mono > PROMOTION_TIMEOUT_S:
                    raise AssertionError(
                        f"seed {self.p.seed}: no new primary {PROMOTION_TIMEOUT_S:.0f} s after {fo.old}'s loss"
                    )
            elif fo.restarted_mono is None:
                if wait or mono - fo.killed_mono >= (fo.promoted_s or 0.0) + fo.restart_after_s:
                    cluster.restart_node(fo.old)
                    fo.restarted_mono = time.monotonic()
            else:
                node = next(n for n in cluster.status() if n.name == fo.old)
                if (
                    node.role != "leader"
                    and node.state == "streaming"
                    and node.sync_state in ("quorum", "sync", "potential")
                ):
                    fo.rejoined_s = round(time.monotonic() - fo.restarted_mono, 1)
                    self.echo(f"  failover: {fo.old} streaming again {fo.rejoined_s} s after its restart")
                    self.failovers.append(fo)
                    self.failover = None
                    return
                if mono - fo.restarted_mono > PROMOTION_TIMEOUT_S:
                    raise AssertionError(
                        f"seed {self.p.seed}: {fo.old} does not stream again after its restart: {node}"
                    )
            if not wait:
                return
            time.sleep(0.5)

    def _logs_exist(self) -> bool:
        if isinstance(self.logs, Path):
            return self.logs.is_dir()
        return (self.manifest / "files.parquet").exists()  # the generator's first files are in the bucket

    def _start_lease(self, dc: str, clock_s: float = 0.0) -> None:
        # A quarter of the leases die publishing a batch (SIGKILL, driver and all): between its registry commit and
        # its table commits, or between the joined table's commit and the others'. The next lease, or the verifier,
        # publishes it; the tables must hold it once.
        # dc-b's leases always do, in their first batch, until one has (a short seed has one too); one started before
        # the logs exist refuses at once.
        crash_at = None
        first = dc == "dc-b" and not self.outcome.faults["died_publishing"] and self._logs_exist()
        if not clock_s and (first or self.publish_rng.random() < 0.25):
            point = self.publish_rng.choice(("after_commit", "after_table_commit"))
            crash_at = self.publishing[dc] = f"{point}@+{1 if first else self.publish_rng.randint(1, 3)}"
            self.outcome.faults["publishing_drawn"] += 1
        self.joiners[dc] = self.lease(dc, crash_at=crash_at, clock_s=clock_s)
        self.lease_log[dc], self.first_batch_at[dc] = self.last_log, None
        self.idle_lease.discard(dc)
        if clock_s:
            self.skewed[dc] = clock_s
            self.outcome.faults["clock"] += 1

    def _skewed_exit(self, dc: str, code: int | None) -> None:
        """A lease on a skewed clock ended: beyond the skew it must have refused (exit 2, the one line); within it,
        it is a lease like any other."""
        offset = self.skewed.pop(dc, None)
        if offset is None:
            return
        ran = ran_a_batch(self.lease_log[dc])
        if abs(offset) <= SKEW_S:
            self.outcome.faults["clock_within_ran" if ran else "clock_unchecked"] += 1
        elif code == 2 and b"PHOTON_MAX_CLOCK_SKEW_S" in self.lease_log[dc].read_bytes():
            self.outcome.faults["clock_refused"] += 1
        elif not ran:
            self.outcome.faults["clock_unchecked"] += 1  # failed before it asked (the registry was down), ran nothing
        else:
            raise AssertionError(
                f"seed {self.p.seed}: a lease {offset:+.0f}s off ran (exit {code}): {self.lease_log[dc]}"
            )

    def _last_lease(self, dc: str, proc: subprocess.Popen[bytes] | None) -> None:
        """A lost data center's last lease must die at its crash point, mid-batch: one that failed before it got
        there (the registry was down as it started) is retried, as Airflow would; once it died there, nothing more."""
        if dc not in self.dying or proc is None or proc.poll() is None:
            return
        self.outcome.joiner_exits[f"{dc}:{proc.returncode}"] += 1
        if proc.returncode == -signal.SIGKILL:
            del self.dying[dc]
            self.outcome.faults["lost_mid_batch"] += 1
        else:
            self.joiners[dc] = self.lease(dc, crash_at=self.dying[dc])

    def _note_first_batch(self, dc: str, now: float, *, input_stopped: bool) -> None:
        """When the running lease of ``dc`` ran its first batch, which a pending kill counts its delay from. Once the
        input has stopped while no kill has landed, its taking the lease counts instead: a lease with nothing left to
        join runs no batch, and on a loaded machine (CI: three test workers' Spark starts) every lease of the input's
        75 s can end before a drawn kill is due, so the kill lands on a lease holder waiting for input."""
        if self.first_batch_at[dc] is not None:
            return
        log = self.lease_log[dc].read_bytes()
        if _BATCH_LINE.search(log) is not None:
            self.first_batch_at[dc] = now
        elif input_stopped and not self.outcome.faults["kill"] and _LEASE_LINE.search(log) is not None:
            self.first_batch_at[dc] = now
            self.idle_lease.add(dc)

    def _kill_if_due(self, dc: str, proc: subprocess.Popen[bytes], now: float) -> bool:
        """The pending kill of ``dc`` lands once its delay has passed since the running lease's first batch; the next
        one queued for it then waits for a later lease's first batch."""
        first = self.first_batch_at[dc]
        if first is None or dc not in self.kill_pending or now - first < self.kill_pending[dc]:
            return False
        del self.kill_pending[dc]
        if self.kill_queue[dc]:
            self.kill_pending[dc] = self.kill_queue[dc].pop(0)
        self.sigkill(proc)
        self.outcome.faults["kill"] += 1
        if dc in self.idle_lease:
            self.outcome.faults["kill_idle"] += 1  # a lease holder waiting for input, not one mid-batch
        return True

    def _drop_kills(self, dc: str) -> None:
        """Kills of ``dc`` that will not land (its data center lost, or the input stopped), counted: the summary's
        kills and these add up to the schedule's."""
        pending = [self.kill_pending.pop(dc)] if dc in self.kill_pending else []
        self.outcome.faults["kill_not_landed"] += len(pending) + len(self.kill_queue[dc])
        self.kill_queue[dc] = []

    def _owed(self) -> list[str]:
        """Faults drawn and not yet happened whose kind has not happened at all: kills waiting for a lease's batch
        (once the input has stopped, a lease may have no batch to run: a later kill owed after an earlier one landed
        would only wait out OWED_FAULTS_S), lost data centers' last leases, the next lease on a skewed clock."""
        kills = [] if self.outcome.faults["kill"] else [f"kill {dc}" for dc in self.kill_pending]
        return kills + [f"lost {dc}" for dc in self.dying] + [f"clock {dc}" for dc in self.next_clock]

    def check(self) -> None:
        if self.store_up_at is not None:  # the S3 server is down (store_restart): the next check reads it
            self.outcome.faults["checks_while_store_down"] += 1
            return
        dups = checker.duplicates(self.out)
        self.outcome.duplicate_checks += 1
        if dups:
            self.outcome.duplicates_seen = dups
            raise AssertionError(f"seed {self.p.seed}: click ids in two joined/ files: {dups[:5]}")

    def run(self) -> Outcome:
        t_wall = time.monotonic()
        self.outcome.faults["kill_drawn"] = sum(1 for f in self.p.faults if f.kind == "kill")
        self.setup_registry()
        try:
            self.setup_storage()
            self.setup_spark()
            self._live()
            self._finish()
        finally:
            for proc in [*self.joiners.values(), self.verifier]:
                self.sigkill(proc)
            if self.spark_folder is not None:
                from photon.tools import spark_cluster

                spark_cluster.stop(self.spark_folder, hard=True)
            self.registry.stop()
            if self.store_folder is not None:
                from photon.tools import storage_server

                storage_server.stop(self.store_folder, hard=True)  # checked already; its data stays on disk
        self.outcome.wall_s = round(time.monotonic() - t_wall, 1)
        return self.outcome

    def _live(self) -> None:
        faults = list(self.p.faults)
        generator = self.generator()
        t0 = time.monotonic()
        next_check = 0.0
        if self.p.outage is not None:
            self.outcome.faults["outage"] += 1
        input_done: float | None = None
        while True:
            if input_done is None and generator.poll() is not None:
                input_done = time.monotonic()
                if generator.returncode != 0:
                    break
                if self._owed():
                    self.echo(f"  the input has stopped; faults still owed: {', '.join(self._owed())}")
            if input_done is not None:
                self.outcome.owed_wait_s = round(time.monotonic() - input_done, 1)
                if not self._owed() or self.outcome.owed_wait_s >= OWED_FAULTS_S:
                    break
            now = time.monotonic() - t0
            for dc in DCS:
                proc = self.joiners[dc]
                if dc in self.lost:
                    self._last_lease(dc, proc)
                    continue
                if proc is not None and proc.poll() is not None:
                    self.outcome.joiner_exits[f"{dc}:{proc.returncode}"] += 1
                    self._skewed_exit(dc, proc.returncode)
                    point = self.publishing.pop(dc, None)
                    if (
                        point
                        and proc.returncode == -signal.SIGKILL
                        # the spec is "<point>@+n"; the lease says "killed at <point> in batch k (<spec>)"
                        and f"killed at {point.split('@')[0]} in batch" in self.lease_log[dc].read_text()
                    ):
                        self.outcome.faults["died_publishing"] += 1
                if proc is None or proc.poll() is not None:
                    # Airflow starts the next lease (or retries a dead one)
                    self._start_lease(dc, self.next_clock.pop(dc, 0.0))
                    continue
                self._note_first_batch(dc, now, input_stopped=input_done is not None)
                self._kill_if_due(dc, proc, now)
            while faults and faults[0].at_s <= now:
                self._apply(faults.pop(0), now)
            if self.pg_up_at is not None and now >= self.pg_up_at:
                assert isinstance(self.registry, EmbeddedRegistry)
                self.registry.restart()
                self.pg_up_at = None
            self._store_back(now)
            self._workers_back(now)
            self._lose_primary(now)
            self._tend_failover()
            self._reap_verifier(now)
            self._maintain(now)
            if now >= next_check:
                self.check()
                next_check = now + 3.0
            time.sleep(0.2)
        if generator.returncode != 0:
            raise RuntimeError(f"the generator failed ({generator.returncode}); see {self.proc_logs}")
        if self.pg_up_at is not None:
            assert isinstance(self.registry, EmbeddedRegistry)
            self.registry.restart()
            self.pg_up_at = None
        self._store_back(None)
        self._workers_back(None)
        self._lose_primary(time.monotonic() - t0, at_once=True)  # every drawn fault happens, under the last leases
        self._tend_failover(wait=True)
        for fo in self.failovers:
            # During the live phase, by any lease (None: none committed after it before the input stopped).
            fo.first_commit_s = dict.fromkeys(DCS) | first_commits_after(self.owner, fo.killed_unix)
            self.outcome.failovers.append(fo.summary())
        for dc in DCS:  # the input stopped: the last leases die where they stand
            self.sigkill(self.joiners[dc])
            self._drop_kills(dc)
        if self.verifier is not None:
            self.verifier.wait()
            self._reap_verifier(time.monotonic() - t0)
        if self.maintainer is not None:
            self.maintainer.wait()
            self._maintain(time.monotonic() - t0)

    def drain(self) -> None:
        """Each surviving pipeline until caught up and no retry is left (in this process on ``spark``, if given)."""
        from photon.joiner.common import JoinSettings
        from photon.joiner.lease import Joiner

        settings = JoinSettings(max_join_delay_s=self.p.max_join_delay_s, trigger_interval_s=self.p.trigger_s)
        for dc in DCS:
            if dc in self.lost:
                continue
            if self.spark is not None:
                servers = {"main": self.dsn["photon_joiner"]}
                Joiner(dc, self.logs, self.out, servers, self.spark, settings).run(until_caught_up=True, drain=True)
            else:
                args = ["join", "--dc", dc, "--logs", str(self.logs), "--out", str(self.out), "--until-caught-up"]
                master = "local[2]" if self.p.spark == "local" else self.master
                args += ["--drain", "--max-join-delay", str(self.p.max_join_delay_s), "--master", master]
                if self._spawn(f"drain-{dc}", args, "photon_joiner").wait() != 0:
                    raise RuntimeError(f"draining {dc} failed; see {self.proc_logs}")
            self.check()

    def final_verify(self) -> dict[str, Any]:
        """One verifier pass, in this process, as the verifier's login."""
        from photon.recovery.verify import verify_and_recover
        from photon.storage import as_store

        servers = {"main": self.dsn["photon_verifier"]}
        return verify_and_recover(servers, as_store(self.out), as_store(self.logs), grace_s=self.p.grace_s).to_dict()

    def _finish(self) -> None:
        time.sleep(self.p.grace_s + 1)  # every killed lease is now gone: the verifier fences and recovers
        reports = []
        for _ in range(3):
            reports.append(self.final_verify())
            self.drain()
        reports.append(self.final_verify())
        for r in reports:
            self.outcome.verify["final_fenced"] += len(r["fenced"])
            self.outcome.verify["final_recovered"] += r["recovered"]
            self.outcome.verify["final_rolled_forward"] += len(r["rolled_forward"])
            self.outcome.verify["final_checked"] += r["checked"]
        # Passes killed mid-way report nothing: count what reached the logs instead (one replica's copy).
        survivor = sorted(set(DCS) - self.lost)[0]
        from photon.storage import as_store

        clicks = as_store(self.logs).child(f"{survivor}/clicks")
        self.outcome.verify["recovered_lines_in_logs"] = sum(
            len(clicks.get(e.key).splitlines())
            for e in clicks.listing()
            if e.key.rpartition("/")[2].startswith("recovered-") and e.key.endswith(".jsonl")
        )
        last = reports[-1]
        self.outcome.verdict = self.verdict().summary()
        self.outcome.verdict["last_verify_lost"] = last["lost"]
        self.outcome.verdict["last_verify_in_flight"] = last["in_flight"]

    def verdict(self) -> checker.Verdict:
        """The file-only checker's verdict over the logs, the manifest and every pipeline's output."""
        return checker.final(
            self.logs,
            self.out,
            lost=sorted(self.lost),
            max_join_delay_s=self.p.max_join_delay_s,
            margin_s=MARGIN_S,
            manifest_dir=self.manifest,
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--rate", type=float, default=300.0, help="events per second per replica")
    ap.add_argument("--work", type=Path, default=None, help="the run's folder, kept (default: a temp folder)")
    ap.add_argument("--keep", action="store_true", help="keep the temp folder of a run that passed")
    ap.add_argument(
        "--registry",
        choices=REGISTRIES,
        default="embedded",
        help="embedded: one PostgreSQL, stopped hard (pg_restart); cluster: the local three-node Patroni cluster, "
        "its primary lost (primary_lost)",
    )
    ap.add_argument(
        "--storage",
        choices=STORAGES,
        default="folder",
        help="folder: logs and output in the run's folder; s3: in a bucket of a local S3 server, restarted hard "
        "(store_restart)",
    )
    ap.add_argument(
        "--spark",
        choices=SPARKS,
        default="local",
        help="local: each lease's own Spark (local[1]); cluster: a standalone master and two workers, a worker "
        "SIGKILLed and restarted (worker_kill); needs --storage s3",
    )
    args = ap.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix=f"photon-nemesis-{args.seed}-"))
    p = plan(args.seed, args.seconds, args.rate, args.registry, args.storage, args.spark)
    if p.registry == "cluster":  # this process's own verify passes and drains are guarded too
        os.environ["PHOTON_REGISTRY_REPLICATION"] = ClusterRegistry.replication
    print(
        f"nemesis seed {p.seed}: {p.seconds:.0f}s, lost {p.lost}, outage {p.outage}, {p.storage}, spark {p.spark},"
        f" in {work}",
        flush=True,
    )
    for f in p.faults:
        print(f"  {f.at_s:7.1f}s {f.kind} {f.target} {f.arg:.1f}", flush=True)
    outcome: Outcome | None = None
    try:
        outcome = Nemesis(p, work).run()
    finally:
        kept = keep_work(work, owned=args.work is None, keep=args.keep, ok=outcome is not None and outcome.ok)
        print(f"work folder {work}: {'kept' if kept else 'removed'}", flush=True)
    print(json.dumps({**outcome.to_dict(), "work": str(work), "work_kept": kept}))
    return 0 if outcome.ok else 1


def keep_work(work: Path, *, owned: bool, keep: bool, ok: bool) -> bool:
    """Remove the run's folder (its logs, output and servers' data: hundreds of MB) if the run made it in the temporary
    folder, passed and was not asked to keep it; a failed run's is kept to look into. True if it is kept."""
    if not owned or keep or not ok:
        return True
    shutil.rmtree(work, ignore_errors=True)
    return False


if __name__ == "__main__":
    sys.exit(main())
