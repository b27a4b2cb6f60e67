"""Stopping `photon join` (README, "photon join"): SIGINT or SIGTERM lets the batch in progress commit and publish,
releases the lease so that a standby takes over at once (not after the staleness bound), says so in one line and
exits 130 or 143; a lease fenced by another says so and exits 3. Real `photon join` processes against a real registry
as the joiner's login. Each failed before: a signal killed the process mid-batch with nothing said and the lease held,
and a fenced idle lease ran out its term and exited 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from photon.joiner.state import PipelineState
from photon.pg import autocommit
from photon.registry.admin import init_registry, status
from photon.tools.audit import audit
from photon.tools.generator import GeneratorSettings, generate
from tests.integration import output

pytestmark = pytest.mark.integration
US = 1_000_000
ROOT = Path(__file__).resolve().parents[2]


def join(
    tmp_path: Path,
    dsn: str,
    *args: str,
    crash_at: str | None = None,
    group: bool = False,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[str]:
    env = {**os.environ, "PHOTON_REGISTRY_DSN": dsn, "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}", **(env or {})}
    env.pop("PHOTON_CRASH_AT", None)
    if crash_at:
        env["PHOTON_CRASH_AT"] = crash_at
    cmd = [sys.executable, "-m", "photon", "join", "--dc", "dc-a", "--logs", str(tmp_path / "logs")]
    cmd += ["--out", str(tmp_path / "out"), "--master", "local[1]", "--trigger-interval", "0.2", *args]
    return subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=group
    )


def lease_holder(dsn: str) -> tuple[str | None, int]:
    with autocommit(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT lease_owner, last_batch FROM photon.pipelines WHERE pipeline = 'dc-a'")
        holder, last = cur.fetchone()
    return holder, int(last)


def five_seconds_of_logs(dsn: str, tmp_path: Path, malformed_fraction: float = 0.001) -> None:
    """A registry of two shards, and 5 s of dc-a's logs a minute old (about 1,500 events): a batch or two."""
    init_registry({"main": dsn}, num_shards=2)
    now = int(time.time() * US)
    settings = GeneratorSettings(
        events_per_s=300,
        dcs=("dc-a",),
        max_join_delay_s=30,
        late_query_file_fraction=0.0,
        late_click_fraction=0.0,
        malformed_fraction=malformed_fraction,
    )
    generate(settings, tmp_path / "logs", start_us=now - 60 * US, end_us=now - 55 * US)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_mid_batch_commits_the_batch_releases_the_lease_and_says_so(
    tmp_path: Path, make_db: Callable[[], str], login_as: Callable[[str, str], str], sig: signal.Signals
) -> None:
    dsn = make_db()
    five_seconds_of_logs(dsn, tmp_path)
    # The signal lands in batch 1 after its clicks are registered, before its commit: the worst moment to stop.
    p = join(tmp_path, login_as(dsn, "photon_joiner"), "--run-for", "120", crash_at=f"after_register@1:{sig.name}")
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 128 + sig, out  # 143 for SIGTERM, 130 for SIGINT
    assert f"dc-a: stopped by {sig.name} after batch 1: lease released" in out, out
    assert lease_holder(dsn) == (None, 1)  # batch 1 committed, and the pipeline is free
    # A standby waiting now takes over at once (released), not once the heartbeat is 15 s stale.
    assert PipelineState(dsn, "dc-a").wait_for_turn(stale_s=15, timeout_s=600) == "released"
    # Nothing lost, nothing twice: every id batch 1 registered is in the published output, once.
    joined = output.ids(tmp_path / "out", "joined", "dc-a")
    registered = sum(sh["rows"] for cfg in status({"main": dsn})["configs"] for sh in cfg["shards"])
    assert len(joined) == len(set(joined)) == registered > 0


def test_sigterm_to_the_whole_process_group_mid_batch_still_releases_the_lease(
    tmp_path: Path, make_db: Callable[[], str], login_as: Callable[[str, str], str]
) -> None:
    """As systemd stops a service: the signal reaches Spark's JVM too, so the batch in progress may fail. It was a
    traceback with the lease held; now the lease is released and the line says where it stopped."""
    dsn = make_db()
    five_seconds_of_logs(dsn, tmp_path)
    joiner = login_as(dsn, "photon_joiner")
    p = join(tmp_path, joiner, "--run-for", "120", crash_at="after_register@1:group-SIGTERM", group=True)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 143, out
    assert "dc-a: stopped by SIGTERM " in out and ": lease released" in out, out
    assert lease_holder(dsn)[0] is None
    assert PipelineState(dsn, "dc-a").wait_for_turn(stale_s=15, timeout_s=600) == "released"


def test_a_second_signal_abandons_the_batch_releases_the_lease_and_the_next_lease_joins_it_once(
    tmp_path: Path, make_db: Callable[[], str], login_as: Callable[[str, str], str]
) -> None:
    dsn = make_db()
    five_seconds_of_logs(dsn, tmp_path)
    joiner = login_as(dsn, "photon_joiner")
    # SIGTERM once its clicks are registered, again before its commit: batch 1 is abandoned, uncommitted.
    twice = "after_register@1:SIGTERM,before_commit@1:SIGTERM"
    p = join(tmp_path, joiner, "--run-for", "120", crash_at=twice)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 143, out
    assert "dc-a: stopped by SIGTERM in batch 1, before its end" in out and "lease released" in out, out
    assert lease_holder(dsn) == (None, 0)
    registered = sum(sh["rows"] for cfg in status({"main": dsn})["configs"] for sh in cfg["shards"])
    assert registered > 0  # registered by the abandoned batch, under its token
    # The next lease runs batch 1 again: the same clicks are its own (the token names the batch), each joined once.
    p = join(tmp_path, joiner, "--until-caught-up", "--drain")
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    joined = output.ids(tmp_path / "out", "joined", "dc-a")
    assert len(joined) == len(set(joined)) >= registered
    report = audit(tmp_path / "out", manifest=tmp_path / "logs" / "_manifest")
    assert report.ok and report.lost == 0 and report.duplicate_clicks == 0, report.failures()


def test_a_fenced_lease_says_so_and_exits_3(
    tmp_path: Path, make_db: Callable[[], str], login_as: Callable[[str, str], str]
) -> None:
    dsn = make_db()
    init_registry({"main": dsn}, num_shards=2)
    (tmp_path / "logs" / "dc-a" / "clicks").mkdir(parents=True)
    joiner = login_as(dsn, "photon_joiner")
    p = join(tmp_path, joiner, "--run-for", "60")  # idle: no log arrives
    assert p.stdout is not None
    for line in p.stdout:
        if "lease epoch 1" in line:
            break
    fencer = PipelineState(joiner, "dc-a").start_lease()  # another lease takes the pipeline (epoch 2)
    assert fencer.epoch == 2
    out = p.stdout.read()
    p.wait(timeout=60)
    assert p.returncode == 3, out
    assert "dc-a: lease epoch 1 was fenced by lease epoch 2, held by " in out, out
    assert "this lease committed 0 batch(es) and stopped" in out, out
    assert lease_holder(joiner)[0] is not None  # the fencing lease's, untouched
