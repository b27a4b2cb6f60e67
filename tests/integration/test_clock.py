"""One clock for decisions that must agree across hosts, with real ``photon join`` processes on skewed clocks
(Debian's ``faketime``, libfaketime preloaded into the process and its JVM) and one data center only, so no other
pipeline hides a loss:

- a lease on a host 120 s fast, or 90 s slow, says so in one line and exits non-zero before starting Spark (on the
  old code it ran, and the fast one committed a mark past the current minute for good);
- a file an honest writer closes afterwards in the current minute is still joined;
- with PHOTON_MAX_CLOCK_SKEW_S raised to 30, a host 20 s fast runs (the setting reaches the check), its clock then
  drifts to 90 s fast mid-lease: it stops after its batch with the same line, its marks never past the current
  minute by the server's clock;
- a later honest lease drains; the audit finds nothing lost and nothing joined twice;
- a host clock stepped between two measurements does not move the server's clock as the joiner reads it;
- a clock read over a round trip too slow to bound the offset within the skew is refused."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from photon.joiner.common import JoinSettings
from photon.joiner.lease import Joiner
from photon.joiner.state import PipelineState
from photon.logs.layout import partition_of
from photon.registry.admin import init_registry, server_clock_us
from photon.registry.clock import ClockSkewError, ServerClock
from photon.tools.audit import audit
from photon.tools.generator import GeneratorSettings, generate
from tests.integration import output
from tests.integration.test_adversary_handover2 import Proxy

pytestmark = pytest.mark.integration
US = 1_000_000
ROOT = Path(__file__).resolve().parents[2]
FAKETIME = shutil.which("faketime") or "/usr/bin/faketime"
LIBFAKETIME = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"


def joined_ids(out: Path) -> list[str]:
    return output.ids(out, "joined")


def write_log(logs: Path, kind: str, name: str, events: list[dict[str, Any]], at_us: int) -> None:
    """An honest writer closes a file: written aside, renamed into the partition of ``at_us``."""
    folder = logs / "dc-a" / kind / partition_of(at_us)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f"{name}.jsonl.inprogress"
    tmp.write_bytes(b"".join(json.dumps(e).encode() + b"\n" for e in events))
    os.replace(tmp, folder / f"{name}.jsonl")


def test_leases_on_skewed_clocks_refuse_or_stop_and_nothing_is_lost(
    tmp_path: Path, make_db: Callable[[], str], login_as: Callable[[str, str], str], spark: Any
) -> None:
    dsn = make_db()
    init_registry({"main": dsn}, num_shards=4)
    joiner_dsn = login_as(dsn, "photon_joiner")
    logs, out = tmp_path / "logs", tmp_path / "out"
    start = (int(time.time()) - 300) * US
    settings = GeneratorSettings(events_per_s=200, dcs=("dc-a",), malformed_fraction=0.0, late_click_fraction=0.0)
    generate(settings, logs, start_us=start, end_us=start + 8 * US)
    env = {**os.environ, "PHOTON_REGISTRY_DSN": joiner_dsn, "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}"}
    cmd = [sys.executable, "-m", "photon", "join", "--dc", "dc-a", "--logs", str(logs), "--out", str(out)]
    cmd += ["--trigger-interval", "0.2", "--master", "local[1]"]

    # 1. A host 120 s fast, then one 90 s slow: refused before Spark starts, one line each.
    refused = []
    for offset in ("+120s", "-90s"):
        t0 = time.monotonic()
        proc = subprocess.run(
            [FAKETIME, "-f", offset, *cmd, "--until-caught-up", "--drain"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        refused.append((offset, proc.returncode, proc.stderr.strip(), time.monotonic() - t0))
    after_refused = PipelineState(joiner_dsn, "dc-a").marks()  # no batch committed: no marks

    # 2. An honest writer closes a query file and a click file in the current minute (by true time).
    now = server_clock_us(joiner_dsn)
    qid, cid = f"10.200.0.1-77-{now - 2 * US}", f"10.200.0.2-78-{now - US}"
    query = {"query_id": qid, "ts_us": now - 2 * US, "user_id": "u1", "query_text": "late minute", "country": "DE"}
    query["ads"] = [{"ad_id": "a1", "advertiser_id": "adv1", "bid_micros": 5}]
    write_log(logs, "queries", f"10.200.0.1-77-{now}", [query], now)
    write_log(
        logs,
        "clicks",
        f"10.200.0.2-78-{now}",
        [{"click_id": cid, "ts_us": now - US, "query_id": qid, "ad_id": "a1"}],
        now,
    )
    honest_minute = partition_of(now)

    # 3. A host 20 s fast with the skew raised to 30 s runs; its clock drifts to 90 s fast mid-lease: it stops after
    # its batch. libfaketime reads the offset from a file (re-read every second), in the driver and its JVM alike.
    rc = tmp_path / "faketimerc"
    rc.write_text("+20s\n")
    drift_env = {**env, "PHOTON_MAX_CLOCK_SKEW_S": "30", "LD_PRELOAD": LIBFAKETIME}
    drift_env |= {"FAKETIME_TIMESTAMP_FILE": str(rc), "FAKETIME_CACHE_DURATION": "1"}
    drift_log = tmp_path / "drift.log"
    with open(drift_log, "wb") as fh:
        proc = subprocess.Popen([*cmd, "--run-for", "120"], env=drift_env, stdout=fh, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 240
            while b" batch " not in drift_log.read_bytes() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            ran_batches = b" batch " in drift_log.read_bytes()
            rc.write_text("+90s\n")
            drifted_at = time.monotonic()
            drift_rc = proc.wait(timeout=120)
            stopped_after_s = time.monotonic() - drifted_at
        finally:
            if proc.poll() is None:
                proc.kill()
    drift_out = " ".join(drift_log.read_text().split())
    marks = PipelineState(joiner_dsn, "dc-a").marks()
    current = partition_of(server_clock_us(joiner_dsn))

    # 4. A later honest lease drains what is left.
    servers = {"main": joiner_dsn}
    Joiner("dc-a", logs, out, servers, spark, JoinSettings(trigger_interval_s=0.2)).run(
        until_caught_up=True, drain=True
    )
    ids = joined_ids(out)
    report = audit(out, manifest=logs / "_manifest")

    # The honest writer's click is joined exactly once (on the old code the 120 s fast lease's mark had passed its
    # minute, and no later lease listed it), and nothing of the generated input is lost or joined twice.
    assert ids.count(cid) == 1, (refused, honest_minute, marks)
    assert report.duplicate_clicks == 0 and report.lost == 0, report.failures()
    assert len(ids) == len(set(ids))
    for offset, code, err, took in refused:
        assert code == 2, (offset, code, err)
        lines = err.splitlines()
        assert len(lines) == 1 and "PHOTON_MAX_CLOCK_SKEW_S=10 s" in lines[0], (offset, err)
        assert ("ahead of" if offset.startswith("+") else "behind") in lines[0], (offset, err)
        assert took < 30, (offset, took)  # refused before a Spark session started
    assert after_refused == {"queries": None, "clicks": None}, after_refused
    assert ran_batches, drift_out
    assert drift_rc == 2 and "PHOTON_MAX_CLOCK_SKEW_S=30 s" in drift_out and "ahead of" in drift_out, drift_out
    assert stopped_after_s < 60, stopped_after_s
    assert all(m is None or m <= current for m in marks.values()), (marks, current)


STEP_SCRIPT = """
import sys, time
from pathlib import Path
from photon.registry.clock import ServerClock, CLOCK_SQL
from photon.pg import autocommit

dsn, rc = sys.argv[1], Path(sys.argv[2])
clock = ServerClock(dsn, 10.0)  # measured on a clock in step with the server's
rc.write_text("+90s\\n")  # NTP steps this host's clock 90 s forward (CLOCK_MONOTONIC does not move)
stepped = time.time() + 60
while time.time() < stepped and time.monotonic() - clock.measured_at < 5:  # libfaketime re-reads it each second
    pass  # (no sleep: libfaketime's nanosleep refuses an unfaked monotonic deadline)
ours = clock.now_us()  # what a batch started now takes as the server's clock (before the next measurement)
with autocommit(dsn) as conn, conn.cursor() as cur:
    cur.execute(CLOCK_SQL)
    server = int(cur.fetchone()[0])
print(ours - server)
"""


def test_a_host_clock_step_between_measurements_does_not_move_the_servers_clock(
    tmp_path: Path, make_db: Callable[[], str], login_as: Callable[[str, str], str]
) -> None:
    """A joiner measures the offset once per heartbeat period; a host clock stepped in between (an NTP step, an
    operator's `date -s`) must not shift the server's clock as it reads it, or the batches before the next
    measurement seal partitions early (marks never move back: a file written there afterwards is never read), stamp
    first-seen times and deadlines ahead. On the old code ``now_us`` was this host's clock plus the last offset: 90 s
    ahead."""
    dsn = make_db()
    init_registry({"main": dsn}, num_shards=1)
    joiner_dsn = login_as(dsn, "photon_joiner")
    rc = tmp_path / "faketimerc"
    rc.write_text("+0s\n")
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}", "LD_PRELOAD": LIBFAKETIME}
    env |= {"FAKETIME_TIMESTAMP_FILE": str(rc), "FAKETIME_CACHE_DURATION": "1", "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", STEP_SCRIPT, joiner_dsn, str(rc)], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    error_us = int(proc.stdout.split()[-1])
    assert abs(error_us) < 2 * US, error_us / US


@contextmanager
def proxy_for_class(cls: type[Proxy], dsn: str) -> Iterator[Proxy]:
    p = cls(dsn)
    try:
        yield p
    finally:
        p.close()


class SlowClockProxy(Proxy):
    """The registry behind a link whose client-to-server direction holds each clock query ``delay_s`` (a congested
    uplink): the server reads its clock late, the answer comes back at once."""

    delay_s = 1.5

    def _before_forward(self, header: bytes, body: bytes) -> None:
        if header[:1] == b"Q" and b"clock_timestamp" in body:
            time.sleep(self.delay_s)


def test_a_clock_read_over_a_slow_round_trip_is_refused_not_trusted(
    make_db: Callable[[], str], login_as: Callable[[str, str], str]
) -> None:
    """The offset is known to within half the round trip, and a one-way delay puts it all on one side. A host whose
    clock agrees with the server's, reading it over a link that holds each query 1.5 s, takes the server's clock to be
    0.75 s ahead of where it is: past a 0.5 s skew, unseen by a check that counts the half round trip in the host's
    favour (the old code let the lease run on it). A clock read that uncertain is refused like a skewed one."""
    dsn = make_db()
    init_registry({"main": dsn}, num_shards=1)
    joiner_dsn = login_as(dsn, "photon_joiner")
    with proxy_for_class(SlowClockProxy, joiner_dsn) as proxy:
        clock = ServerClock(proxy.dsn, max_skew_s=0.5)
    off_us = clock.now_us() - server_clock_us(joiner_dsn)
    assert off_us > 0.5 * US, off_us / US  # the harm: decisions on a clock further from the server's than the skew
    with pytest.raises(ClockSkewError, match="round trip"):
        clock.check()
    ServerClock(joiner_dsn, max_skew_s=0.5).check()  # the same host over a fast link: in step
