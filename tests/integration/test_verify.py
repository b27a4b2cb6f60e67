"""Verification and recovery against real PostgreSQL, a real joiner process and real SIGKILLs: a joiner killed
between registration and commit, whose re-run batch then takes other files, loses clicks; `photon verify` finds them,
re-dispatches them, and after the next run the audit finds 0 lost and 0 duplicates."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from photon.joiner.common import JoinSettings
from photon.joiner.lease import Joiner
from photon.logs.layout import part_of_name, partition_of
from photon.logs.parse import parse_file
from photon.pg import autocommit
from photon.recovery.verify import verify_and_recover
from photon.registry.admin import init_registry, server_clock_us
from photon.registry.client import IdRegistry
from photon.tools.audit import audit
from photon.tools.generator import GeneratorSettings, generate

pytestmark = pytest.mark.integration
US = 1_000_000
ROOT = Path(__file__).resolve().parents[2]


def click_ids(path: Path) -> list[str]:
    return [str(c) for c in parse_file(path.name, path.read_bytes(), "clicks")[0]["click_id"].to_pylist()]


def joined_ids(out: Path) -> list[str]:
    return [
        c
        for p in sorted(out.glob("[!_]*/joined"))
        for c in DeltaTable(str(p)).to_pyarrow_table()["click_id"].to_pylist()
    ]


def test_killed_joiner_losses_are_found_and_recovered(
    tmp_path: Path, make_db: Callable[[], str], login_as: Callable[[str, str], str], warm_spark: Path
) -> None:
    dsn = make_db()
    init_registry({"main": dsn}, num_shards=4)
    servers = {"main": login_as(dsn, "photon_verifier")}  # each component as its own login, never the owner
    logs, out = tmp_path / "logs", tmp_path / "out"
    start = (int(time.time()) - 600) * US
    settings = GeneratorSettings(events_per_s=600, dcs=("dc-a",), malformed_fraction=0.0, late_click_fraction=0.0)
    generate(settings, logs, start_us=start, end_us=start + 12 * US)
    joiner = login_as(dsn, "photon_joiner")
    env = {**os.environ, "PHOTON_REGISTRY_DSN": joiner, "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}"}
    env |= {"PHOTON_TEST_MAX_CLICK_FILES": "4", "PHOTON_HOME": str(warm_spark)}  # leases on the warm server
    cmd = [sys.executable, "-m", "photon", "join", "--dc", "dc-a", "--logs", str(logs), "--out", str(out)]
    cmd += ["--until-caught-up", "--drain", "--trigger-interval", "0.1", "--connect"]
    clicks = logs / "dc-a" / "clicks"
    for i, batch in enumerate((2, 3, 5)):
        proc = subprocess.run(
            cmd, env={**env, "PHOTON_CRASH_AT": f"after_register@{batch}"}, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == -9, proc.stdout + proc.stderr
        # Files that the joiner takes first (they arrived earliest) appear before the restart: the re-run of the
        # killed batch takes them instead, and the clicks the killed attempt registered come in a later batch, under
        # another token. They are the files the joiner would have taken last (its order: oldest modification time,
        # then name), so never one a batch took, and they keep their names, which name the process that logged their
        # clicks (EVENTS.md, "File names"): the verifier finds a lost click's line by it.
        last = sorted(clicks.glob("*/*/*.jsonl"), key=lambda p: (p.stat().st_mtime_ns, str(p.relative_to(clicks))))
        for j, p in enumerate(last[-4:]):
            p.rename(clicks / p.name)
            os.utime(clicks / p.name, ns=(i * 10 + j, i * 10 + j))
    final = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stdout + final.stderr
    before = audit(out, manifest=logs / "_manifest")
    assert before.duplicate_clicks == 0 and before.lost > 0, before.to_json()  # the scenario really loses clicks

    dry = verify_and_recover(servers, out, logs, dry_run=True)
    assert dry.lost == before.lost and dry.recovered == 0 and not list(clicks.glob("recovered-*")), (dry, before.lost)
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
    # (pytest shows only the first unequal pair of a chained comparison: the whole report says which it was)
    assert report["lost"] == report["recovered"] == before.lost and report["not_in_logs"] == 0, (report, before.lost)
    assert report["committed"] == len(joined_ids(out)) and len(report["redispatched_files"]) == 1, report
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


def test_a_lost_click_is_found_in_its_process_s_files_only_and_kept_until_then(
    tmp_path: Path,
    make_db: Callable[[], str],
    login_as: Callable[[str, str], str],
    spark: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The verifier looks for a lost click's line in the files named after the process that logged it (EVENTS.md,
    "File names"). A click whose only line is in a file named after another process is not found: its registry row
    is kept (never deleted on a guess) and the pass says which; once a file of its process's name holds it again,
    the next pass recovers it. (The test above once renamed files to made-up names; in a run that started 52 to 54 s
    past a minute its renames caught a file of clicks a killed batch had registered: 38 lost, 33 recovered.)"""
    dsn = make_db()
    init_registry({"main": dsn}, num_shards=4)
    joiner = {"main": login_as(dsn, "photon_joiner")}
    verifier = {"main": login_as(dsn, "photon_verifier")}
    logs, out = tmp_path / "logs", tmp_path / "out"
    start = (int(time.time()) - 600) * US
    settings = GeneratorSettings(events_per_s=600, dcs=("dc-a",), malformed_fraction=0.0, late_click_fraction=0.0)
    generate(settings, logs, start_us=start, end_us=start + 12 * US)
    clicks = logs / "dc-a" / "clicks"
    # dc-a commits batch 1, registers batch 2 (as its executors do) and dies before committing it.
    a = Joiner("dc-a", logs, out, joiner, spark, JoinSettings(max_click_files=4, heartbeat_s=0.2))
    a.run(max_batches=1)
    _, c_files = a.discovery.new_files()
    assert a.lease is not None and len(c_files) == 4
    stranded = sorted({c for n in c_files for c in click_ids(clicks / n)})
    with IdRegistry(joiner) as reg:
        reg.register(stranded, a.lease.token(2))
    # One of batch 2's files goes under another process's name (a relay's, say); its clicks are nowhere else.
    moved = clicks / c_files[0]
    elsewhere = {c for p in clicks.glob("*/*/*.jsonl") if p != moved for c in click_ids(p)}
    hidden = set(click_ids(moved)) - elsewhere
    assert hidden
    relay = moved.with_name("10.200.0.1-1-1.jsonl")
    moved.rename(relay)
    time.sleep(1.0)  # dc-a is gone for longer than the grace period

    with caplog.at_level(logging.WARNING, logger="photon.recovery.verify"):
        first = verify_and_recover(verifier, out, logs, grace_s=0.5)
    assert first.fenced == ["dc-a"] and first.lost == len(stranded), first
    assert first.not_in_logs == len(hidden) and first.recovered == len(stranded) - len(hidden), first
    with IdRegistry(joiner) as reg:
        held = reg.lookup(stranded).tokens != 0
    assert {c for c, h in zip(stranded, held, strict=True) if h} == hidden  # kept, under the retired owner's token
    assert any(c in r.getMessage() for r in caplog.records for c in hidden), caplog.text

    relay.rename(moved)  # back under its process's name
    second = verify_and_recover(verifier, out, logs, grace_s=0.5)
    assert second.lost == second.recovered == len(hidden) and second.not_in_logs == 0, second
    assert {c for f in second.redispatched_files for c in click_ids(Path(f))} == hidden
    with IdRegistry(joiner) as reg:
        assert not reg.lookup(stranded).registered.any()  # every stranded row deleted: free to be joined again
