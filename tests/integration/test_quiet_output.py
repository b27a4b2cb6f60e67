"""Quiet, unbroken output where nobody watches a terminal: a join task's log (the spark-submit output Airflow records,
one log record per line) and `photon join` into a pipe. Spark's INFO start-up used to fill some 45 lines before the
first batch line, and rich broke every line longer than 80 columns in two."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg2.extensions
import pytest

from photon.logs.layout import partition_of
from photon.tools.generator import GeneratorSettings, generate

pytestmark = pytest.mark.integration
US = 1_000_000
ROOT = Path(__file__).resolve().parents[2]


def _logs(folder: Path) -> None:
    # Recent enough (under max_join_delay + seal + 60 s old) that the lease gives no "joins history" warning.
    start = (int(time.time()) - 150) * US
    generate(GeneratorSettings(events_per_s=300, dcs=("dc-a",)), folder, start_us=start, end_us=start + 10 * US)


def _before_first_batch(lines: list[str]) -> list[str]:
    first = next(i for i, line in enumerate(lines) if line.startswith("dc-a batch "))
    return lines[:first]


def _assert_whole_batch_lines(lines: list[str]) -> None:
    """Each batch line is one line, wider than 80 columns, from the data center to the batch's duration."""
    batches = [line for line in lines if line.startswith("dc-a batch ")]
    assert batches, lines
    for line in batches:
        assert len(line) > 80 and " quarantined, " in line and line.endswith("s"), line


def test_a_join_task_log_starts_with_the_lease_and_keeps_each_batch_on_one_line(
    servers: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """photon_join_dc_a's task, executed by its operator through a real spark-submit; what it logs is what the Spark
    provider's hook reads from spark-submit's output, one record per line (recorded as the hook reads it)."""
    from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

    from photon.airflow.dags import LOGS, OUT, START_AT, join_dag

    _logs(tmp_path / "logs")
    p = psycopg2.extensions.parse_dsn(servers["main"])
    joiner = {"conn_type": "postgres", "host": p.get("host"), "port": int(p["port"]) if p.get("port") else None}
    joiner |= {"login": p["user"], "password": p["password"], "schema": p["dbname"]}
    monkeypatch.setenv("AIRFLOW_CONN_PHOTON_REGISTRY_JOINER", json.dumps(joiner))
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[2]"}))
    monkeypatch.setenv("SPARK_LOCAL_IP", "127.0.0.1")  # as `photon airflow` runs a local[*] driver
    records: list[str] = []
    read = SparkSubmitHook._process_spark_submit_log

    def recorded(hook: SparkSubmitHook, itr: Iterator[Any]) -> None:
        def tee() -> Iterator[Any]:
            for line in itr:
                records.append(line.rstrip("\n"))
                yield line

        read(hook, tee())

    monkeypatch.setattr(SparkSubmitHook, "_process_spark_submit_log", recorded)
    task = join_dag("dc-a").get_task("joiner_lease")
    rendered = {
        LOGS: str(tmp_path / "logs"),
        OUT: str(tmp_path / "out"),
        # Longer than the logs' age plus a slow spark-submit start under load: the lease has no "joins history"
        # warning to give (lease.py), so its first lines are the three below.
        "{{ params.max_join_delay_s }}": "600",
        "{{ params.lease_s }}": "8",
        "{{ params.trigger_interval_s }}": "1",
        "{{ params.hand_over_wait_s }}": "0",
        START_AT: "beginning",
    }
    task.application_args = [rendered.get(a, a) for a in task.application_args]
    assert not [a for a in task.application_args if "{{" in a]
    task.execute({})

    before = _before_first_batch(records)
    assert [line for line in before if " INFO " in line] == [], before
    assert len(before) <= 3, before  # the JVM's own notice, "took over", "lease epoch 1"; it was 45
    _assert_whole_batch_lines(records)


def test_photon_join_into_a_pipe_writes_whole_lines(servers: dict[str, str], tmp_path: Path) -> None:
    """`photon join` with stdout and stderr pipes: no Spark start-up, a batch line per batch, and a log record (an
    entry that is not a regular file) on one plain line."""
    logs = tmp_path / "logs"
    _logs(logs)
    rel = f"{partition_of(int(time.time() * US))}/10.9.8.7-88-{'9' * 60}.jsonl"
    (logs / "dc-a" / "clicks" / rel).mkdir(parents=True)  # named like a log file, a directory: logged, never read
    env = {**os.environ, "PHOTON_REGISTRY_DSN": servers["main"], "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}"}
    cmd = [sys.executable, "-m", "photon", "join", "--dc", "dc-a", "--logs", str(logs), "--out", str(tmp_path / "out")]
    result = subprocess.run([*cmd, "--until-caught-up"], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    out, err = result.stdout.splitlines(), result.stderr.splitlines()
    assert [line for line in out + err if " INFO " in line] == [], result.stderr
    assert _before_first_batch(out) == [
        "dc-a: lease epoch 1, resuming after batch 0 (reading from the beginning of the logs)"
    ], out
    _assert_whole_batch_lines(out)
    skipped = [line for line in err if "is not a regular file" in line]
    assert len(skipped) == 1 and len(skipped[0]) > 80, err
    assert skipped[0].endswith(f" ERROR photon.joiner.discovery: dc-a: clicks/{rel} is not a regular file: skipped")


def test_the_demo_into_a_pipe_writes_whole_lines(make_db: Callable[[], str]) -> None:
    """`photon demo` (its registry race: the quick one) prints through the same console as the pipeline demo's batch
    lines: into a pipe, its verdict is one line, wider than 80 columns. The demo initialises its registry: it runs as
    the registry's owner."""
    env = {**os.environ, "PHOTON_REGISTRY_DSN": make_db(), "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}"}
    cmd = [sys.executable, "-m", "photon", "demo", "--registry-race"]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    verdict = [line for line in result.stdout.splitlines() if line.startswith("ids won by both")]
    assert len(verdict) == 1 and len(verdict[0]) > 80 and verdict[0].endswith("->  OK"), result.stdout


def test_the_plain_log_handler_writes_to_the_stderr_of_the_moment(capsys: pytest.CaptureFixture[str]) -> None:
    """`photon` run in-process by a test runner (typer's CliRunner) swaps stderr for a buffer and closes it: a handler
    that kept that buffer would fail every later record ('I/O operation on closed file', seen at the suite's exit)."""
    import io
    import logging

    from photon.cli import _StderrHandler

    handler = _StderrHandler()
    record = logging.LogRecord("photon.x", logging.WARNING, __file__, 1, "one plain line", None, None)
    swapped, real = io.StringIO(), sys.stderr
    sys.stderr = swapped
    try:
        handler.emit(record)
    finally:
        sys.stderr = real
    assert swapped.getvalue() == "one plain line\n"
    swapped.close()
    handler.emit(record)
    assert capsys.readouterr().err == "one plain line\n"


def test_a_failed_task_prints_no_traceback_of_its_own_and_the_driver_still_gets_it(tmp_path: Path) -> None:
    """A store that went away under a stage-1 task: the lease said it in one line, after Spark's executor and scheduler
    had printed the Python worker's traceback three times (found in CI: the S3 server SIGKILLed mid-task). Those
    loggers are off; the driver still gets the whole exception (it prints one line for a store, all of it otherwise)."""
    script = tmp_path / "fail.py"
    script.write_text(
        "from photon.spark_session import get_spark\n"
        "spark = get_spark('fail', master='local[2]', shuffle_partitions=2)\n"
        "def boom(batches):\n"
        "    for b in batches:\n"
        "        raise OSError('the store went away')\n"
        "        yield b\n"
        "try:\n"
        "    spark.range(4).mapInArrow(boom, 'id long').collect()\n"
        "except Exception as exc:\n"
        "    print('driver:', 'the store went away' in str(exc))\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'plugins'}"}
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert result.stdout.strip() == "driver: True", result.stdout + result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "Lost task" not in result.stderr, result.stderr[-3000:]
