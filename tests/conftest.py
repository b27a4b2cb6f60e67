"""Shared fixtures. The registry tests run against a real PostgreSQL: the one PHOTON_REGISTRY_DSN names, or else an
embedded server started for this test session. Every test gets its own database(s), dropped afterwards."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# Airflow reads its configuration when first imported: point it at a throwaway home (a SQLite metadata database,
# this project's DAGs, no examples) before any test imports it. The user's own Airflow is never touched.
_AIRFLOW_HOME = tempfile.mkdtemp(prefix="photon-airflow-tests-")
# Removed when this process exits, whether or not a test used it (the airflow_db fixture removes it too): each
# pytest process and xdist worker used to leave one behind in /tmp.
atexit.register(shutil.rmtree, _AIRFLOW_HOME, ignore_errors=True)
os.environ["AIRFLOW_HOME"] = _AIRFLOW_HOME
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(Path(__file__).resolve().parents[1] / "dags")
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "false"
os.environ["AIRFLOW__CORE__PLUGINS_FOLDER"] = str(Path(__file__).resolve().parents[1] / "plugins")
os.environ["GX_ANALYTICS_ENABLED"] = "false"
os.environ["PHOTON_TASK_RETRIES"] = "0"  # a failing task in dag.test() fails at once instead of backing off
# pytest-xdist's workers start with COLUMNS=80, which a rich Console created at import (photon.cli's) would keep for
# good: tests that set COLUMNS for one command (a wide `photon status` table) must see it.
# Every test server is a lone PostgreSQL (the embedded one, or the machine's named by PHOTON_REGISTRY_DSN, where the
# guard's default would refuse it): the replication guard's own tests ask for "required" themselves.
os.environ.setdefault("PHOTON_REGISTRY_REPLICATION", "single")
# Every Spark driver the suite starts (its own session, and the dozens of joiner, backfill and spark-submit processes
# its tests launch) is short-lived: the client compiler alone costs each about a third less CPU (16.5 -> 10.9
# CPU-seconds for one small `photon join`), and on 2 cores shared by three workers CPU is what the suite waits on.
os.environ.setdefault("PHOTON_SPARK_DRIVER_JAVA_OPTIONS", "-XX:TieredStopAtLevel=1")
# And each maps Spark's classes from an archive made once per virtual environment (tests/spark_cds.py): about half
# of what remains of a start. Made by the run's first process, before pytest-xdist starts its workers (they inherit
# the option).
if "PYTEST_XDIST_WORKER" not in os.environ:
    from tests.spark_cds import ensure_archive, java_options

    if (_archive := ensure_archive(dict(os.environ))) is not None:
        os.environ["PHOTON_SPARK_DRIVER_JAVA_OPTIONS"] += f" {java_options(_archive)}"
# The standalone masters and workers the cluster tests start (photon.tools.spark_cluster passes the environment on),
# and their executors (spark.executor.extraJavaOptions, set by those tests): as short-lived as the drivers.
os.environ.setdefault("SPARK_DAEMON_JAVA_OPTS", os.environ["PHOTON_SPARK_DRIVER_JAVA_OPTIONS"])
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)

from photon.pg import EmbeddedPostgres, create_database, drop_database, with_dbname  # noqa: E402


@pytest.fixture(scope="session")
def pg_admin_dsn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    dsn = os.environ.get("PHOTON_REGISTRY_DSN")
    if dsn:
        # Databases are created beside the one named; that one is never touched.
        yield with_dbname(dsn, "postgres")
        return
    server = EmbeddedPostgres(Path(tmp_path_factory.mktemp("pg")) / "data", cleanup_mode="delete")
    server.start()
    try:
        yield server.admin_dsn
    finally:
        server.stop()


@pytest.fixture
def make_db(pg_admin_dsn: str) -> Iterator[Callable[[], str]]:
    """Factory of fresh databases for one test; all dropped at teardown."""
    made: list[str] = []

    def make() -> str:
        name = f"photon_t_{uuid.uuid4().hex[:12]}"
        made.append(name)
        return create_database(pg_admin_dsn, name)

    yield make
    for name in made:
        drop_database(pg_admin_dsn, name)


@pytest.fixture(scope="session")
def spark() -> Iterator[object]:
    """One local SparkSession for the whole test run (a session takes 10-20 s to start)."""
    from photon.spark_session import get_spark

    session = get_spark("photon-tests", master="local[2]", shuffle_partitions=4)
    yield session
    session.stop()


@pytest.fixture(scope="session")
def airflow_db() -> Iterator[str]:
    """A migrated Airflow metadata database (SQLite) in the session's throwaway AIRFLOW_HOME."""
    airflow = Path(sys.executable).parent / "airflow"
    result = subprocess.run([str(airflow), "db", "migrate"], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    yield _AIRFLOW_HOME
    shutil.rmtree(_AIRFLOW_HOME, ignore_errors=True)


@pytest.fixture
def login_as(pg_admin_dsn: str) -> Iterator[Callable[[str, str], str]]:
    """Factory of least-privilege logins: ``login_as(dsn, "photon_verifier")`` creates a LOGIN role that holds only
    that NOLOGIN role and returns ``dsn`` connecting as it. Components run under these in tests, never as a
    superuser. The roles are dropped at teardown."""
    import psycopg2.extensions
    from psycopg2 import sql

    from photon.pg import autocommit

    made: list[str] = []

    def make(dsn: str, role: str) -> str:
        name = f"photon_t_{uuid.uuid4().hex[:10]}_{role.removeprefix('photon_')}"
        password = uuid.uuid4().hex
        with autocommit(pg_admin_dsn) as conn, conn.cursor() as cur:
            cur.execute(
                sql.SQL("CREATE ROLE {} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD %s IN ROLE {}").format(
                    sql.Identifier(name), sql.Identifier(role)
                ),
                (password,),
            )
        made.append(name)
        return psycopg2.extensions.make_dsn(dsn, user=name, password=password)

    yield make
    # A plain connection: a session that exits between pg_stat_activity and pg_terminate_backend makes the server
    # warn ("PID ... is not a PostgreSQL backend process"), which photon.pg's guarded cursor takes, as it must for the
    # registry's own statements, for a commit no standby may hold.
    conn = psycopg2.connect(pg_admin_dsn)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            for name in made:
                # Sessions still open as the role (a Spark worker's cached registry client) hold temp tables it owns.
                cur.execute("SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity WHERE usename = %s", (name,))
                cur.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))
    finally:
        conn.close()


# The slowest tests as measured last (`make test` prints the 15 slowest), longest first, each a node id or the
# prefix of some. `make test` runs pytest-xdist's `load` scheduling one test at a time (--maxschedchunk 1): each
# worker starts with the next two tests of the collection and then takes the next one whenever it is free. So the
# collection deals the long tests first, each followed by a short one (a worker's first two tests are not one pair of
# long ones), and the many short tests fill the gaps. (Work stealing and `load`'s default chunks hand each worker a
# contiguous block at the start, which put every long test on one worker: it ran alone for the last few minutes.)
SLOW_FIRST = (
    # (seconds: a full `make test` here, 3 workers on 2 cores)
    "tests/integration/test_airflow_local.py::test_backfill_while_a_joiner_lease_runs",  # 395-650 s
    "tests/integration/test_nemesis.py",  # 281 s
    "tests/integration/test_handover.py::test_standby_leases_hand_over_on_release",  # 213 s
    # 167 s, and its module's three-node cluster 20-30 s to start
    "tests/integration/test_failover_load.py::test_both_joiners_carry_on_across_a_lost_primary",
    "tests/integration/test_airflow.py::test_backfill_over_two_intervals",  # 33 s on the warm Spark Connect server
    "tests/integration/test_airflow.py::test_join_dag_runs_a_lease",  # 125 s
    # 435 s and 445 s with a Spark start per lease; on the test process's warm Spark Connect server 25-27 s alone
    "tests/integration/test_joiner.py::test_sigkilled_joiner_restarted",
    "tests/integration/test_verify.py::test_killed_joiner_losses",
    "tests/unit/test_parse_properties.py::test_mutated_events",  # 82 s at 3,000 examples
    "tests/integration/test_quiet_output.py",  # 36 s and 23 s (a join task through spark-submit; a join)
    "tests/integration/test_verify_safety.py::test_the_surviving_data_center",  # 51 s, 44 s
    "tests/integration/test_reshard.py::test_reshard_4_to_12",  # 70 s
    "tests/integration/test_object_store_cluster.py",  # 124 s alone: a Spark cluster, two pipelines, three leases
    "tests/integration/test_object_store_output.py",  # 80 s and 53 s: a Spark start per pipeline process
    "tests/integration/test_readme_walk.py::test_a_newcomer_pastes_the_first_run",  # 45 s: two pasted joins
    "tests/integration/test_audit.py::test_logs_mode",  # 77 s with its fixture
    "tests/unit/test_parse_properties.py::test_random_bytes",  # 48 s
    "tests/integration/test_airflow.py",  # 46 s, 45 s, ...
    "tests/integration/test_completeness.py",  # 18-50 s
    "tests/integration/test_spark_connect.py",  # 22 s and 25 s, each with a Spark Connect server of its own
    "tests/integration/test_acknowledged_replicated_paths.py",  # five server pairs, 3-10 s each
    "tests/integration/test_acknowledged_replicated.py",  # four server pairs, 6-8 s each
    "tests/integration/test_start.py",  # 15-73 s
    "tests/integration/test_object_store_logs.py",  # 30 s
    "tests/integration/test_lease_start_sweep.py",  # 4 x 10 s
    "tests/integration/test_join_signals.py",  # 9-13 s each, a real `photon join` apiece
    "tests/integration/test_table_publish.py",  # 7-30 s: racing publishers, two leases and the verifier
    "tests/integration/test_table_maintenance.py",
    "tests/integration/test_airflow_local.py",  # 43 s, 32 s
    "tests/integration/test_durability.py",
    "tests/unit/test_parse_properties.py",
    "tests/integration/test_verify_safety.py",
    "tests/integration/test_backfill.py",
    "tests/unit/test_generator.py",
    "tests/integration/test_hostile_input.py",
    "tests/integration/test_clock.py",
    "tests/integration/test_handover.py",
    "tests/integration/test_reshard.py",
    "tests/integration/test_verify.py",
    "tests/integration/test_joiner.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        return next((i for i, prefix in enumerate(SLOW_FIRST) if item.nodeid.startswith(prefix)), len(SLOW_FIRST))

    ranked = sorted(items, key=rank)  # stable: the collection's order within a rank
    slow = [item for item in ranked if rank(item) < len(SLOW_FIRST)]
    rest = ranked[len(slow) :]
    dealt = [x for pair in zip(slow, rest, strict=False) for x in pair]
    items[:] = dealt + slow[len(dealt) // 2 :] + rest[len(dealt) // 2 :]


# `make test` with PHOTON_TEST_CPU=<file>: each test's CPU seconds (this process, the processes it started and waited
# for, and those still running: a session's Spark counts for the test it ran for), the whole machine's busy seconds
# meanwhile, and its wall time, appended to <file> as "cpu<TAB>machine<TAB>wall<TAB>nodeid". On 2 cores shared by
# three workers, CPU is what the suite's wall time is made of: --durations shows how long a test waited, this what
# it cost the others. (A daemon, like the embedded PostgreSQL, or an orphan is outside the tree: in a run of one
# worker, the machine's column counts them.)
_CPU_LOG = os.environ.get("PHOTON_TEST_CPU")


def _cpu_now() -> tuple[float, dict[tuple[int, float], float]]:
    import resource

    import psutil

    own = sum(
        getattr(resource.getrusage(who), field)
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        for field in ("ru_utime", "ru_stime")
    )
    live: dict[tuple[int, float], float] = {}
    for proc in psutil.Process().children(recursive=True):
        with __import__("contextlib").suppress(psutil.Error):
            t = proc.cpu_times()
            live[(proc.pid, proc.create_time())] = t.user + t.system
    return own, live


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if not _CPU_LOG:
        yield
        return
    import time

    import psutil

    own0, live0 = _cpu_now()
    t0, all0 = time.monotonic(), psutil.cpu_times()
    yield
    own1, live1 = _cpu_now()
    all1 = psutil.cpu_times()
    # The whole machine's busy seconds too: in a run of one worker, what the test cost, orphans included.
    machine = sum(getattr(all1, f) - getattr(all0, f) for f in ("user", "system", "nice", "irq", "softirq"))
    # A process alive at both ends: what it used meanwhile; started since: all of it; ended since (and reaped into
    # RUSAGE_CHILDREN with its whole life): less what it had used before the test.
    live = sum(cpu - live0.get(key, 0.0) for key, cpu in live1.items())
    ended = sum(cpu for key, cpu in live0.items() if key not in live1)
    with open(_CPU_LOG, "a") as f:
        f.write(f"{own1 - own0 + live - ended:.1f}\t{machine:.1f}\t{time.monotonic() - t0:.1f}\t{item.nodeid}\n")
