"""Both data centers' pipelines on a Spark standalone cluster (a master and two workers, as `photon spark up` starts
them), sharing nothing with the drivers but the S3 bucket and the registry: the tasks get URLs, the executors read
and write the bucket with their own environment's credentials, each worker runs in a folder of its own. Over live
logs written into the bucket meanwhile, a worker is SIGKILLed with its executor while a task runs and started again,
then the S3 server is SIGKILLed and started again on its endpoint; the leases ride through both and go on until every
click is decided. Then the verifier and the audit: every click of the manifest once, over both data centers. The
checks read the bucket with deltalake directly, and the audit."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from photon.pg import autocommit
from photon.recovery.verify import verify_and_recover
from photon.registry.admin import init_registry
from photon.storage import S3Store
from photon.tools import spark_cluster, storage_server
from photon.tools.audit import audit
from photon.tools.generator import GeneratorSettings, generate
from tests.integration.test_object_store_output import bucket_table
from tests.nemesis import checker

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
US = 1_000_000
DCS = ("dc-a", "dc-b")


def committed(dsn: str) -> dict[str, int]:
    with autocommit(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT pipeline, count(*) FROM photon.batches GROUP BY pipeline")
        return {str(p): int(n) for p, n in cur.fetchall()}


def wait_for_batches(
    dsn: str, after: dict[str, int], more: int, leases: list[subprocess.Popen[str]], said: Callable[[int], str]
) -> None:
    """Until each pipeline has committed ``more`` batches past ``after`` (its leases still running); a lease that
    ended or a deadline passed fails with what the leases printed (``said`` of a pid)."""
    deadline = time.monotonic() + 300
    while any(committed(dsn).get(dc, 0) < after.get(dc, 0) + more for dc in DCS):
        dead = [p for p in leases if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            ended = {" ".join(map(str, p.args[3:6])): p.returncode for p in dead}
            raise AssertionError(f"{ended or 'too slow'}: {committed(dsn)} after {after}\n" + "\n".join(
                said(p.pid) for p in (dead or leases)
            ))  # fmt: skip
        time.sleep(0.2)


def wait_until_busy(work: Path) -> None:
    """Until a task runs in an executor of the worker whose folder is ``work``: its log says the task started and not
    yet that it finished (a batch's tasks take a fraction of its 1-3 s; polled every 10 ms)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for log in work.glob("app-*/*/stderr"):
            with contextlib.suppress(OSError):
                if in_flight(log.read_text(errors="replace")):
                    return
        time.sleep(0.01)
    raise AssertionError("no task ran on the worker for 120 s")


def in_flight(executor_log: str) -> set[str]:
    """The tasks an executor's log says it started and never finished."""
    started = set(re.findall(r"Running task .* \(TID (\d+)\)", executor_log))
    return started - set(re.findall(r"Finished task .* \(TID (\d+)\)", executor_log))


def test_both_pipelines_on_a_cluster_sharing_only_the_bucket_lose_a_worker_and_the_store_and_join_exactly_once(
    tmp_path: Path,
    s3_server: storage_server.Server,
    bucket: str,
    make_db: Callable[[], str],
    login_as: Callable[[str, str], str],
) -> None:
    manifest, drivers, folder = tmp_path / "manifest", tmp_path / "drivers", tmp_path / "spark"
    drivers.mkdir()
    logs, out = S3Store(f"s3://{bucket}/logs"), S3Store(f"s3://{bucket}/out")
    admin = make_db()
    init_registry({"main": admin}, num_shards=4)
    code = {"PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}"}
    # The workers' environment: the project's code and the store's credentials, nothing of any driver's.
    cluster = spark_cluster.start(folder, workers=2, cores=1, memory="1g", env={**code, **s3_server.env()})
    try:
        env = {**os.environ, **code, **s3_server.env(), "TMPDIR": str(drivers)}
        env["PHOTON_REGISTRY_DSN"] = login_as(admin, "photon_joiner")
        env["PYTHONUNBUFFERED"] = "1"  # the lease lines as they are printed
        # Each application one executor of one core: the two pipelines side by side, one on each worker (a lost
        # worker leaves its application without an executor until it is back).
        cap = "--conf spark.cores.max=1 --conf spark.executor.cores=1 --conf spark.executor.memory=600m"
        jvm = shlex.quote(f"spark.executor.extraJavaOptions={os.environ['SPARK_DAEMON_JAVA_OPTS']}")
        env["PYSPARK_SUBMIT_ARGS"] = f"{cap} --conf {jvm} pyspark-shell"

        files: dict[int, Path] = {}

        def join(dc: str, *how: str) -> subprocess.Popen[str]:
            """A lease; its output to files (a pipe nobody reads until the end fills up with Spark's warnings about
            the lost executors, and blocks the driver)."""
            cmd = [sys.executable, "-m", "photon", "join", "--dc", dc, "--logs", logs.url, "--out", out.url]
            cmd += ["--master", cluster.master_url, "--trigger-interval", "0.2", "--max-join-delay", "20", *how]
            said = tmp_path / f"{dc}-{len(files)}"
            with open(said.with_suffix(".out"), "w") as o, open(said.with_suffix(".err"), "w") as e:
                # dc-a's batches first find their clicks' query ids, and ship their own queries to them in the
                # shuffle (a large catch-up batch's way), dc-b's look every query up: both under the faults
                ship = {"PHOTON_SHIP_QUERIES_FROM_MIB": "0"} if dc == "dc-a" else {}
                p = subprocess.Popen(cmd, cwd=drivers, env=env | ship, stdout=o, stderr=e, text=True)
            files[p.pid] = said
            return p

        def tail(pid: int) -> str:
            """The end of what a lease printed, for a failure's message."""
            return "".join(files[pid].with_suffix(s).read_text()[-4000:] for s in (".out", ".err"))

        def output(p: subprocess.Popen[str]) -> tuple[str, str]:
            p.wait(timeout=300)
            return files[p.pid].with_suffix(".out").read_text(), files[p.pid].with_suffix(".err").read_text()

        # Live logs: each replica's files land in the bucket at their arrival times while the leases join them, in
        # runs of 8 s until the faults are over (a loaded machine stretches each phase); no file shipped minutes late;
        # some queries never logged, so that clicks wait in the retry sets in the bucket.
        stop, failed = threading.Event(), []

        def write_logs() -> None:
            try:
                for seed in itertools.count(1):
                    if stop.is_set():
                        return
                    settings = GeneratorSettings(
                        events_per_s=150, dcs=DCS, lost_query_fraction=0.05, max_join_delay_s=20,
                        late_query_file_fraction=0.0, late_click_fraction=0.0, seed=seed,
                    )  # fmt: skip
                    now = int(time.time()) * US
                    generate(settings, logs.url, start_us=now, end_us=now + 8 * US, manifest=manifest, live=True)
            except BaseException as exc:
                failed.append(exc)

        # Leases as long as the test needs (an application's start and first batch on the cluster take 20-60 s):
        # each phase waits for batches committed, and SIGTERM ends them (the batch in flight commits).
        leases = [join(dc, "--run-for", "900") for dc in DCS]
        writer = threading.Thread(target=write_logs, daemon=True)
        try:
            # The logs start once both leases run on the cluster (each has printed its lease).
            deadline = time.monotonic() + 300
            while not all("lease epoch" in files[p.pid].with_suffix(".out").read_text() for p in leases):
                assert time.monotonic() < deadline and all(p.poll() is None for p in leases), "no lease started"
                time.sleep(0.2)
            writer.start()
            wait_for_batches(admin, {}, 2, leases, tail)
            # A worker lost with its executor (its whole process group: the machine gone), while a task runs.
            worker = cluster.processes[2]
            wait_until_busy(folder / "worker-2")
            os.killpg(worker["pid"], signal.SIGKILL)
            killed = list((folder / "worker-2").glob("app-*/*/stderr"))  # the lost executor's log
            before = committed(admin)
            time.sleep(2.0)
            back = spark_cluster.start(folder, env={**code, **s3_server.env()})
            assert back.master_url == cluster.master_url and back.processes[2]["pid"] != worker["pid"]
            wait_for_batches(admin, before, 2, leases, tail)
            # The S3 server SIGKILLed and started again on its endpoint, within the requests' retry budget (30 s).
            storage_server.stop(s3_server.folder, hard=True)
            time.sleep(3.0)
            assert storage_server.start(s3_server.folder).endpoint == s3_server.endpoint
            wait_for_batches(admin, committed(admin), 2, leases, tail)
            stop.set()
            writer.join(timeout=120)
            assert not writer.is_alive() and not failed, failed
            # The leases go on until every click of the logs is decided (its query joined, or its deadline passed),
            # as the audit sees the bucket; then SIGTERM (the batch in flight commits, the lease is released).
            deadline = time.monotonic() + 240
            while not audit(out, manifest=manifest, ran=list(DCS)).ok:
                assert time.monotonic() < deadline and all(p.poll() is None for p in leases), "never all decided"
                time.sleep(3.0)
            for lease in leases:
                lease.send_signal(signal.SIGTERM)
            results = [output(lease) for lease in leases]
        finally:
            stop.set()
            for lease in leases:
                if lease.poll() is None:
                    lease.kill()
        for lease, (said, err) in zip(leases, results, strict=True):
            assert lease.returncode == 143, said[-3000:] + err[-3000:]  # stopped by the signal, not failed
            assert "Traceback" not in said + err, err[-3000:]
        # The worker died under a running task (its executor's log says it started and never finished), which Spark
        # ran again once it was back: no batch failed.
        assert any(in_flight(log.read_text()) for log in killed), killed

        state = cluster.state()
        names = [a["name"] for a in state["completedapps"] + state["activeapps"]]
        assert sorted(set(names)) == ["photon-join-dc-a", "photon-join-dc-b"], names  # on the cluster, not local
        for n in (1, 2):  # executors ran on both workers, each in its own folder
            assert any((folder / f"worker-{n}").glob("app-*/*/stderr")), n
    finally:
        spark_cluster.stop(folder, hard=True)

    # The independent checker (it reads the bucket with deltalake and obstore, no code of the project) before the
    # verifier: the leases alone decided every click once, and published every batch they committed.
    verdict = checker.final(
        logs.url, out.url, lost=[], max_join_delay_s=20, margin_s=5.0, manifest_dir=manifest
    )  # fmt: skip
    assert verdict.ok and verdict.clicks > 0 and verdict.joined > 50, verdict.summary()
    verifier = {"main": login_as(admin, "photon_verifier")}
    report = verify_and_recover(verifier, out, logs, grace_s=1.0)
    assert report.fenced == [] and report.lost == 0 and report.rolled_forward == [], report
    audited = audit(out, manifest=manifest, ran=list(DCS))
    assert audited.ok and audited.lost == 0 and audited.duplicate_clicks == 0, audited.failures()
    # Read as any Delta reader would: no click joined twice, in one data center or across the two.
    ids = pa.concat_arrays(
        [
            bucket_table(s3_server, f"{out.url}/{dc}/joined").to_pyarrow_table(columns=["click_id"]).column(0)
            .combine_chunks()
            for dc in DCS
        ]
    )  # fmt: skip
    assert len(ids) == len(pc.unique(ids)) == audited.outcomes["joined"] > 50
    # Nothing of the pipelines on the drivers' side: their working folder (and temporary folder) stays empty.
    assert sorted(p.name for p in drivers.iterdir()) == []
    secret = s3_server.env()["AWS_SECRET_ACCESS_KEY"]
    assert secret not in "".join(s + e for s, e in results)
