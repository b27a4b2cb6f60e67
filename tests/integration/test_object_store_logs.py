"""The joiner reading its logs from an S3 bucket (a real S3 server: SeaweedFS, as `photon storage up` runs it), as
EVENTS.md's rules for object stores say: an object is closed when it exists (one ending mid-line is read at once,
whole, never waited for), listings run from the pipeline's marks, the EventStore reads query lines back by ranges,
and a consumed key put again (another ETag) is reported once as a quarantine record, never read twice, never a
crash. The checks read the output tables and the generator's manifest only."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psycopg2.extensions
import pytest
from deltalake import DeltaTable

from photon.logs.layout import partition_of
from photon.pg import autocommit
from photon.registry.admin import init_registry
from photon.storage import LocalStore, S3Store
from photon.tools import storage_server
from photon.tools.audit import audit
from photon.tools.generator import GeneratorSettings, generate
from photon.tools.status import pipeline_status

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
US = 1_000_000


def consumed(dsn: str) -> int:
    with autocommit(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM photon.consumed_files WHERE pipeline = 'dc-a' AND kind = 'clicks'")
        return int(cur.fetchone()[0])


def test_a_joiner_reads_its_logs_from_a_bucket_and_reports_a_key_put_again(
    tmp_path: Path,
    s3_server: storage_server.Server,
    bucket: str,
    make_db: Callable[[], str],
    login_as: Callable[[str, str], str],
) -> None:
    local, out, manifest = tmp_path / "logs", tmp_path / "out", tmp_path / "manifest"
    start = (int(time.time()) - 150) * US  # recent: a lease from the beginning warns of no history
    settings = GeneratorSettings(events_per_s=200, dcs=("dc-a",))
    logs = S3Store(f"s3://{bucket}/logs")
    # `photon generate --logs s3://...`: the same bytes, key for key, as in a folder; the manifest in a folder
    generate(settings, logs.url, start_us=start, end_us=start + 20 * US, manifest=manifest)
    generate(settings, local, start_us=start, end_us=start + 20 * US)
    files = [e.key for e in LocalStore(local / "dc-a").listing() if e.key.endswith(".jsonl")]
    assert [e.key for e in logs.listing("dc-a")] == [f"dc-a/{k}" for k in files]
    assert all(logs.get(f"dc-a/{k}") == (local / "dc-a" / k).read_bytes() for k in files)
    clicks = sorted(k for k in files if k.startswith("clicks/"))
    assert len(clicks) >= 2
    torn = clicks[0]  # put again without its last newline: an object is whole as it is, read at once
    logs.put(f"dc-a/{torn}", logs.get(f"dc-a/{torn}")[:-1])

    admin = make_db()
    init_registry({"main": admin}, num_shards=4)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}", **s3_server.env()}
    env["PHOTON_REGISTRY_DSN"] = login_as(admin, "photon_joiner")
    # Every batch first finds its clicks' query ids, and its own queries travel to them with the shuffle (a catch-up
    # batch's way past 128 MiB of query objects): the first batch takes every file of the logs.
    env["PHOTON_SHIP_QUERIES_FROM_MIB"] = "0"
    cmd = [sys.executable, "-m", "photon", "join", "--dc", "dc-a", "--logs", logs.url, "--out", str(out)]
    lease = subprocess.Popen(
        [*cmd, "--run-for", "240"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )

    def wait(what: str, done: Callable[[], object], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if lease.poll() is not None or time.monotonic() > deadline:
                lease.kill()
                raise AssertionError(f"{what}: not within {timeout:.0f} s\n{lease.communicate()[0][-4000:]}")
            time.sleep(1)

    try:
        wait("every click file consumed", lambda: consumed(admin) >= len(clicks), 180)
        # Every click of the bucket's logs joined once, the object without its last newline included.
        report = audit(out, manifest=manifest)
        assert report.ok and report.lost == 0 and report.duplicate_clicks == 0, report.failures()

        # A click object arriving now (a replica re-shipping a file under another name: clicks already joined, the
        # registry lets none in twice), consumed; then put again, longer, under its key (a shipper that re-sent it):
        # another ETag, reported once, read never. (A partition still open: a sealed one is never listed again.)
        late = f"clicks/{partition_of(int(time.time() * US))}/10.9.9.9-1-{time.time_ns()}.jsonl"
        body = logs.get(f"dc-a/{clicks[-1]}")
        logs.put(f"dc-a/{late}", body)
        wait("the late object consumed", lambda: consumed(admin) > len(clicks), 60)
        # `photon status` lists the bucket from the lease's marks: every object consumed, nothing behind.
        (status,) = pipeline_status(admin, logs=logs, out=out)
        assert status["state"] == "running" and status["lag"] == {"queries": None, "clicks": None}, status
        assert status["behind_s"] == 0.0 and status["tables"]["joined"]["published_batch"] >= 1, status
        logs.put(f"dc-a/{late}", body + b'{"click_id": "again"}\n')
        quarantine = out / "dc-a" / "quarantine"

        def reported() -> list[dict[str, object]]:
            rows = DeltaTable(str(quarantine)).to_pyarrow_table().to_pylist()
            return [r for r in rows if "closed file changed" in str(r["reason"])]

        wait("the key put again reported", reported, 60)
        time.sleep(3)  # a few more batches: still reported once
        (row,) = reported()
        assert row["file"] == late.removeprefix("clicks/") and "replaced by another file" in str(row["reason"]), row
    finally:
        lease.terminate()
        output = lease.communicate(timeout=120)[0]
    assert lease.returncode == 143 and "lease released" in output, output[-4000:]  # stopped by SIGTERM
    assert "Traceback" not in output, output[-4000:]
    assert re.search(r"batch 1: \d+ clicks, \d+ joined \([1-9]\d* with their query shipped\)", output), output[-4000:]
    report = audit(out, manifest=manifest)
    assert report.lost == 0 and report.duplicate_clicks == 0, report.failures()
    # The one record the manifest does not know: the key put again
    assert report.failures() == ["1 quarantine record(s) more than malformed lines"], report.failures()
    # The joiner's login and the bucket's key reached no command line or log line.
    secret = s3_server.env()["AWS_SECRET_ACCESS_KEY"]
    assert secret not in output
    assert psycopg2.extensions.parse_dsn(env["PHOTON_REGISTRY_DSN"]).get("password", "\0") not in output


def test_a_backfill_window_and_the_finality_of_its_hour_read_the_bucket(
    tmp_path: Path,
    s3_server: storage_server.Server,
    bucket: str,
    make_db: Callable[[], str],
    login_as: Callable[[str, str], str],
) -> None:
    """An hour two hours back, in both replicas in the bucket: `photon final` finds it not final (nothing consumed
    it), a backfill of an hour without logs is refused in one line naming the bucket, the backfill of the hour joins
    it from the bucket, and `photon final --mark` then declares it, with its marker put into the bucket. Was: the
    window refused (`--logs s3://...: a backfill window reads its logs from a folder`), `photon final` too."""
    admin = make_db()
    init_registry({"main": admin}, num_shards=2)
    logs, out, manifest = f"s3://{bucket}/logs", f"s3://{bucket}/out", tmp_path / "manifest"
    hour = (int(time.time()) // 3600 - 2) * 3600 * US
    settings = GeneratorSettings(
        events_per_s=100, late_click_fraction=0.0, late_query_file_fraction=0.0, lost_query_fraction=0.0
    )
    generate(settings, logs, start_us=hour + 600 * US, end_us=hour + 630 * US, manifest=manifest)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}", **s3_server.env()}

    def photon(login: str, *args: str) -> subprocess.CompletedProcess[str]:
        run_env = env | {"PHOTON_REGISTRY_DSN": login_as(admin, login)}
        cmd = [sys.executable, "-m", "photon", *args]
        return subprocess.run(cmd, env=run_env, cwd=ROOT, capture_output=True, text=True, timeout=300)

    def iso(us: int) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(us // US))

    final = ["final", "--hour", iso(hour)[:13], "--logs", logs, "--out", out, "--json"]
    undecided = photon("photon_verifier", *final)
    assert undecided.returncode == 1, undecided.stdout[-3000:] + undecided.stderr[-3000:]
    decision = json.loads(undecided.stdout)
    assert decision["click_files"] > 10 and decision["lost_data_centers"] == ["dc-a", "dc-b"], decision

    def backfill(start: int) -> subprocess.CompletedProcess[str]:
        window = ["--window-start", iso(start), "--window-end", iso(start + 3600 * US)]
        return photon(
            "photon_joiner",
            *("join", "--dc", "dc-a", "--logs", logs, "--out", out, "--pipeline", f"backfill-dc-a-{start // US}"),
            *("--until-caught-up", "--drain", "--max-join-delay", "30", *window),
        )

    empty = backfill(hour - 3600 * US)
    assert empty.returncode == 2, empty.stdout[-3000:] + empty.stderr[-3000:]
    assert f"no click file in {logs}/dc-a/clicks for the window" in empty.stdout + empty.stderr
    joined = backfill(hour)
    assert joined.returncode == 0, joined.stdout[-3000:] + joined.stderr[-3000:]

    shown = photon("photon_verifier", "status", "--all", "--json", "--logs", logs, "--out", out)
    assert shown.returncode == 0, shown.stdout[-3000:] + shown.stderr[-3000:]
    (status,) = json.loads(shown.stdout)
    assert status["state"] == "finished" and status["retries"] == {"waiting": 0, "due": 0}, status
    assert status["tables"]["joined"]["published_batch"] == status["last_batch"] >= 1, status

    declared = photon("photon_verifier", *final, "--mark")
    assert declared.returncode == 0, declared.stdout[-3000:] + declared.stderr[-3000:]
    marker = json.loads(declared.stdout)
    assert marker["final"] and marker["input_clicks"] > 100, marker
    key = f"out/_final/{time.strftime('%Y%m%d%H', time.gmtime(hour // US))}.json"
    assert marker["marker"] == f"s3://{bucket}/{key}"
    assert json.loads(S3Store(f"s3://{bucket}").get(key))["input_clicks"] == marker["input_clicks"]
    report = audit(S3Store(out), manifest=manifest, ran=["dc-a"])
    assert report.lost == 0 and report.duplicate_clicks == 0 and report.outcomes["joined"] > 100, report.failures()


def test_queries_shipped_to_their_clicks_keep_the_first_copy_and_leave_clicks_joined_before_alone(
    tmp_path: Path,
    s3_server: storage_server.Server,
    bucket: str,
    make_db: Callable[[], str],
    login_as: Callable[[str, str], str],
) -> None:
    """Every batch ships its own queries to its clicks (PHOTON_SHIP_QUERIES_FROM_MIB=0). A query logged again with other
    content: its clicks, of this batch or a later one, join the first copy (README); a click joined before and sent
    again beside clicks still waiting: pre-filtered, the batch goes on (a partition whose shipped lines no live click
    took raised once). Found by a review of the shipping, with these logs."""

    def query(t: int, text: str) -> bytes:
        ads = [{"ad_id": "a1", "advertiser_id": "x", "bid_micros": 1}]
        q = {"query_id": f"10.0.0.1-1-{t}", "ts_us": t, "user_id": "u", "query_text": text, "country": "DE"}
        return json.dumps(q | {"ads": ads}).encode() + b"\n"

    def click(t: int, query_ts: int) -> bytes:
        c = {"click_id": f"10.0.0.2-1-{t}", "ts_us": t, "query_id": f"10.0.0.1-1-{query_ts}", "ad_id": "a1"}
        return json.dumps(c).encode() + b"\n"

    logs, out = S3Store(f"s3://{bucket}/logs"), tmp_path / "out"
    admin = make_db()
    init_registry({"main": admin}, num_shards=2)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}", **s3_server.env()}
    env |= {"PHOTON_REGISTRY_DSN": login_as(admin, "photon_joiner"), "PHOTON_SHIP_QUERIES_FROM_MIB": "0"}
    cmd = [sys.executable, "-m", "photon", "join", "--dc", "dc-a", "--logs", logs.url, "--out", str(out)]
    cmd.append("--until-caught-up")
    t0 = (int(time.time()) - 30) * US
    q1, q2 = t0, t0 + 2
    part = partition_of(t0)
    # Batch 1: q1 (first copy), a click on it, and q1's copy again with other content in a later file of the batch
    logs.put(f"dc-a/queries/{part}/10.0.0.1-1-{t0}.jsonl", query(q1, "FIRST"))
    logs.put(f"dc-a/queries/{part}/10.0.0.1-1-{t0 + 1}.jsonl", query(q1, "LATER"))
    logs.put(f"dc-a/clicks/{part}/10.0.0.2-1-{t0}.jsonl", click(t0 + 10, q1))
    first = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "1 joined (1 with their query shipped)" in first.stdout, first.stdout
    # Batch 2: q1 logged once more (other content), the batch-1 click sent again, a new click on q1, a new query and
    # a click on it, and clicks whose queries are not logged yet
    part2 = partition_of(int(time.time() * US))
    logs.put(f"dc-a/queries/{part2}/10.0.0.1-1-{t0 + 3}.jsonl", query(q1, "SECOND") + query(q2, "NEW"))
    waiting = b"".join(click(t0 + 20 + i, t0 + 5 + i) for i in range(40))
    again = click(t0 + 10, q1) + click(t0 + 11, q1) + click(t0 + 12, q2) + waiting
    logs.put(f"dc-a/clicks/{part2}/10.0.0.2-1-{t0 + 3}.jsonl", again)
    second = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0 and "Traceback" not in second.stderr, second.stdout[-3000:] + second.stderr[-3000:]
    said = "batch 2: 43 clicks, 2 joined (1 with their query shipped), 1 pre-filtered, 0 wasted, 40 waiting"
    assert said in second.stdout, second.stdout
    rows = DeltaTable(str(out / "dc-a" / "joined")).to_pyarrow_table(columns=["click_id", "query_text"]).to_pylist()
    got = {r["click_id"]: r["query_text"] for r in rows}
    assert got == {f"10.0.0.2-1-{t0 + 10}": "FIRST", f"10.0.0.2-1-{t0 + 11}": "FIRST", f"10.0.0.2-1-{t0 + 12}": "NEW"}
