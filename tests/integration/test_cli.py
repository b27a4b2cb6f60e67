"""The `photon` command line against a real PostgreSQL named by PHOTON_REGISTRY_DSN."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from photon.cli import app

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def test_registry_init_is_idempotent_and_status_reports_it(
    make_db: Callable[[], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    dsn = make_db()
    monkeypatch.setenv("PHOTON_REGISTRY_DSN", dsn)
    runner = CliRunner()
    first = runner.invoke(app, ["registry", "init", "--shards", "3", "--partition-minutes", "30"])
    assert first.exit_code == 0, first.output
    assert "applied 0001_registry.sql" in first.output
    assert "created shard configuration v1: 3 shards" in first.output
    again = runner.invoke(app, ["registry", "init", "--shards", "5"])
    assert again.exit_code == 0, again.output
    assert "schema up to date" in again.output and "unchanged" in again.output
    status = runner.invoke(app, ["registry", "status", "--json"])
    assert status.exit_code == 0, status.output
    st = json.loads(status.output)
    assert st["partition_width_us"] == 30 * 60_000_000
    assert [c["num_shards"] for c in st["configs"]] == [3]
    assert [s["table"] for s in st["configs"][0]["shards"]] == ["ids_c1_s0", "ids_c1_s1", "ids_c1_s2"]
    human = runner.invoke(app, ["registry", "status"], env={"COLUMNS": "80"})
    assert human.exit_code == 0 and "ids_c1_s2" in human.output
    # The server's line at 80 columns: the count and the latest migration, not all of them (306 characters).
    latest = sorted(p.stem for p in (ROOT / "sql").glob("*.sql"))[-1]
    server = human.output.splitlines()[0]
    assert server.startswith("server main: reachable, ") and server.endswith(f", the latest {latest}"), server
    assert len(server) <= 80, server


def test_registry_gc_names_its_thresholds_in_utc_whole_at_80_columns(
    make_db: Callable[[], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As `registry status` does: it printed microseconds since the epoch, cut to '1795322392279…' at 80 columns."""
    monkeypatch.setenv("PHOTON_REGISTRY_DSN", make_db())
    runner = CliRunner()
    assert runner.invoke(app, ["registry", "init", "--shards", "2"]).exit_code == 0
    assert runner.invoke(app, ["registry", "gc"]).exit_code == 0  # the thresholds move from none
    result = runner.invoke(app, ["registry", "gc", "--dry-run"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert re.search(r"would free below \d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ\n", result.output), result.output
    assert "…" not in result.output and max(map(len, result.output.splitlines())) <= 80, result.output


def test_registry_reshard_says_when_its_configuration_is_valid_from_in_utc(
    make_db: Callable[[], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """It printed 'valid from 1795580484188010 us' and the acknowledgements as a dict (`make demo`'s line too)."""
    monkeypatch.setenv("PHOTON_REGISTRY_DSN", make_db())
    runner = CliRunner()
    assert runner.invoke(app, ["registry", "init", "--shards", "2"]).exit_code == 0
    result = runner.invoke(app, ["registry", "reshard", "--shards", "4", "--lead", "30"])
    assert result.exit_code == 0, result.output
    line = " ".join(result.output.split())  # rich wraps at 80 columns
    assert re.search(r"valid from \d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ\): active after", line), line
    assert line.endswith("acknowledged by no live joiner"), line


def test_unknown_placement_server_is_a_clear_error(make_db: Callable[[], str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHOTON_REGISTRY_DSN", make_db())
    result = CliRunner().invoke(app, ["registry", "init", "--place", "main,pg9"])
    assert result.exit_code != 0
    assert "pg9" in str(result.exception)


def test_a_reshard_left_part_way_is_finished_from_the_command_line(
    make_db: Callable[[], str], login_as: Callable[[str, str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reshard that crashed after planning: `reshard-resume V` activates it (no live joiner to wait for) or,
    with --abort, removes it; an active configuration is never aborted. Run as the reshard role's login."""
    from photon.registry.admin import init_registry
    from photon.registry.reshard import plan

    dsn = make_db()
    init_registry({"main": dsn}, num_shards=2)
    monkeypatch.setenv("PHOTON_REGISTRY_DSN", login_as(dsn, "photon_reshard"))
    runner = CliRunner()
    v2 = plan({"main": dsn}, num_shards=4, lead_s=120).version
    resumed = runner.invoke(app, ["registry", "reshard-resume", str(v2)])
    assert resumed.exit_code == 0 and f"v{v2}: active" in resumed.output, resumed.output
    refused = runner.invoke(app, ["registry", "reshard-resume", str(v2), "--abort"])
    assert refused.exit_code != 0  # active: never aborted
    v3 = plan({"main": dsn}, num_shards=8, lead_s=120).version
    aborted = runner.invoke(app, ["registry", "reshard-resume", str(v3), "--abort"])
    assert aborted.exit_code == 1 and f"v{v3}: aborted" in aborted.output, aborted.output
    monkeypatch.setenv("PHOTON_REGISTRY_DSN", dsn)  # status reads every table: the owner's view
    status = json.loads(runner.invoke(app, ["registry", "status", "--json"]).output)
    assert [(c["version"], c["state"]) for c in status["configs"]] == [(1, "active"), (v2, "active"), (v3, "aborted")]


def test_join_on_an_uninitialised_registry_says_what_to_do_in_one_line(
    make_db: Callable[[], str], tmp_path: Path
) -> None:
    """Was a traceback ending in `UndefinedTable: relation "photon.pipelines" does not exist`, after a Spark start."""
    env = {**os.environ, "PHOTON_REGISTRY_DSN": make_db(), "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}"}
    cmd = [sys.executable, "-m", "photon", "join", "--dc", "dc-a", "--logs", str(tmp_path), "--out", str(tmp_path)]
    result = subprocess.run([*cmd, "--until-caught-up"], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "run `photon registry init`" in result.stderr and "Traceback" not in result.stderr + result.stdout
    assert len(result.stderr.strip().splitlines()) <= 2  # one message (rich may wrap it)


@pytest.mark.parametrize(
    "args",
    [
        ["status"],
        ["final", "--hour", "2026-11-20T00", "--logs", "{tmp}", "--out", "{tmp}"],
        ["report", "--to", "{tmp}/report"],
        ["verify", "--logs", "{tmp}", "--out", "{tmp}"],
        ["registry", "gc"],
        ["registry", "reshard", "--shards", "8", "--place", "main"],
        ["registry", "reshard-resume", "2"],
        ["registry", "status"],
    ],
    ids=lambda a: "-".join(a[:2]).replace("--", ""),
)
def test_every_command_on_an_uninitialised_registry_says_what_to_do_in_one_line(
    args: list[str],
    make_db: Callable[[], str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A newcomer's pass found six of these printing a 40-160 line traceback (`InvalidSchemaName: schema "photon"
    does not exist`, `UndefinedTable: relation "photon.pipelines" does not exist`) and exiting 1, where the README
    promises one line and exit status 2, as `join` and `registry status` gave."""
    from photon.cli import main

    monkeypatch.setenv("PHOTON_REGISTRY_DSN", make_db())
    monkeypatch.setattr(sys, "argv", ["photon", *(a.format(tmp=tmp_path) for a in args)])
    with pytest.raises(SystemExit) as exited:
        main()
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err, err
    assert "the registry is not initialised: run `photon registry init`" in err and len(err.splitlines()) == 1, err
    assert "(registry: " in err and "dbname=photon_" in err, err  # which one: another folder has another


def test_the_photon_command_is_installed_and_its_help_imports_nothing_heavy() -> None:
    """`make setup` installs the console script beside the venv's Python. Its help loads no Spark, Arrow, GX,
    Airflow or matplotlib (those made `--help` take 6-9 s), and says `photon`, not `python -m photon`."""
    exe = Path(sys.executable).parent / "photon"
    assert exe.is_file(), f"{exe}: run `make setup`"
    result = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60, cwd="/")
    assert result.returncode == 0 and "Usage: photon" in result.stdout and "status" in result.stdout
    probe = (
        "import sys; sys.argv = ['photon', 'join', '--help']\n"
        "from photon.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "heavy = ('pyspark', 'pyarrow', 'great_expectations', 'airflow', 'matplotlib', 'pandas')\n"
        "print('LOADED', sorted({m.split('.')[0] for m in sys.modules} & set(heavy)))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60).stdout
    assert "LOADED []" in out, out[-300:]


@pytest.mark.parametrize(
    "args",
    [
        ["join", "--dc", "dc-a", "--logs", "{tmp}/missing", "--out", "{tmp}", "--until-caught-up"],
        ["verify", "--logs", "{tmp}/missing", "--out", "{tmp}"],
        ["audit", "--out", "{tmp}/missing"],
        ["registry", "status"],
        ["status"],
    ],
    ids=["join-missing-logs", "verify-missing-logs", "audit-missing-out", "registry-unreachable", "status-unreachable"],
)
def test_a_missing_folder_or_an_unreachable_server_is_one_line(args: list[str], tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}", "PHOTON_HOME": str(tmp_path / "home")}
    env["PHOTON_REGISTRY_DSN"] = "host=127.0.0.1 port=9 user=nobody dbname=nothing connect_timeout=2"
    cmd = [sys.executable, "-m", "photon", *(a.format(tmp=tmp_path) for a in args)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    text = result.stdout + result.stderr
    assert "Traceback" not in text and ("no such folder" in text or "127.0.0.1" in text), text
    assert len(result.stderr.strip().splitlines()) <= 2, result.stderr
