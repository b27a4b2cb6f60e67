"""``photon airflow``'s pure parts: its airflow.cfg edits, the metadata URL, the executor's size, the components'
environment, photon_backfill's timetable (no run from the scheduler, every interval of a backfill), and the join DAGs'
default lease (from the environment at parse time)."""

from __future__ import annotations

import json
from configparser import ConfigParser
from datetime import UTC, datetime
from pathlib import Path

import pendulum
import pytest

from photon.airflow.standalone import QUIET_LOGGERS, LocalAirflow, default_parallelism, sqlalchemy_url, write_config


def deployment(tmp_path: Path, **kw: object) -> LocalAirflow:
    return LocalAirflow(
        airflow_home=tmp_path / "airflow",
        photon_home=tmp_path,
        metadata_url="postgresql+psycopg2://postgres@/airflow?host=%2Ftmp%2Fpg",
        registry={"main": "host=/tmp/pg user=postgres dbname=photon"},
        **kw,  # type: ignore[arg-type]
    )


def test_write_config_sets_values_keeps_the_rest_and_escapes_percent(tmp_path: Path) -> None:
    cfg = tmp_path / "airflow.cfg"
    cfg.write_text(
        "[core]\n# The folder where your airflow pipelines live\ndags_folder = /old\nfernet_key = abc\n\n"
        "[database]\n# comment\nsql_alchemy_conn = sqlite:////x.db\n[api]\nhost = 0.0.0.0\n"
    )
    write_config(
        cfg,
        {
            "core": {"dags_folder": "/new", "parallelism": "8"},
            "database": {"sql_alchemy_conn": "postgresql+psycopg2://u@/airflow?host=%2Ftmp"},
            "api": {"host": "127.0.0.1"},
            "extra": {"key": "v"},
        },
    )
    text = cfg.read_text()
    assert "# The folder where your airflow pipelines live" in text and "fernet_key = abc" in text
    assert text.count("dags_folder") == 1 and "sqlite" not in text
    parsed = ConfigParser()  # Airflow's parser interpolates: '%' must come back as one
    parsed.read(cfg)
    assert parsed["core"]["dags_folder"] == "/new" and parsed["core"]["parallelism"] == "8"
    assert parsed["database"]["sql_alchemy_conn"] == "postgresql+psycopg2://u@/airflow?host=%2Ftmp"
    assert parsed["api"]["host"] == "127.0.0.1" and parsed["extra"]["key"] == "v"
    assert cfg.stat().st_mode & 0o077 == 0  # it may hold a database password
    write_config(cfg, {"core": {"dags_folder": "/new"}})
    assert cfg.read_text() == text  # idempotent


def test_sqlalchemy_url_from_socket_and_tcp_dsns() -> None:
    assert sqlalchemy_url("postgresql://postgres:@/photon?host=/tmp/h/postgres") == (
        "postgresql+psycopg2://postgres@/photon?host=%2Ftmp%2Fh%2Fpostgres"
    )
    assert (
        sqlalchemy_url("host=/tmp/s port=5433 user=p dbname=a")
        == "postgresql+psycopg2://p@/a?host=%2Ftmp%2Fs&port=5433"
    )
    assert sqlalchemy_url("host=db port=5432 user=u password=p@s% dbname=airflow sslmode=require") == (
        "postgresql+psycopg2://u:p%40s%25@db:5432/airflow?sslmode=require"
    )


def test_parallelism_leaves_room_beside_every_joiner_lease() -> None:
    assert default_parallelism(2, cpus=2) == 10  # this machine: 2 leases, 2 standbys, 6 for backfill, quality, GC...
    assert default_parallelism(2, cpus=16) == 36
    assert default_parallelism(3, cpus=1) == 12


def test_environment_binds_loopback_and_keeps_what_the_caller_set(tmp_path: Path) -> None:
    d = deployment(tmp_path, port=18080)
    env = d.environment({"PATH": "/bin", "AIRFLOW_CONN_PHOTON_REGISTRY_JOINER": "j", "AIRFLOW_VAR_PHOTON_LOGS": "/l"})
    assert env["AIRFLOW__API__HOST"] == "127.0.0.1" and env["AIRFLOW__API__PORT"] == "18080"
    assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == "http://127.0.0.1:18080/execution/"
    assert env["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor" and env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith(
        "postgresql+psycopg2://"
    )
    assert env["AIRFLOW_CONN_PHOTON_REGISTRY_JOINER"] == "j" and env["AIRFLOW_VAR_PHOTON_LOGS"] == "/l"
    assert json.loads(env["AIRFLOW_CONN_PHOTON_REGISTRY"])["schema"] == "photon"
    assert env["SPARK_LOCAL_IP"] == "127.0.0.1"  # local[*]: the driver stays on loopback
    cluster = d.environment({"AIRFLOW_CONN_SPARK_DEFAULT": '{"conn_type": "spark", "host": "spark://m"}'})
    assert "SPARK_LOCAL_IP" not in cluster
    everywhere = deployment(tmp_path, host="0.0.0.0").environment({})
    assert everywhere["AIRFLOW__API__HOST"] == "0.0.0.0"
    assert everywhere["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == "http://127.0.0.1:8080/execution/"
    assert [c[1] for c in d.component_commands().values()] == ["scheduler", "dag-processor", "triggerer", "api-server"]
    assert d.component_commands()["api-server"][-4:] == ["--host", "127.0.0.1", "--port", "18080"]


def test_backfill_only_timetable_gives_the_scheduler_nothing_and_a_backfill_every_hour() -> None:
    from airflow.timetables.base import TimeRestriction

    from photon.airflow.timetables import BackfillOnlyTimetable

    tt = BackfillOnlyTimetable()
    start = pendulum.datetime(2025, 1, 1, tz="UTC")
    # The scheduler's question: the DAG's own restriction (start date, no end date, catchup=False).
    assert (
        tt.next_dagrun_info(last_automated_data_interval=None, restriction=TimeRestriction(start, None, False)) is None
    )
    assert tt.periodic and not tt.can_be_scheduled
    # A backfill's: every interval whose start lies in [from, to], both inclusive.
    frm, to = pendulum.datetime(2026, 11, 20, 0, tz="UTC"), pendulum.datetime(2026, 11, 20, 5, tz="UTC")
    infos, last = [], None
    while info := tt.next_dagrun_info(last_automated_data_interval=last, restriction=TimeRestriction(frm, to, True)):
        infos.append(info)
        last = info.data_interval
    assert [(i.data_interval.start.hour, i.data_interval.end.hour) for i in infos] == [(h, h + 1) for h in range(6)]
    # A manual trigger at 03:30 joins the hour before it, as for any hourly data-interval timetable.
    manual = tt.infer_manual_data_interval(run_after=pendulum.datetime(2026, 11, 20, 3, 30, tz="UTC"))
    assert (manual.start, manual.end) == (datetime(2026, 11, 20, 2, tzinfo=UTC), datetime(2026, 11, 20, 3, tzinfo=UTC))
    assert BackfillOnlyTimetable.deserialize(tt.serialize()) == tt and tt.summary == "0 * * * * (backfill only)"


def test_the_join_dags_default_lease_comes_from_the_environment_at_parse_time(monkeypatch: pytest.MonkeyPatch) -> None:
    from photon.airflow.dags import join_dag, lease_s

    monkeypatch.setenv("PHOTON_JOIN_LEASE_S", "45")  # e.g. bench/handover_airflow.py: several hand-overs in minutes
    dag = join_dag("dc-a", standby=True)
    assert dag.params["lease_s"] == 45 == lease_s()
    args = dag.get_task("joiner_lease").application_args
    assert args[args.index("--hand-over-wait") + 1] == "{{ params.hand_over_wait_s }}" and "--standby" in args
    assert dag.params["hand_over_wait_s"] == 120
    monkeypatch.delenv("PHOTON_JOIN_LEASE_S")
    assert lease_s() == 300
    monkeypatch.setenv("PHOTON_JOIN_LEASE_S", "5")
    with pytest.raises(ValueError, match="10 to 3600"):
        lease_s()


def test_gc_and_data_quality_follow_the_configured_clock_skew_at_parse_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A raised PHOTON_MAX_CLOCK_SKEW_S moves the joiners' seal (2 x skew + 40 s); the data-quality DAG's settle time
    and GC's threshold must follow it, or an hour is judged before its input files are final."""
    from photon.airflow.dags import data_quality_dag, registry_gc_dag

    monkeypatch.setenv("PHOTON_MAX_CLOCK_SKEW_S", "30")
    assert data_quality_dag().params["max_clock_skew_s"] == 30 == registry_gc_dag().params["max_clock_skew_s"]
    monkeypatch.delenv("PHOTON_MAX_CLOCK_SKEW_S")
    assert data_quality_dag().params["max_clock_skew_s"] == 10 == registry_gc_dag().params["max_clock_skew_s"]


def test_the_console_is_quiet_unless_asked(tmp_path: Path) -> None:
    """By default the access log and the DAG-parse bookkeeping stay out of the console (warnings kept), and the DAG
    processor's statistics come every 5 minutes; --access-log brings the access log back, --verbose Airflow's own
    levels. A caller's own namespace levels come after ours, so they win."""
    quiet = deployment(tmp_path).options()
    levels = dict(pair.split("=") for pair in quiet["logging"]["namespace_levels"].split())
    assert levels == dict.fromkeys(["http.access", *QUIET_LOGGERS], "warning")
    assert "airflow.models.dagrun" not in levels  # a run's end ("Marking run ... failed") shows
    assert quiet["dag_processor"]["print_stats_interval"] == "300"
    asked = deployment(tmp_path, access_log=True).options()["logging"]["namespace_levels"]
    assert "http.access" not in asked and "airflow.models.dag=warning" in asked
    verbose = deployment(tmp_path, verbose=True).options()
    assert "logging" not in verbose and "dag_processor" not in verbose
    env = deployment(tmp_path).environment({"AIRFLOW__LOGGING__NAMESPACE_LEVELS": "http.access=info"})
    assert env["AIRFLOW__LOGGING__NAMESPACE_LEVELS"].endswith(" http.access=info")
    assert env["AIRFLOW__LOGGING__NAMESPACE_LEVELS"].startswith("airflow.serialization.definitions.dag=warning")


def test_the_ready_message_has_url_user_and_password_on_one_line(tmp_path: Path) -> None:
    from photon.airflow.standalone import ready_lines

    d = deployment(tmp_path, port=18080)
    d.password_file.parent.mkdir(parents=True)
    d.password_file.write_text(json.dumps({"admin": "s3cret"}))
    lines = ready_lines(d, 17.25)
    assert lines[0] == lines[-1] == "=" * 72  # framed: easy to find in the scroll-back
    assert lines[1] == "ready after 17.2s: http://127.0.0.1:18080  user admin  password s3cret"
    # pasteable into a plain shell in the clone, where `airflow` is not on PATH
    assert lines[3] == "  other airflow commands: .venv/bin/photon airflow-cli ... (this home and environment)"
    assert "without: HTTP access log (--access-log), DAG-parse bookkeeping" in lines[4]
    assert "without: DAG-parse bookkeeping (" in ready_lines(deployment(tmp_path, access_log=True), 1.0)[4]
    d.password_file.unlink()
    assert f"password (see {d.password_file})" in ready_lines(d, 1.0)[1]


def test_third_party_warnings_of_every_airflow_command_are_left_out_unless_verbose(tmp_path: Path) -> None:
    """A newcomer's pass: every `photon airflow-cli dags ...` began with a 3-line warning that graphviz is missing
    (for drawing DAGs as images, which nothing here does), and Airflow's components repeated pathspec's deprecation
    of GitWildMatchPattern 20 times in 7 minutes. The environment the components and airflow-cli run in leaves
    those two out; the caller's own PYTHONWARNINGS comes after ours, so it wins; --verbose keeps everything."""
    import subprocess
    import sys

    probe = "import airflow.cli.commands.dag_command"
    bare = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert "graphviz" in bare.stderr + bare.stdout  # the warning this is about, on this environment
    env = deployment(tmp_path).environment({"PATH": "/usr/bin", "PYTHONWARNINGS": "default::ResourceWarning"})
    assert env["PYTHONWARNINGS"].endswith(",default::ResourceWarning"), env["PYTHONWARNINGS"]
    quiet = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert quiet.returncode == 0 and "graphviz" not in quiet.stderr + quiet.stdout, quiet.stderr[-2000:]
    assert "PYTHONWARNINGS" not in deployment(tmp_path, verbose=True).environment({"PATH": "/usr/bin"})


def test_the_api_tokens_are_signed_with_a_key_of_64_bytes_kept_per_airflow_home(tmp_path: Path) -> None:
    """Airflow's own jwt_secret is 16 random bytes, which PyJWT warns is below the 64 that HS512 wants ("The HMAC key
    is 24 bytes long", 5 times in 7 minutes of a newcomer's backfill). The deployment makes one of 64 bytes once per
    AIRFLOW_HOME (mode 600) and gives every component and airflow command the same one: tokens the API server signs
    are checked by the scheduler's and the tasks' side with it, across restarts."""
    import stat

    first = deployment(tmp_path).environment({"PATH": "/usr/bin"})["AIRFLOW__API_AUTH__JWT_SECRET"]
    assert len(first.encode()) >= 64
    again = deployment(tmp_path, verbose=True)
    assert again.environment({"PATH": "/usr/bin"})["AIRFLOW__API_AUTH__JWT_SECRET"] == first
    assert again.options()["api_auth"]["jwt_secret"] == first  # airflow.cfg, for commands run without photon
    key = tmp_path / "airflow" / "jwt_secret"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    other = tmp_path / "other"
    other.mkdir()
    assert deployment(other).environment({"PATH": "/usr/bin"})["AIRFLOW__API_AUTH__JWT_SECRET"] != first


def test_the_log_token_key_is_long_enough_for_hs512(tmp_path: Path) -> None:
    """The API server signs the token it sends a task's log server with ``[api] secret_key``, which Airflow makes
    16 random bytes (24 characters): PyJWT's "The HMAC key is 24 bytes long" on the first log read. The deployment
    makes one of 64 bytes and more once per AIRFLOW_HOME (mode 600), given to every component and airflow.cfg."""
    import stat

    first = deployment(tmp_path).environment({"PATH": "/usr/bin"})["AIRFLOW__API__SECRET_KEY"]
    assert len(first.encode()) >= 64
    again = deployment(tmp_path, verbose=True)
    assert again.options()["api"]["secret_key"] == first
    assert stat.S_IMODE((tmp_path / "airflow" / "api_secret_key").stat().st_mode) == 0o600


def test_task_logs_are_served_on_loopback_at_the_deployments_port(tmp_path: Path) -> None:
    """The API server reads a running task's log from the log server of the task's host (8793 by default); with
    none (the scheduler started with --skip-serve-logs) every read of a running task's log printed three connection
    errors of ~230 traceback lines. The scheduler's own binds every interface, so the deployment runs Airflow's log
    server app on 127.0.0.1 at a port of its own, and a task's hostname is that address."""
    from photon.airflow.standalone import loopback_hostname

    d = deployment(tmp_path, log_server_port=15124)
    commands = d.component_commands()
    assert "--skip-serve-logs" in commands["scheduler"]
    server = commands["log-server"]
    assert "airflow.utils.serve_logs.log_server:get_app" in server
    assert server[server.index("--host") + 1] == "127.0.0.1" and server[server.index("--port") + 1] == "15124"
    env = d.environment({"PATH": "/usr/bin"})
    assert env["AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT"] == "15124"
    assert env["AIRFLOW__CORE__HOSTNAME_CALLABLE"] == "photon.airflow.standalone.loopback_hostname"
    assert env["AIRFLOW__CORE__DAGS_FOLDER"]  # the rest of the section kept
    assert "AIRFLOW__LOGGING__NAMESPACE_LEVELS" in env  # the console's quiet levels kept alongside
    assert loopback_hostname() == "127.0.0.1"
    assert "log-server" not in deployment(tmp_path).component_commands()


def test_a_spark_connect_server_is_a_component_stopped_with_the_api_server(tmp_path: Path) -> None:
    from photon.airflow.standalone import WORKERS

    assert "spark-connect" not in deployment(tmp_path).component_commands()
    commands = deployment(tmp_path, spark_connect_port=15123).component_commands()
    assert commands["spark-connect"][1:] == ["-m", "photon", "spark-connect", "--port", "15123"]
    assert "spark-connect" not in WORKERS  # stopped after the scheduler's tasks, which use it


def test_a_backfill_task_joins_on_the_warm_server_only_when_it_runs_this_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The operator hands the job the server's URL when ``photon spark-connect`` left one under PHOTON_HOME for this
    very code; with no server, or one holding other code, the job starts its own Spark (and says why)."""
    from photon.airflow.dags import backfill_dag
    from photon.joiner.common import CODE_FINGERPRINT

    monkeypatch.setenv("PHOTON_HOME", str(tmp_path))
    monkeypatch.delenv("PHOTON_SPARK_REMOTE", raising=False)
    tasks = backfill_dag().tasks
    assert tasks and all(t.spark_connect for t in tasks)  # type: ignore[attr-defined]
    task = tasks[0]
    assert task.spark_remote() == {}  # type: ignore[attr-defined]
    where = tmp_path / "spark-connect"
    where.mkdir()
    (where / "token").write_text("t0k\n")
    (where / "url").write_text(f"sc://localhost:15123\n{CODE_FINGERPRINT}\n")
    # The token in the environment, never in the URL (Spark's errors print the URL).
    assert task.spark_remote() == {  # type: ignore[attr-defined]
        "PHOTON_SPARK_REMOTE": "sc://localhost:15123",
        "SPARK_CONNECT_AUTHENTICATE_TOKEN": "t0k",
    }
    (where / "url").write_text("sc://localhost:15123\n0000000000000000\n")
    assert task.spark_remote() == {}  # type: ignore[attr-defined]
    monkeypatch.setenv("PHOTON_SPARK_REMOTE", "sc://elsewhere:1/;token=u")
    assert task.spark_remote() == {"PHOTON_SPARK_REMOTE": "sc://elsewhere:1/;token=u"}  # type: ignore[attr-defined]


# Lines the LocalExecutor copied to the scheduler's output in a run of test_backfill_while_a_joiner_lease_runs.
BATCH_LINE = (
    "2026-11-28 17:31:47.601227+00:00 [info     ] dc-a batch 1: 1171 clicks, 1113 joined, 0 pre-filtered, 0 wasted, 58 "
    "waiting, 0 unjoinable, 19 quarantined, 0.9s [airflow.task.hooks.airflow.providers.apache.spark.hooks.spark_submit."
    "SparkSubmitHook] dag_id=photon_join_dc_a loc=spark_submit.py:965 map_index=-1 run_id=scheduled__2026-11-28T17:31:"
    "23.523745+00:00 task_id=joiner_lease ti_id=01a22336-548f-74ba-b252-d820f299d04d try_number=1"
)
KILLED_LINE = (
    "2026-11-28 17:33:03.052542+00:00 [error    ] Task failed with exception     [task] dag_id=photon_join_dc_a "
    "error_detail=[{'exc_type': 'AirflowException', 'exc_value': 'Cannot execute: spark-submit --master local[*] ...', "
    "'syntax_error': None, 'is_cause': False, 'frames': []}] loc=task_runner.py:1203 map_index=-1 "
    "run_id=scheduled__2026-11-28T17:31:23.523745+00:00 task_id=joiner_lease try_number=1"
)


def test_a_tasks_line_reaches_the_console_as_its_message_and_who_said_it() -> None:
    """A joiner's batch line reached the console at 433 characters, Airflow's task context appended (dag_id, run_id,
    ti_id, ...; the task's log file keeps it): the console shows the time, the DAG and task, and the message."""
    from photon.airflow.standalone import task_line

    assert task_line(BATCH_LINE) == (
        "17:31:47 photon_join_dc_a.joiner_lease: dc-a batch 1: 1171 clicks, 1113 joined, 0 pre-filtered, 0 wasted, "
        "58 waiting, 0 unjoinable, 19 quarantined, 0.9s"
    )
    assert task_line(KILLED_LINE).startswith("17:33:03 photon_join_dc_a.joiner_lease: [error] Task failed")  # type: ignore[union-attr]
    # A line of the project's own logger in a task (data quality's verdict) too.
    verdict = BATCH_LINE.replace("[airflow.task.hooks.airflow.providers.apache.spark.hooks.spark_submit.", "[photon.")
    assert task_line(verdict).startswith("17:31:47 photon_join_dc_a.joiner_lease: dc-a batch 1:")  # type: ignore[union-attr]
    # Lines that are not a task's pass as they are.
    other = (
        "2026-11-28T17:32:27.482467Z [info     ] DagRun Finished: dag_id=photon_backfill, run_id=x "
        "[airflow.models.dagrun.DagRun]"
    )
    assert task_line(other) == other
    assert (
        task_line("Simple auth manager | Password for user 'admin': x")
        == "Simple auth manager | Password for user 'admin': x"
    )


def test_a_stop_reports_each_killed_lease_in_one_quiet_line() -> None:
    """Stopping the deployment kills the leases on purpose: each said "Task failed with exception" at error level
    (and its hook "Sending kill signal"), four lines for two leases. While stopping, one info line a task."""
    from photon.airflow.standalone import task_line

    assert (
        task_line(KILLED_LINE, stopping=True) == "17:33:03 photon_join_dc_a.joiner_lease: stopped with the deployment"
    )
    sending = BATCH_LINE.replace(
        "dc-a batch 1: 1171 clicks, 1113 joined, 0 pre-filtered, 0 wasted, 58 waiting, 0 "
        "unjoinable, 19 quarantined, 0.9s",
        "Sending kill signal to spark-submit",
    )
    assert task_line(sending, stopping=True) is None
    assert task_line(BATCH_LINE, stopping=True) == task_line(BATCH_LINE)  # a batch that ends during the stop shows


def test_a_task_waits_for_a_busy_api_server_longer_than_airflows_default(tmp_path: Path) -> None:
    """A task's supervisor calls the API server to start and to report; Airflow waits 5 s a try, and a busy API
    server (the first parse, the Spark Connect warm-up, a loaded machine) made the first task fail before it ran. The
    deployment waits 30 s, in airflow.cfg and the components' environment; a caller's own value wins."""
    from photon.airflow.standalone import EXECUTION_API_TIMEOUT_S

    d = deployment(tmp_path)
    assert EXECUTION_API_TIMEOUT_S >= 30
    assert d.options()["workers"]["execution_api_timeout"] == str(EXECUTION_API_TIMEOUT_S)
    env = d.environment({"PATH": "/usr/bin"})
    assert env["AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT"] == str(EXECUTION_API_TIMEOUT_S)
    asked = d.environment({"PATH": "/usr/bin", "AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT": "90"})
    assert asked["AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT"] == "90"
