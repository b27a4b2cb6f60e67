"""`photon spark-connect` and `photon join --connect`: backfill-sized joins on a warm Spark Connect server, with the
same output as a process of its own; a server answers only with its token, binds loopback only, and stops whole."""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import psycopg2.extensions
import pytest

from photon.pg import autocommit
from photon.tools.audit import audit
from tests.integration import output
from tests.integration.spark_server import free_port, spark_connect_server
from tests.integration.test_airflow_local import outside_address, refused
from tests.integration.test_joiner import ROOT, joined_ids, make_logs, registered_under


def photon(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "photon", *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.fixture
def connect_server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path, int, Path]]:
    home, port, log = tmp_path / "home", free_port(), tmp_path / "spark-connect.log"
    with spark_connect_server(home, log, port) as proc:
        yield proc, home, port, log


def test_a_join_on_the_warm_server_writes_what_a_join_of_its_own_writes(
    tmp_path: Path, servers: dict[str, str], connect_server: tuple[subprocess.Popen[str], Path, int, Path]
) -> None:
    proc, home, port, log = connect_server
    logs = make_logs(tmp_path / "logs", seconds=10)
    base = os.environ | {"PHOTON_HOME": str(home), "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}"}
    env = base | {"PHOTON_REGISTRY_DSN": servers["main"]}
    args = ["--logs", str(logs), "--until-caught-up", "--drain", "--trigger-interval", "0.1"]

    # The server: loopback only, its token and url readable by this user alone.
    listening = {
        c.laddr.ip
        for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        for c in p.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }
    assert listening and all(loopback(ip) for ip in listening), listening
    if (ip := outside_address()) is not None:
        assert refused(ip, port), f"Spark Connect answers on {ip}"
    for name in ("token", "url"):
        assert (home / "spark-connect" / name).stat().st_mode & 0o777 == 0o600

    # A client without the token is refused (in a process of its own: a Spark Connect client in this one would
    # become the active session, and its threads outlive the test).
    client = (
        "from pyspark.sql import SparkSession\n"
        f"SparkSession.builder.remote('sc://localhost:{port}').getOrCreate().range(1).collect()\n"
    )
    refused_client = subprocess.run(
        [sys.executable, "-c", client], capture_output=True, text=True, timeout=120, check=False
    )
    assert refused_client.returncode != 0 and "UNAUTHENTICATED" in refused_client.stderr, refused_client.stderr[-3000:]

    # dc-a through the server, as a least-privilege login; dc-b as a process of its own, racing the same clicks
    # after it: together they join every click once.
    t0 = time.monotonic()
    on_server = photon("join", "--dc", "dc-a", "--out", str(tmp_path / "out"), "--connect", *args, env=env)
    took = time.monotonic() - t0
    assert on_server.returncode == 0, on_server.stdout + on_server.stderr
    alone = photon("join", "--dc", "dc-b", "--out", str(tmp_path / "out"), "--master", "local[2]", *args, env=env)
    assert alone.returncode == 0, alone.stdout + alone.stderr
    report = audit(tmp_path / "out", manifest=logs / "_manifest")
    assert report.ok and report.duplicate_clicks == 0 and report.lost == 0, report.failures()
    ids = joined_ids(tmp_path / "out")
    assert len(ids) == len(set(ids))
    a = joined_ids_of(tmp_path / "out" / "dc-a")
    assert len(a) >= 0.9 * len(ids) > 0  # dc-a, first, joined nearly all; dc-b found those registered
    print(f"photon join --connect: {took:.1f} s for {len(a):,} joined clicks")

    # Stopped by SIGTERM: nothing of its tree is left, and the url is gone.
    tree = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, log.read_text()
    time.sleep(1)
    assert [p for p in tree if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE] == []
    assert not (home / "spark-connect" / "url").exists()
    gone = photon("join", "--dc", "dc-a", "--out", str(tmp_path / "out"), "--connect", *args, env=env)
    assert gone.returncode == 2 and "photon spark-connect" in gone.stderr and "Traceback" not in gone.stderr


def loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def joined_ids_of(folder: Path) -> list[str]:
    """The click ids committed to the joined table of the pipeline folder ``folder``."""
    return output.ids(folder.parent, "joined", folder.name)


def test_a_worker_with_other_code_refuses_the_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The photon package, and an adapter from outside it (a Connect server's workers import it from their own
    path): a worker whose copy differs from the driver's refuses the task."""
    from photon.joiner.common import CODE_FINGERPRINT, CodeMismatchError, check_code, code_fingerprint

    default = "photon.joiner.adapter:default_adapter"
    assert code_fingerprint(default) == CODE_FINGERPRINT
    check_code(CODE_FINGERPRINT, default)
    check_code("", default)  # a task from a classic session: no check
    with pytest.raises(CodeMismatchError, match="restart it"):
        check_code("0" * 16, default)
    module = tmp_path / "my_adapter_for_connect.py"
    module.write_text("from photon.joiner.adapter import default_adapter as adapt\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    theirs = "my_adapter_for_connect:adapt"
    driver = code_fingerprint(theirs)
    assert driver.startswith(CODE_FINGERPRINT + "+my_adapter_for_connect:")
    check_code(driver, theirs)
    module.write_text("from photon.joiner.adapter import default_adapter as adapt  # the server's copy\n")
    with pytest.raises(CodeMismatchError, match="adapter"):
        check_code(driver, theirs)


def test_a_connect_join_killed_mid_batch_and_rerun_joins_each_click_once(
    tmp_path: Path,
    servers: dict[str, str],
    pg_admin_dsn: str,
    warm_spark: Path,
) -> None:
    """A Spark Connect client that dies leaves its job running on the server (an orphan, still registering under
    the batch's token and writing its staged files) while the next process re-runs that batch: killed right after
    a batch registered (the crash point), then killed while a batch's job runs, then run to the end. Each click is
    joined once and none is lost, and every id registered under the pipeline is in its output."""
    home = warm_spark  # the test process's server, which other tests use before and after this one
    logs = make_logs(tmp_path / "logs", seconds=10)
    out = tmp_path / "out"
    env = os.environ | {"PHOTON_HOME": str(home), "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}"}
    env |= {"PHOTON_REGISTRY_DSN": servers["main"], "PHOTON_TEST_MAX_CLICK_FILES": "4"}
    args = ["join", "--dc", "dc-a", "--logs", str(logs), "--out", str(out), "--connect", "--until-caught-up"]
    args += ["--drain", "--trigger-interval", "0.1"]

    crashed = photon(*args, env=env | {"PHOTON_CRASH_AT": "after_register@2"})
    assert crashed.returncode == -9, crashed.stdout + crashed.stderr
    proc = subprocess.Popen(
        [sys.executable, "-m", "photon", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    assert proc.stdout is not None
    for line in proc.stdout:  # its first batch done: the next one's job is on the server
        if " batch " in line:
            break
    time.sleep(0.3)
    proc.kill()
    proc.wait()
    final = photon(*args, env=env)
    assert final.returncode == 0, final.stdout + final.stderr
    time.sleep(5)  # an orphaned job's last registrations
    report = audit(out, manifest=logs / "_manifest")
    assert report.ok and report.duplicate_clicks == 0 and report.lost == 0, report.failures()
    joined = joined_ids(out)
    assert joined and len(joined) == len(set(joined))
    assert registered_under(servers["main"], "dc-a") == len(set(joined))
    # Each client session has Python workers of its own on the server, which outlive it by about a minute: they must
    # not keep registry connections (a few short joins used up max_connections).
    login = psycopg2.extensions.parse_dsn(servers["main"])["user"]

    def sessions() -> int:
        with autocommit(pg_admin_dsn) as conn, conn.cursor() as cur:
            cur.execute("SELECT count(*) FROM pg_stat_activity WHERE usename = %s", (login,))
            return int(cur.fetchone()[0])

    deadline = time.monotonic() + 20
    while (left := sessions()) and time.monotonic() < deadline:
        time.sleep(1)
    assert left == 0, f"{left} registry sessions of the joiner's login still open"


def test_relative_folders_mean_the_joiners_folders_not_the_servers(
    tmp_path: Path, connect_server: tuple[subprocess.Popen[str], Path, int, Path]
) -> None:
    """A newcomer's paste, as the README has it: the embedded registry, `--logs .photon/logs --out .photon/out` in the
    clone while the server runs elsewhere. The server's Python workers have another working folder, so the joiner
    hands them absolute paths: before, the batch read nothing there and committed 0 clicks, and the audit counted
    every click lost. And its stderr stays quiet: gRPC's core logged an INFO line there ("skipping fork()
    handlers") when the embedded registry started its server beside the session's threads."""
    _, home, _, _ = connect_server
    work = tmp_path / "clone"
    make_logs(work / "logs", seconds=10)
    env = {k: v for k, v in os.environ.items() if k not in ("PHOTON_REGISTRY_DSN", "GRPC_VERBOSITY")}
    env |= {"PHOTON_HOME": str(home), "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}"}
    init = subprocess.run(
        [sys.executable, "-m", "photon", "registry", "init"], env=env, capture_output=True, text=True, timeout=300
    )
    assert init.returncode == 0, init.stdout + init.stderr
    args = ["join", "--dc", "dc-a", "--logs", "logs", "--out", "out", "--connect", "--until-caught-up", "--drain"]
    done = subprocess.run(
        [sys.executable, "-m", "photon", *args], cwd=work, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert not re.search(r"^[IWE]\d{4} ", done.stderr, re.MULTILINE), done.stderr[-3000:]  # gRPC's own log format
    report = audit(work / "out", manifest=work / "logs" / "_manifest")
    assert report.ok and report.duplicate_clicks == 0 and report.lost == 0, report.failures()
