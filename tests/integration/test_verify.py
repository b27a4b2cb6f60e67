"""Verification and recovery against real PostgreSQL, a real joiner process and real SIGKILLs: a joiner killed
between registration and commit, whose re-run batch then takes other files, loses clicks; `photon verify` finds them,
re-dispatches them, and after the next run the audit finds 0 lost and 0 duplicates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from photon.logs.layout import part_of_name, partition_of
from photon.pg import autocommit
from photon.recovery.verify import verify_and_recover
from photon.registry.admin import init_registry, server_clock_us
from photon.tools.audit import audit
from photon.tools.generator import GeneratorSettings, generate

pytestmark = pytest.mark.integration
US = 1_000_000
ROOT = Path(__file__).resolve().parents[2]


def joined_ids(out: Path) -> list[str]:
    return [cid for p in sorted(out.glob("*/joined/*.parquet")) for cid in pq.read_table(p)["click_id"].to_pylist()]


def test_killed_joiner_losses_are_found_and_recovered(
    tmp_path: Path, make_db: Callable[[], str], login_as: Callable[[str, str], str]
) -> None:
    import time

    dsn = make_db()
    init_registry({"main": dsn}, num_shards=4)
    servers = {"main": login_as(dsn, "photon_verifier")}  # each component as its own login, never the owner
    logs, out = tmp_path / "logs", tmp_path / "out"
    start = (int(time.time()) - 600) * US
    settings = GeneratorSettings(events_per_s=600, dcs=("dc-a",), malformed_fraction=0.0, late_click_fraction=0.0)
    generate(settings, logs, start_us=start, end_us=start + 12 * US)
    joiner = login_as(dsn, "photon_joiner")
    env = {**os.environ, "PHOTON_REGISTRY_DSN": joiner, "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}"}
    env["PHOTON_TEST_MAX_CLICK_FILES"] = "4"
    cmd = [sys.executable, "-m", "photon", "join", "--dc", "dc-a", "--logs", str(logs), "--out", str(out)]
    cmd += ["--until-caught-up", "--drain", "--trigger-interval", "0.1", "--master", "local[2]"]
    clicks = logs / "dc-a" / "clicks"
    for i, batch in enumerate((2, 3, 5)):
        proc = subprocess.run(
            cmd, env={**env, "PHOTON_CRASH_AT": f"after_register@{batch}"}, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == -9, proc.stdout + proc.stderr
        # Files that the joiner takes first (they arrived earliest) appear before the restart: the re-run of the
        # killed batch takes them instead, and the clicks the killed attempt registered come in a later batch, under
        # another token.
        late = sorted(p for p in clicks.rglob("*.jsonl") if not p.name.startswith("0."))[-4:]
        for j, p in enumerate(late):
            p.rename(clicks / f"0.0.{i}.{j}-1-1.jsonl")
            os.utime(clicks / f"0.0.{i}.{j}-1-1.jsonl", ns=(i * 10 + j, i * 10 + j))
    final = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stdout + final.stderr
    before = audit(out, manifest=logs / "_manifest")
    assert before.duplicate_clicks == 0 and before.lost > 0  # the scenario really loses clicks

    dry = verify_and_recover(servers, out, logs, dry_run=True)
    assert dry.lost == before.lost and dry.recovered == 0 and not list(clicks.glob("recovered-*"))
    # The pass runs as `photon verify` on a host whose clock is 90 s slow: the recovered file lands in the partition
    # of now by the registry server's clock (a partition the joiners have not sealed), not of the host's.
    since = partition_of(server_clock_us(servers["main"]))
    verify = [sys.executable, "-m", "photon", "verify", "--logs", str(logs), "--out", str(out), "--json"]
    skewed = subprocess.run(
        ["faketime", "-f", "-90s", *verify],
        env={**env, "PHOTON_REGISTRY_DSN": servers["main"]},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert skewed.returncode == 0, skewed.stdout + skewed.stderr
    report = json.loads(skewed.stdout)
    until = partition_of(server_clock_us(servers["main"]))
    assert report["lost"] == report["recovered"] == before.lost and report["not_in_logs"] == 0
    assert report["committed"] == len(joined_ids(out)) and len(report["redispatched_files"]) == 1
    recovered = Path(report["redispatched_files"][0]).relative_to(clicks)
    assert since <= part_of_name(str(recovered)) <= until, (recovered, since, until)

    rerun = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    after = audit(out, manifest=logs / "_manifest")
    assert after.ok, after.failures()
    assert after.lost == 0 and after.duplicate_clicks == 0

    # A second pass clears the recovered clicks' tokens; nothing is lost, and no token is left behind.
    again = verify_and_recover(servers, out, logs)
    assert again.lost == 0 and again.committed == before.lost
    with autocommit(dsn) as conn, conn.cursor() as cur:
        left = 0
        for shard in range(4):
            cur.execute(f"SELECT count(*) FROM photon.ids_c1_s{shard} WHERE token IS NOT NULL")
            left += cur.fetchone()[0]
    assert left == 0
