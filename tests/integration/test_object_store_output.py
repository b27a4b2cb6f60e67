"""The joiner writing its output and its state to an S3 bucket (a real S3 server: SeaweedFS, as `photon storage up`
runs it) as well as reading its logs from there: the Delta tables, each batch's stage (data files, add records, read
markers, staged EventStore index), the retry sets, the EventStore and `_pipeline.json`, all through the store;
nothing of the pipeline in any local folder. Whole processes SIGKILLed at the points where a folder's renames used to
carry the protocol (after the registry commit, between two tables' commits), and the S3 server SIGKILLed under a
lease, then restarted: the lease start publishes what was committed from the bucket, drops what was only staged, and
goes on. The checks read the bucket with deltalake directly and the generator's manifest (no code of the joiner),
then the audit reads the bucket too. Last, the verifier recovering a data center lost for good, through the bucket."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable

from photon.pg import autocommit
from photon.recovery.verify import verify_and_recover
from photon.registry.admin import init_registry
from photon.storage import S3Store
from photon.tools import storage_server
from photon.tools.audit import audit
from photon.tools.generator import GeneratorSettings, generate

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
US = 1_000_000


def bucket_table(s3: storage_server.Server, url: str) -> DeltaTable:
    """A table of the bucket read as any Delta reader would: deltalake, the server's endpoint and keys."""
    env = s3.env()
    options = {
        "aws_endpoint_url": env["AWS_ENDPOINT_URL"],
        "aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
        "aws_region": env.get("AWS_REGION", "us-east-1"),
        "aws_allow_http": "true",
    }
    return DeltaTable(url, storage_options=options)


def committed(dsn: str) -> int:
    with autocommit(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM photon.batches WHERE pipeline = 'dc-a'")
        return int(cur.fetchone()[0])


def retried(dsn: str) -> int:
    with autocommit(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT coalesce(sum(retried), 0) FROM photon.batch_metrics WHERE pipeline = 'dc-a'")
        return int(cur.fetchone()[0])


def test_a_joiner_killed_mid_publish_or_losing_its_store_resumes_from_its_state_in_the_bucket_exactly_once(
    tmp_path: Path,
    s3_server: storage_server.Server,
    bucket: str,
    make_db: Callable[[], str],
    login_as: Callable[[str, str], str],
) -> None:
    manifest, cwd = tmp_path / "manifest", tmp_path / "cwd"
    cwd.mkdir()
    # Fresh logs, a join delay of 40 s and some queries never logged: clicks wait in the retry sets (in the bucket)
    # across batches and across the faults, until their deadline.
    start = (int(time.time()) - 5) * US
    logs, out = S3Store(f"s3://{bucket}/logs"), S3Store(f"s3://{bucket}/out")
    settings = GeneratorSettings(events_per_s=300, dcs=("dc-a",), lost_query_fraction=0.05, max_join_delay_s=40)
    generate(settings, logs.url, start_us=start, end_us=start + 12 * US, manifest=manifest)

    admin = make_db()
    init_registry({"main": admin}, num_shards=4)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}", **s3_server.env()}
    env["PHOTON_REGISTRY_DSN"] = login_as(admin, "photon_joiner")
    env["PHOTON_TEST_MAX_CLICK_FILES"] = "3"  # small batches: the crash points fall inside the run
    cmd = [sys.executable, "-m", "photon", "join", "--dc", "dc-a", "--logs", logs.url, "--out", out.url]
    cmd += ["--until-caught-up", "--drain", "--trigger-interval", "0.1", "--max-join-delay", "40"]
    # Killed after batch 2's registry commit (its stage only in the bucket), then after batch 4's joined table
    # commit (the other tables and the EventStore index not yet): each next lease starts by finishing them.
    for point in ("after_commit@2", "after_table_commit@+2"):
        proc = subprocess.run(
            cmd, cwd=cwd, env={**env, "PHOTON_CRASH_AT": point}, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == -9, proc.stdout[-3000:] + proc.stderr[-3000:]  # really killed there
        assert "killed at" in proc.stderr, proc.stderr[-3000:]
    staged = [e.key for e in out.listing("dc-a/_staging")]
    assert staged, "the killed lease left its stage in the bucket"

    # Then the S3 server SIGKILLed under a lease, and kept down past the requests' retry budget (3 s here): the lease
    # fails in one line, no credential in it. The server comes back, on its endpoint.
    before = committed(admin)
    lease = subprocess.Popen(
        cmd, cwd=cwd, env={**env, "PHOTON_STORAGE_RETRY_S": "3"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while committed(admin) <= before and lease.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert committed(admin) > before and lease.poll() is None, "the third lease never got going"
        storage_server.stop(s3_server.folder, hard=True)
        down = lease.communicate(timeout=120)  # down until the lease gives up
    finally:
        if lease.poll() is None:
            lease.kill()
        storage_server.start(s3_server.folder)
    assert lease.returncode == 2, down[0][-3000:] + down[1][-3000:]
    said = down[1].strip().splitlines()[-1]
    assert said.startswith("error:") and f"s3://{bucket}/" in said and "Traceback" not in down[1], down[1][-3000:]

    assert s3_server.env() == {k: env[k] for k in s3_server.env()}, "the restarted server moved its endpoint"
    final = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stdout[-3000:] + final.stderr[-3000:]
    assert "Traceback" not in final.stdout + final.stderr

    # Read as any Delta reader reads the bucket: every click of the manifest that must join, once; nothing else.
    joined = bucket_table(s3_server, f"{out.url}/dc-a/joined").to_pyarrow_table(columns=["click_id", "batch"])
    ids = joined.column("click_id")
    assert len(ids) == len(pc.unique(ids)), "a click joined twice"
    report = audit(out, manifest=manifest)
    assert report.ok and report.lost == 0 and report.duplicate_clicks == 0, report.failures()
    assert report.outcomes["joined"] == len(ids) > 0
    # The protocol's state lives in the bucket: no stage left, an EventStore and retry sets there, no local folder.
    assert [e.key for e in out.listing("dc-a/_staging")] == []
    assert any(e.key.endswith(".arrow") for e in out.listing("dc-a/_state/eventstore"))
    assert out.get("dc-a/_pipeline.json")
    assert retried(admin) > 0, "no click waited for its query: the retry sets were never exercised"
    assert sorted(p.name for p in cwd.iterdir()) == [], "the joiner wrote into its working folder"
    secret = s3_server.env()["AWS_SECRET_ACCESS_KEY"]
    assert secret not in proc.stdout + proc.stderr + "".join(down) + final.stdout + final.stderr


def test_the_verifier_recovers_a_data_center_lost_for_good_through_the_bucket(
    tmp_path: Path,
    s3_server: storage_server.Server,
    bucket: str,
    make_db: Callable[[], str],
    login_as: Callable[[str, str], str],
) -> None:
    """dc-a dies for good after registering a batch it never commits; the verifier, reading dc-a's tables in the
    bucket, fences it, finds those clicks lost, writes their lines as intents into every data center's logs in the
    bucket (objects no joiner lists), deletes the rows, then publishes the intents as closed objects; dc-b joins
    them. Every click of the manifest has exactly one outcome over both pipelines."""
    manifest = tmp_path / "manifest"
    start = (int(time.time()) - 120) * US
    logs, out = S3Store(f"s3://{bucket}/logs"), S3Store(f"s3://{bucket}/out")
    settings = GeneratorSettings(events_per_s=300, dcs=("dc-a", "dc-b"), late_click_fraction=0.0)
    generate(settings, logs.url, start_us=start, end_us=start + 12 * US, manifest=manifest)
    admin = make_db()
    init_registry({"main": admin}, num_shards=4)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}", **s3_server.env()}
    env["PHOTON_REGISTRY_DSN"] = login_as(admin, "photon_joiner")
    env["PHOTON_TEST_MAX_CLICK_FILES"] = "3"

    def join(dc: str, *extra: str, crash: str = "") -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "photon", "join", "--dc", dc, "--logs", logs.url, "--out", out.url]
        cmd += ["--until-caught-up", "--drain", "--trigger-interval", "0.1", "--max-join-delay", "30", *extra]
        return subprocess.run(cmd, env={**env, "PHOTON_CRASH_AT": crash}, capture_output=True, text=True, timeout=300)

    died = join("dc-a", crash="after_register@3")
    assert died.returncode == -9, died.stdout[-3000:] + died.stderr[-3000:]
    time.sleep(2.0)  # gone for longer than the grace period
    verifier = {"main": login_as(admin, "photon_verifier")}
    report = verify_and_recover(verifier, out, logs, grace_s=1.0)
    assert report.fenced == ["dc-a"] and report.lost > 0 and report.recovered == report.lost, report
    assert report.not_in_logs == 0, report
    # The re-dispatched clicks are closed objects in every data center's logs; no intent is left behind.
    assert {u.split("/logs/")[1].split("/")[0] for u in report.redispatched_files} == {"dc-a", "dc-b"}
    assert not [e.key for e in logs.listing() if e.key.endswith(".inprogress")]
    again = verify_and_recover(verifier, out, logs, grace_s=1.0)
    assert again.lost == 0 and again.redispatched_files == [], again  # nothing recovered twice

    b = join("dc-b")
    assert b.returncode == 0, b.stdout[-3000:] + b.stderr[-3000:]
    audited = audit(out, manifest=manifest, ran=["dc-a", "dc-b"])
    assert audited.lost == 0 and audited.duplicate_clicks == 0, audited.failures()
    ids = pc.unique(
        pa.concat_arrays(
            [
                bucket_table(s3_server, f"{out.url}/{dc}/joined")
                .to_pyarrow_table(columns=["click_id"])
                .column("click_id")
                .combine_chunks()
                for dc in ("dc-a", "dc-b")
            ]
        )
    )
    joined = sum(
        bucket_table(s3_server, f"{out.url}/{dc}/joined").to_pyarrow_table(columns=["click_id"]).num_rows
        for dc in ("dc-a", "dc-b")
    )
    assert joined == len(ids) == audited.outcomes["joined"], "a click joined by both data centers"


def test_the_nemesis_checker_reads_a_bucket_as_it_reads_a_folder(
    tmp_path: Path, s3_server: storage_server.Server, bucket: str
) -> None:
    """The chaos run on s3 is only as good as its checker's reading of the bucket: the same planted tables (a
    duplicate across pipelines, a crashed batch's file named by no commit) and the same query logs, written with
    deltalake and obstore alone into a folder and into a bucket, read the same."""
    from deltalake import CommitProperties, Transaction, write_deltalake

    from tests.nemesis import checker

    env = s3_server.env()
    options = {k.lower(): v for k, v in env.items() if k != "AWS_ALLOW_HTTP"} | {"aws_allow_http": "true"}
    t = 1_790_000_000 * US
    folder, url = tmp_path / "out", f"s3://{bucket}/out"
    for where in (folder, url):
        for pipeline, rows in (("dc-a", [("c1", 1), ("c2", 1)]), ("dc-b", [("c3", 1), ("c1", 1)])):
            table = pa.table(
                {
                    "click_id": [c for c, _ in rows],
                    "query_id": ["q"] * len(rows),
                    "click_ts_us": [t] * len(rows),
                    "hour": ["2026092114"] * len(rows),
                    "batch": [b for _, b in rows],
                }
            )
            write_deltalake(
                f"{where}/{pipeline}/joined",
                table,
                partition_by=["hour"],
                storage_options=None if where == folder else options,
                commit_properties=CommitProperties(app_transactions=[Transaction(f"photon/{pipeline}", 1)]),
            )
    crashed = S3Store(url).child("dc-a/joined/hour=2026092114")
    crashed.put("crashed-batch-2.parquet", crashed.get(crashed.files()[0].key))
    (folder / "dc-a" / "joined" / "hour=2026092114" / "crashed-batch-2.parquet").write_bytes(
        crashed.get("crashed-batch-2.parquet")
    )
    S3Store(url).put("_state/x", b"")  # not a pipeline
    read = [checker._snapshots(w, "joined", "click_id", "batch") for w in (folder, url)]
    assert read[0] == read[1] and [(p, last) for p, last, _ in read[1]] == [("dc-a", 1), ("dc-b", 1)]
    assert checker.duplicates(folder) == checker.duplicates(url) == ["c1"]
    line = b'{"query_id": "q9", "ts_us": 1}\n'
    S3Store(f"s3://{bucket}/logs").put("dc-a/queries/20260921/1413/s1.jsonl", line)
    (tmp_path / "logs" / "dc-a" / "queries" / "20260921" / "1413").mkdir(parents=True)
    (tmp_path / "logs" / "dc-a" / "queries" / "20260921" / "1413" / "s1.jsonl").write_bytes(line)
    arrival = {("dc-a", "queries", "20260921/1413/s1.jsonl"): 5}
    assert (
        checker._query_arrivals(tmp_path / "logs", "dc-a", arrival)
        == checker._query_arrivals(f"s3://{bucket}/logs", "dc-a", arrival)
        == {"q9": 5}
    )
