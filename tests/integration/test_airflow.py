"""The Airflow side on Airflow 3.3 for real: DAG integrity, and ``dag.test()`` runs of the joiner lease (through
SparkSubmitOperator and a real spark-submit), the data-quality checkpoint and the backfill, against real PostgreSQL.
The joiner, GC, verify and reshard DAGs run as logins holding only their component's role (``as_components``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg2.extensions
import pytest
from deltalake import DeltaTable, write_deltalake

from photon.registry.admin import init_registry
from photon.tools.audit import audit
from photon.tools.completeness import FINAL_ASSET_URI
from photon.tools.generator import GeneratorSettings, generate
from tests.integration.audit_fixtures import perfect_output

pytestmark = pytest.mark.integration
US = 1_000_000
ROOT = Path(__file__).resolve().parents[2]
DAGS = ROOT / "dags"
EXPECTED = {
    "photon_join_dc_a": ("ContinuousTimetable", ["joiner_lease"], 1),
    "photon_join_dc_a_standby": ("ContinuousTimetable", ["joiner_lease"], 1),  # the second lease slot
    "photon_join_dc_b": ("ContinuousTimetable", ["joiner_lease"], 1),
    "photon_join_dc_b_standby": ("ContinuousTimetable", ["joiner_lease"], 1),
    "photon_backfill": ("BackfillOnlyTimetable", ["backfill_dc_a", "backfill_dc_b"], 1),
    "photon_data_quality": ("AssetTriggeredTimetable", ["intervals", "checkpoint"], 2),
    "photon_finality": ("CronDataIntervalTimetable", ["wait_final", "declare_final"], 6),
    "photon_registry_gc": ("CronDataIntervalTimetable", ["collect_garbage"], 1),
    "photon_table_maintenance": ("CronDataIntervalTimetable", ["maintain_tables"], 1),
    "photon_verify_recover": ("DeltaTriggerTimetable", ["verify_and_recover"], 1),
    "photon_reshard": ("NullTimetable", ["reshard"], 1),
}


def dagbag() -> Any:
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(DAGS))


def registry_connection(dsn: str) -> str:
    """The ``photon_registry`` connection, as Airflow reads it from AIRFLOW_CONN_PHOTON_REGISTRY."""
    p = psycopg2.extensions.parse_dsn(dsn)
    return json.dumps(
        {
            "conn_type": "postgres",
            "host": p.get("host", "127.0.0.1"),
            "port": int(p["port"]) if p.get("port") else None,
            "login": p.get("user"),
            "password": p.get("password"),
            "schema": p.get("dbname"),
        }
    )


def conn_env(conn_id: str) -> str:
    return f"AIRFLOW_CONN_{conn_id.upper()}"


def task_states(run: Any) -> dict[str, str]:
    return {ti.task_id: str(ti.state) for ti in run.get_task_instances()}


@pytest.fixture
def env(airflow_db: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, make_db: Callable[[], str]) -> Iterator[Any]:
    """Connections and Variables for one test: a fresh registry, local Spark, logs and output under tmp_path."""
    dsn = make_db()
    init_registry({"main": dsn}, num_shards=4)
    monkeypatch.setenv("AIRFLOW_CONN_PHOTON_REGISTRY", registry_connection(dsn))
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[2]"}))
    monkeypatch.setenv("AIRFLOW_VAR_PHOTON_LOGS", str(tmp_path / "logs"))
    monkeypatch.setenv("AIRFLOW_VAR_PHOTON_OUT", str(tmp_path / "out"))

    class Env:
        logs, out, registry = tmp_path / "logs", tmp_path / "out", dsn

    yield Env


@pytest.fixture
def as_components(env: Any, login_as: Callable[[str, str], str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each component's connection (``photon_registry_<component>``) as a login holding only its role, and
    ``photon_registry`` itself as a login that does not exist: a DAG that fell back to it, or used another
    component's connection, would fail."""
    from photon.airflow.hooks import COMPONENT_ROLES, IdRegistryHook, component_conn_id

    for component, role in COMPONENT_ROLES.items():
        dsn = login_as(env.registry, role)
        conn_id = component_conn_id(IdRegistryHook.default_conn_name, component)
        monkeypatch.setenv(conn_env(conn_id), registry_connection(dsn))
    nobody = psycopg2.extensions.make_dsn(env.registry, user="photon_no_such_login", password="x")
    monkeypatch.setenv(conn_env(IdRegistryHook.default_conn_name), registry_connection(nobody))


def test_registry_hook_takes_the_component_connection_or_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from photon.airflow.hooks import IdRegistryHook
    from photon.airflow.operators import PhotonSparkSubmitOperator

    owner = "host=pg port=5432 user=photon password=o dbname=photon"
    gc = "host=pg port=5432 user=photon_gc_login password=g dbname=photon"
    monkeypatch.setenv("AIRFLOW_CONN_PHOTON_REGISTRY", registry_connection(owner))
    monkeypatch.setenv("AIRFLOW_CONN_PHOTON_REGISTRY_GC", registry_connection(gc))
    monkeypatch.delenv("AIRFLOW_CONN_PHOTON_REGISTRY_VERIFIER", raising=False)
    user = lambda hook: psycopg2.extensions.parse_dsn(hook.servers()["main"])["user"]  # noqa: E731
    assert user(IdRegistryHook(component="gc")) == "photon_gc_login"
    assert user(IdRegistryHook(component="verifier")) == "photon"  # not defined: photon_registry's login
    assert user(IdRegistryHook()) == "photon"
    with pytest.raises(ValueError, match="unknown registry component"):
        IdRegistryHook(component="admin")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown registry component"):
        PhotonSparkSubmitOperator(task_id="t", application="a.py", registry_component="owner")  # type: ignore[arg-type]


def test_dags_import_cleanly_with_the_expected_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow.sdk import Param

    monkeypatch.delenv("PHOTON_TASK_RETRIES")  # the shipped default
    bag = dagbag()
    assert bag.import_errors == {}
    assert set(bag.dags) == set(EXPECTED)
    for dag_id, (timetable, tasks, max_runs) in EXPECTED.items():
        dag = bag.dags[dag_id]
        assert type(dag.timetable).__name__ == timetable, dag_id
        assert sorted(t.task_id for t in dag.tasks) == sorted(tasks), dag_id
        assert dag.max_active_runs == max_runs and not dag.catchup, dag_id
        assert "photon" in dag.tags, dag_id
        assert all(t.retries >= 1 for t in dag.tasks) or dag_id == "photon_reshard", dag_id  # a reshard is not retried
        assert dag.params and all(isinstance(dag.params.get_param(k), Param) for k in dag.params), dag_id
        assert all(dag.params.get_param(k).schema.get("type") for k in dag.params), dag_id  # the UI's form
    join = bag.dags["photon_join_dc_a"].get_task("joiner_lease")
    assert type(join).__name__ == "PhotonSparkSubmitOperator" and join._conn_id == "spark_default"
    assert Path(join.application).is_file() and "--run-for" in join.application_args
    assert bag.dags["photon_join_dc_a"].get_task("joiner_lease").retry_exponential_backoff
    for task in [join, *bag.dags["photon_backfill"].tasks]:
        assert task.registry_component == "joiner" and task.registry_conn_id == "photon_registry", task.task_id
        assert {"registry_conn_id", "application_args", "env_vars"} <= set(task.template_fields), task.task_id
    quality, finality = bag.dags["photon_data_quality"], bag.dags["photon_finality"]
    assert [t.task_id for t in quality.get_task("intervals").downstream_list] == ["checkpoint"]
    assert [t.task_id for t in finality.get_task("wait_final").downstream_list] == ["declare_final"]
    assert finality.params["max_clock_skew_s"] == quality.params["max_clock_skew_s"]  # both follow the joiners'
    sensor = finality.get_task("wait_final")
    assert sensor.mode == "reschedule" and sensor.poke_interval == 60 and {"logs", "out"} <= set(sensor.template_fields)
    # Data quality runs on the asset the finality DAG emits, whose URI is the core package's.
    [asset] = finality.get_task("declare_final").outlets
    assert asset.uri == FINAL_ASSET_URI and quality.timetable.asset_condition.objects == (asset,)
    # An event names its hour as photon_finality writes it, or as a person creating one by hand would.
    from photon.airflow.dags import _event_interval

    h13 = 1_795_525_200 * US  # 2026-11-24T13:00:00Z
    assert _event_interval({"start_us": h13, "end_us": h13 + 3_600 * US}) == (h13, h13 + 3_600 * US)
    assert _event_interval({"start": "2026-11-24T13:00:00Z", "end": "2026-11-24T14:00"}) == (h13, h13 + 3_600 * US)
    with pytest.raises(ValueError, match="names no interval"):
        _event_interval({"hour": "13"})


def test_parsing_touches_no_network_and_no_registry(tmp_path: Path) -> None:
    """Parse the DAG folder in a fresh interpreter where any socket connection raises, with a registry connection
    that points nowhere: parsing must still succeed, quickly."""
    script = f"""
import socket, sys, time
def refuse(*a, **k):
    raise RuntimeError("network touched at parse time")
socket.socket.connect = refuse
socket.create_connection = refuse
t = time.time()
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder={str(DAGS)!r})
print(len(bag.dags), repr(bag.import_errors), round(time.time() - t, 1))
sys.exit(1 if bag.import_errors or len(bag.dags) != {len(EXPECTED)} else 0)
"""
    env = {**os.environ, "AIRFLOW_CONN_PHOTON_REGISTRY": "postgres://nobody:secret@203.0.113.1:5432/none"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "plugins"), str(ROOT)])
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]


@pytest.mark.usefixtures("as_components")
def test_join_dag_runs_a_lease_through_spark_submit(env: Any) -> None:
    start = (int(time.time()) - 600) * US
    generate(
        GeneratorSettings(events_per_s=600, dcs=("dc-a",), malformed_fraction=0.01, duplicate_fraction=0.02),
        env.logs,
        start_us=start,
        end_us=start + 20 * US,
    )
    dag = dagbag().dags["photon_join_dc_a"]
    run = dag.test(run_conf={"lease_s": 10, "trigger_interval_s": 0.5})
    assert task_states(run) == {"joiner_lease": "success"}
    report = audit(env.out, manifest=env.logs / "_manifest")
    assert report.ok, report.failures()
    assert report.outcomes["joined"] > 500 and report.quarantine["expected"] == report.quarantine["found"] > 0
    # A second lease resumes from the committed position: nothing new to write, nothing written twice.
    before = DeltaTable(str(env.out / "dc-a" / "joined")).file_uris()
    run = dag.test(run_conf={"lease_s": 10})
    assert task_states(run) == {"joiner_lease": "success"}
    assert DeltaTable(str(env.out / "dc-a" / "joined")).file_uris() == before


def _hour(ts_us: int) -> datetime:
    return datetime.fromtimestamp(ts_us / US, UTC).replace(minute=0, second=0, microsecond=0)


def test_data_quality_dag_passes_then_fails_on_a_planted_duplicate(env: Any) -> None:
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    start = (int(time.time()) - 7200) * US
    generate(GeneratorSettings(events_per_s=2_000), env.logs, start_us=start, end_us=start + 20 * US)
    perfect_output(env.logs, env.out)
    interval_end = _hour(start) + timedelta(hours=1)  # the run whose interval holds the clicks
    conf = {"max_unjoinable_rate": 0.2}
    dag = dagbag().dags["photon_data_quality"]

    run = dag.test(logical_date=interval_end, run_conf=conf)  # a manual run: the hour before its logical date
    assert task_states(run) == {"intervals": "success", "checkpoint": "success"}
    query = XComModel.get_many(run_id=run.run_id, key="summary", dag_ids="photon_data_quality", task_ids="checkpoint")
    with create_session() as session:
        value = XComModel.deserialize_value(session.scalars(query).one())
    assert value["success"] and value["joined"] > 1_000 and value["failed"] == []
    assert (env.out / "_quality" / "data_docs" / "index.html").is_file()

    row = DeltaTable(str(env.out / "dc-a" / "joined")).to_pyarrow_table().slice(0, 1)
    write_deltalake(str(env.out / "dc-b" / "joined"), row, mode="append")  # a duplicate committed to dc-b's table
    run = dag.test(logical_date=interval_end, run_conf=conf)
    assert task_states(run)["checkpoint"] == "failed"


def run_asset_triggered(dag: Any) -> tuple[str, dict[str, str]]:
    """Schedule ``dag`` on the asset events queued for it and run it, as a scheduler would, in this process: the
    scheduler's own code makes the run from the queue (consuming the events since its last run), then the run's
    tasks go through the loop ``dag.test()`` uses. Both are Airflow internals (3.3); a scheduler process would make
    the test a minute longer. Returns the run's id and its task states."""
    from airflow.jobs.job import Job
    from airflow.jobs.scheduler_job_runner import SchedulerJobRunner
    from airflow.models.dag import DagModel
    from airflow.models.dagrun import DagRun
    from airflow.sdk.definitions.dag import _run_task
    from airflow.serialization.serialized_objects import DagSerialization
    from airflow.utils.session import create_session
    from airflow.utils.state import DagRunState, TaskInstanceState
    from airflow.utils.types import DagRunType
    from sqlalchemy import select

    with create_session() as session:
        model = session.get(DagModel, dag.dag_id)
        SchedulerJobRunner(job=Job())._create_dag_runs_asset_triggered(dag_models=[model], session=session)
    with create_session() as session:
        run = session.scalars(
            select(DagRun).where(DagRun.dag_id == dag.dag_id, DagRun.run_type == DagRunType.ASSET_TRIGGERED)
        ).one()
        run.dag = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag))
        run.state = DagRunState.RUNNING
        session.commit()
        while run.state == DagRunState.RUNNING:
            session.expire_all()
            ready, _ = run.update_state(session=session)
            for ti in ready:
                ti.try_number += 1
                ti.state = TaskInstanceState.SCHEDULED
            session.commit()
            for ti in [t for t in run.get_task_instances(session=session) if t.state == TaskInstanceState.SCHEDULED]:
                _run_task(ti=ti, task=dag.task_dict[ti.task_id])
            session.commit()
        return run.run_id, task_states(run)


@pytest.mark.usefixtures("as_components")
def test_a_final_hour_triggers_data_quality_which_finds_every_click_decided(
    env: Any, spark: Any, login_as: Callable[[str, str], str]
) -> None:
    """A pipeline joins an hour of logs; photon_finality finds the hour final, writes its marker and emits the asset
    event; photon_data_quality, scheduled on that asset, runs for that hour and finds every click of it with exactly
    one outcome."""
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import sync_bag_to_db
    from airflow.models.dag import DagModel
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    from photon.joiner.common import JoinSettings
    from photon.joiner.lease import Joiner

    hour = _hour(int(time.time() * US)) - timedelta(hours=2)
    start_us = int(hour.timestamp() * US)
    settings = GeneratorSettings(
        events_per_s=5,
        dcs=("dc-a",),
        query_servers=2,  # few, larger files: a batch costs what its files number
        click_servers=2,
        rotate_s=300,
        chunk_s=300,
        late_click_fraction=0.0,
    )
    generate(settings, env.logs, start_us=start_us, end_us=start_us + 3_600 * US)
    # It joins history, as a backfill does (the data-quality check holds live pipelines to the latency SLO).
    joiner = {"main": login_as(env.registry, "photon_joiner")}
    pipeline = f"backfill-dc-a-{hour:%Y%m%d%H%M}"
    Joiner("dc-a", env.logs, env.out, joiner, spark, JoinSettings(trigger_interval_s=0.1), pipeline=pipeline).run(
        until_caught_up=True, drain=True
    )

    bag = dagbag()
    quality = bag.dags["photon_data_quality"]
    # Scheduled on the asset and unpaused (Airflow queues no event for a paused DAG): the DAGs go into the metadata
    # database first, as the DAG processor would put them there.
    DagBundlesManager().sync_bundles_to_db()
    sync_bag_to_db(bag, "dags-folder", None)
    with create_session() as session:
        session.get(DagModel, quality.dag_id).is_paused = False
    run = bag.dags["photon_finality"].test(logical_date=hour + timedelta(hours=1))
    assert task_states(run) == {"wait_final": "success", "declare_final": "success"}
    marker = json.loads((env.out / "_final" / f"{hour:%Y%m%d%H}.json").read_text())
    assert marker["final"] and marker["start_us"] == start_us and marker["input_clicks"] > 1_000

    run_id, states = run_asset_triggered(quality)
    assert states == {"intervals": "success", "checkpoint": "success"}
    with create_session() as session:
        query = XComModel.get_many(run_id=run_id, key="summary", dag_ids=quality.dag_id, task_ids="checkpoint")
        summary = XComModel.deserialize_value(session.scalars(query).one())
    assert (summary["start_us"], summary["end_us"]) == (start_us, start_us + 3_600 * US)
    assert summary["success"] and summary["input_clicks"] == marker["input_clicks"]
    assert summary["no_outcome"] == summary["joined_more_than_once"] == 0


def test_backfill_over_two_intervals_twice_equals_once(
    env: Any, monkeypatch: pytest.MonkeyPatch, warm_spark: Path
) -> None:
    from photon.tools.spark_connect import TOKEN_ENV, connection

    monkeypatch.setenv("PHOTON_DCS", "dc-a")  # one data center keeps the test short; the DAG makes one per dc
    # Its four tasks join on the test process's warm Spark Connect server, as photon airflow's backfill tasks do (a
    # Spark start each cost 188 s under the suite's load); test_join_dag_runs_a_lease_through_spark_submit starts one.
    remote, token = connection(warm_spark)
    monkeypatch.setenv("PHOTON_SPARK_REMOTE", remote)
    monkeypatch.setenv(TOKEN_ENV, token)
    first_hour = _hour(int(time.time() * US)) - timedelta(hours=4)
    start = int(first_hour.timestamp() * US) + 30 * 60 * US  # logs from half past, over two hourly intervals
    settings = GeneratorSettings(
        events_per_s=40,
        dcs=("dc-a",),
        rotate_s=60.0,
        chunk_s=60.0,
        late_click_fraction=0.0,
        late_query_file_fraction=0.0,
        malformed_fraction=0.005,
    )
    generate(settings, env.logs, start_us=start, end_us=start + 60 * 60 * US)
    dag = dagbag().dags["photon_backfill"]
    assert [t.task_id for t in dag.tasks] == ["backfill_dc_a"]

    def backfill() -> dict[str, list[str]]:
        for hour in (1, 2):  # the runs for [first_hour, +1h) and [+1h, +2h)
            run = dag.test(logical_date=first_hour + timedelta(hours=hour), run_conf={"max_join_delay_s": 120})
            assert task_states(run) == {"backfill_dc_a": "success"}
        return {
            kind: sorted(
                cid
                for p in env.out.glob(f"[!_]*/{kind}")
                for cid in DeltaTable(str(p)).to_pyarrow_table(columns=["click_id"])["click_id"].to_pylist()
            )
            for kind in ("joined", "unjoinable")
        }

    once = backfill()
    assert sorted(p.name for p in env.out.iterdir() if not p.name.startswith("_")) == [
        f"backfill-dc-a-{(first_hour + timedelta(hours=h)):%Y%m%d%H%M}" for h in (0, 1)
    ]
    report = audit(env.out, manifest=env.logs / "_manifest")
    assert report.ok, report.failures()
    assert len(once["joined"]) > 5_000 and len(set(once["joined"])) == len(once["joined"])
    twice = backfill()
    assert twice == once
    shutil.rmtree(env.out / "_quality", ignore_errors=True)


@pytest.fixture
def spark_cluster(tmp_path: Path) -> Iterator[tuple[str, int]]:
    """A Spark standalone master and one worker of 2 cores, as `photon spark up` starts them."""
    from photon.tools import spark_cluster

    cluster = spark_cluster.start(tmp_path / "spark", workers=1, cores=2, memory="2g")
    try:
        yield cluster.master_url, cluster.ui_port
    finally:
        spark_cluster.stop(tmp_path / "spark")


@pytest.mark.long
def test_join_lease_on_a_spark_standalone_cluster(
    env: Any, spark_cluster: tuple[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    import urllib.request

    master, ui = spark_cluster
    host, port = master.rsplit(":", 1)
    monkeypatch.setenv(
        "AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": host, "port": int(port)})
    )
    start = (int(time.time()) - 600) * US
    generate(GeneratorSettings(events_per_s=600, dcs=("dc-a",)), env.logs, start_us=start, end_us=start + 20 * US)
    run = dagbag().dags["photon_join_dc_a"].test(run_conf={"lease_s": 10})
    assert task_states(run) == {"joiner_lease": "success"}
    report = audit(env.out, manifest=env.logs / "_manifest")
    assert report.ok and report.outcomes["joined"] > 500, report.failures()
    with urllib.request.urlopen(f"http://127.0.0.1:{ui}/json/", timeout=5) as r:
        apps = json.load(r)
    names = [a["name"] for a in apps["completedapps"] + apps["activeapps"]]
    assert "photon-join-dc-a" in names  # the lease ran on the cluster, not in local mode


@pytest.mark.usefixtures("as_components")
def test_registry_gc_dag_frees_old_rows(env: Any) -> None:
    from photon.logs.ids import make_id
    from photon.registry.client import IdRegistry
    from photon.registry.owners import create_owner

    now = int(time.time() * US)
    old, recent = [make_id("10.0.0.1", 1, now - 5 * 3600 * US + i) for i in range(100)], [make_id("10.0.0.1", 1, now)]
    IdRegistry({"main": env.registry}).register(old + recent, create_owner(env.registry, "dc-a").token(1))
    # A fresh DagBag per run: dag.test() in one process leaves the previous run's conf in the DAG's params.
    run = dagbag().dags["photon_registry_gc"].test(run_conf={"retention_s": 3600, "dry_run": True})
    assert task_states(run) == {"collect_garbage": "success"}
    run = dagbag().dags["photon_registry_gc"].test(run_conf={"retention_s": 3600})
    assert task_states(run) == {"collect_garbage": "success"}
    from photon.registry.admin import status

    rows = sum(sh["rows"] for cfg in status({"main": env.registry})["configs"] for sh in cfg["shards"])
    assert rows == 1  # the 100 old ids are gone, the recent one stays


@pytest.mark.usefixtures("as_components")
def test_verify_recover_dag_clears_committed_tokens_with_logs_and_output_in_a_bucket(
    env: Any,
    s3_server: Any,
    bucket: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """The join and verify DAGs on s3:// Variables, the store's key only in the ``photon_storage`` connection (no
    AWS variable in the worker's environment): the join task's job gets it in its environment, never on its command
    line, and the verify task opens the bucket with it."""
    from photon.storage import S3Store

    aws = s3_server.env()
    logs, out = f"s3://{bucket}/logs", f"s3://{bucket}/out"
    start = (int(time.time()) - 600) * US
    generate(
        GeneratorSettings(events_per_s=600, dcs=("dc-a",)), logs, start_us=start, end_us=start + 10 * US,
        manifest=tmp_path / "manifest",
    )  # fmt: skip
    connection = {
        "conn_type": "aws",
        "login": aws["AWS_ACCESS_KEY_ID"],
        "password": aws["AWS_SECRET_ACCESS_KEY"],
        "extra": {"endpoint_url": aws["AWS_ENDPOINT_URL"], "region_name": aws["AWS_REGION"]},
    }
    monkeypatch.setenv(conn_env("photon_storage"), json.dumps(connection))
    monkeypatch.setenv("AIRFLOW_VAR_PHOTON_LOGS", logs)
    monkeypatch.setenv("AIRFLOW_VAR_PHOTON_OUT", out)
    for name in aws:
        monkeypatch.delenv(name, raising=False)
    run = dagbag().dags["photon_join_dc_a"].test(run_conf={"lease_s": 10})
    assert task_states(run) == {"joiner_lease": "success"}
    run = dagbag().dags["photon_verify_recover"].test(run_conf={"grace_s": 600})
    assert task_states(run) == {"verify_and_recover": "success"}
    from photon.recovery.verify import verify_and_recover

    options = {k.lower(): v for k, v in aws.items()}
    stores = S3Store(out, options), S3Store(logs, options)
    assert list(stores[0].listing("dc-a/joined"))  # the lease wrote its output into the bucket
    again = verify_and_recover({"main": env.registry}, *stores, dry_run=True)
    assert again.checked == 0  # the DAG's run cleared every committed click's token
    said = capfd.readouterr()
    assert "spark-submit" in said.out + said.err and aws["AWS_SECRET_ACCESS_KEY"] not in said.out + said.err


@pytest.mark.usefixtures("as_components")
def test_reshard_dag_activates_a_new_configuration(env: Any) -> None:
    from photon.registry.admin import status

    run = dagbag().dags["photon_reshard"].test(run_conf={"num_shards": 6, "lead_s": 3, "max_clock_skew_s": 1})
    assert task_states(run) == {"reshard": "success"}
    configs = status({"main": env.registry})["configs"]
    assert [(c["version"], c["num_shards"], c["state"]) for c in configs] == [(1, 4, "active"), (2, 6, "active")]
