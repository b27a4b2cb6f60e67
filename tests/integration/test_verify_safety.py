"""The verifier on the bad days, one deterministic test per failure found against it (issue 10): a view that goes
stale while a joiner commits, a data center lost for good, a wrong output folder, roles that claim least privilege,
an idle joiner taken for a gone one. Every component runs as a login holding only its own role; the joiners are real
(in-process on the shared Spark session, or a real process killed with SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg2
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from photon.joiner.common import JoinSettings
from photon.joiner.lease import Joiner
from photon.joiner.state import FencedError
from photon.logs.parse import parse_file
from photon.pg import RegistryUnavailableError, autocommit
from photon.recovery import verify
from photon.recovery.verify import EvidenceMissingError, verify_and_recover
from photon.registry.admin import init_registry
from photon.registry.client import IdRegistry
from photon.tools.audit import audit
from photon.tools.generator import GeneratorSettings, generate

pytestmark = pytest.mark.integration
US = 1_000_000
ROOT = Path(__file__).resolve().parents[2]
SETTINGS = JoinSettings(max_click_files=4, trigger_interval_s=0.1, heartbeat_s=0.2)


@dataclass
class Roles:
    owner: str  # the registry's owner: init and test inspection only
    joiner: dict[str, str]
    verifier: dict[str, str]


@pytest.fixture
def roles(make_db: Callable[[], str], login_as: Callable[[str, str], str]) -> Roles:
    dsn = make_db()
    init_registry({"main": dsn}, num_shards=4)
    return Roles(dsn, {"main": login_as(dsn, "photon_joiner")}, {"main": login_as(dsn, "photon_verifier")})


def make_logs(root: Path, dcs: tuple[str, ...], seconds: float = 12, rate: float = 600) -> Path:
    start = (int(time.time()) - 600) * US
    settings = GeneratorSettings(events_per_s=rate, dcs=dcs, malformed_fraction=0.0, late_click_fraction=0.0)
    generate(settings, root, start_us=start, end_us=start + int(seconds * US))
    return root


def tokened(dsn: str) -> int:
    with autocommit(dsn) as conn, conn.cursor() as cur:
        total = 0
        for shard in range(4):
            cur.execute(f"SELECT count(*) FROM photon.ids_c1_s{shard} WHERE token IS NOT NULL")
            total += cur.fetchone()[0]
    return total


def recovered_files(logs: Path) -> list[Path]:
    return sorted(logs.glob("*/clicks/*/*/recovered-*.jsonl"))  # closed, in an arrival partition: readable


def click_ids(logs: Path, dc: str, names: list[str]) -> list[str]:
    ids: list[str] = []
    for n in names:
        path = logs / dc / "clicks" / n
        ids += parse_file(n, path.read_bytes(), "clicks")[0]["click_id"].to_pylist()
    return ids


def drain_and_audit(roles: Roles, logs: Path, out: Path, spark: Any, dcs: tuple[str, ...]) -> Any:
    """What an operator does once the input stops: every live pipeline drains, the verifier runs, they drain again;
    then the independent audit."""
    for _ in range(2):
        for dc in dcs:
            Joiner(dc, logs, out, roles.joiner, spark, SETTINGS).run(until_caught_up=True, drain=True)
        verify_and_recover(roles.verifier, out, logs, grace_s=0.5)
    return audit(out, manifest=logs / "_manifest")


# -- 1. the verifier's view goes stale -----------------------------------------------------------------------------


@pytest.mark.parametrize("moment", ["after_read", "before_fence", "before_delete"])
@pytest.mark.parametrize("who", ["idle_lease", "late_new_lease"])
def test_a_batch_committed_while_the_verifier_runs_is_never_duplicated(
    tmp_path: Path, roles: Roles, spark: Any, monkeypatch: pytest.MonkeyPatch, moment: str, who: str
) -> None:
    """Batch 2 is registered and not committed; the pipeline is idle past the grace period. While the verifier runs,
    batch 2 commits and publishes: by the same lease waking up (an idle replica), or by a new lease that started late
    after a crash. ``after_read``: right after the verifier read the pipelines and the registry; ``before_fence``:
    as it fences; ``before_delete``: after it read every piece of evidence, just before it deletes."""
    logs = make_logs(tmp_path / "logs", ("dc-a",))
    out = tmp_path / "out"
    first = Joiner("dc-a", logs, out, roles.joiner, spark, SETTINGS)
    first.run(max_batches=1)
    q_files, c_files = first.discovery.new_files()
    assert first.lease is not None and c_files
    with IdRegistry(roles.joiner) as reg:  # batch 2's registration, as the lease's executors do it
        reg.register(click_ids(logs, "dc-a", c_files), first.lease.token(2))
    time.sleep(1.0)  # nothing heartbeats outside a run: idle past the grace period

    def commit_batch_2() -> None:
        try:
            if who == "idle_lease":
                first.batches.run_batch(first.lease, 2, q_files, c_files)
            else:
                Joiner("dc-a", logs, out, roles.joiner, spark, SETTINGS).run(max_batches=1)
        except FencedError:
            pass  # the verifier fenced first: the batch is refused, and its clicks are the verifier's to recover

    target = {"after_read": "_tokened_rows", "before_fence": "_fence", "before_delete": "data_center_of"}[moment]
    original = getattr(verify, target)

    def interleaved(*args: Any) -> Any:
        if moment == "before_fence":
            commit_batch_2()
            return original(*args)
        result = original(*args)
        commit_batch_2()
        return result

    monkeypatch.setattr(verify, target, interleaved)
    verify_and_recover(roles.verifier, out, logs, grace_s=0.5)
    monkeypatch.undo()
    report = drain_and_audit(roles, logs, out, spark, ("dc-a",))
    assert report.duplicate_clicks == 0, report.samples["duplicates"]
    assert report.ok, report.failures()
    assert tokened(roles.owner) == 0


# -- 2. a data center lost for good ----------------------------------------------------------------------------------


@pytest.mark.parametrize("crash", ["after_register", "after_commit"])
def test_the_surviving_data_center_finishes_the_work_of_a_lost_one(
    tmp_path: Path, roles: Roles, spark: Any, crash: str, warm_spark: Path
) -> None:
    """dc-a's joiner process is killed in batch 2 (after registering, or after committing but before publishing) and
    never comes back. dc-b's pre-filter drops the clicks dc-a holds; the verifier, as its own role, fences dc-a or
    rolls its committed batch forward, and hands the rest to dc-b. In the end every click has one outcome."""
    logs = make_logs(tmp_path / "logs", ("dc-a", "dc-b"))
    out = tmp_path / "out"
    env = {**os.environ, "PHOTON_REGISTRY_DSN": roles.joiner["main"], "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}"}
    env |= {"PHOTON_TEST_MAX_CLICK_FILES": "4", "PHOTON_CRASH_AT": f"{crash}@2"}
    cmd = [sys.executable, "-m", "photon", "join", "--dc", "dc-a", "--logs", str(logs), "--out", str(out)]
    cmd += ["--until-caught-up", "--trigger-interval", "0.1", "--connect"]
    env["PHOTON_HOME"] = str(warm_spark)  # its lease on the warm server, as under Airflow
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stdout[-3000:] + proc.stderr[-3000:]
    Joiner("dc-b", logs, out, roles.joiner, spark, SETTINGS).run(until_caught_up=True, drain=True)
    before = audit(out, manifest=logs / "_manifest")
    assert before.lost > 0 and before.duplicate_clicks == 0  # dc-b dropped what dc-a holds: lost until recovered

    time.sleep(1.0)
    report = verify_and_recover(roles.verifier, out, logs, grace_s=0.5)
    if crash == "after_register":
        assert report.fenced == ["dc-a"] and report.recovered == before.lost and report.not_in_logs == 0
        assert {p.parents[3].name for p in recovered_files(logs)} == {"dc-a", "dc-b"}  # <dc>/clicks/<day>/<minute>
    else:
        assert report.rolled_forward == ["dc-a/2"] and report.fenced == [] and report.lost == 0
    Joiner("dc-b", logs, out, roles.joiner, spark, SETTINGS).run(until_caught_up=True, drain=True)
    verify_and_recover(roles.verifier, out, logs, grace_s=0.5)
    after = audit(out, manifest=logs / "_manifest")
    assert after.ok, after.failures()
    assert after.lost == 0 and after.duplicate_clicks == 0 and after.outcomes["none"] == 0
    assert tokened(roles.owner) == 0


# -- 3. missing evidence -----------------------------------------------------------------------------------------------


def test_missing_output_stops_the_verifier_and_changes_nothing(tmp_path: Path, roles: Roles, spark: Any) -> None:
    logs = make_logs(tmp_path / "logs", ("dc-a",))
    out = tmp_path / "out"
    # Nothing registered yet (a fresh deployment, no output folder): nothing to judge, nothing missing.
    assert verify_and_recover(roles.verifier, out, logs, grace_s=0.0).checked == 0
    Joiner("dc-a", logs, out, roles.joiner, spark, SETTINGS).run(until_caught_up=True, drain=True)
    held = tokened(roles.owner)
    assert held > 0
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "dc-a" / "joined").mkdir(parents=True)  # a mount point whose volume is missing
    (empty / "dc-a" / "_pipeline.json").write_text('{"pipeline": "dc-a", "dc": "dc-a"}\n')
    for wrong in (tmp_path / "typo", tmp_path / "elsewhere", empty):
        (tmp_path / "elsewhere").mkdir(exist_ok=True)
        with pytest.raises(EvidenceMissingError, match="nothing was changed"):
            verify_and_recover(roles.verifier, wrong, logs, grace_s=0.0)
    # One output file deleted by hand: the batch's files no longer hold what it committed.
    victim = sorted((out / "dc-a" / "joined").glob("hour=*/*.parquet"))[0]  # committed: nothing else was written
    kept = pq.read_table(victim)
    victim.unlink()
    with pytest.raises(EvidenceMissingError, match=victim.name.rsplit("-", 1)[0]):
        verify_and_recover(roles.verifier, out, logs, grace_s=0.0)
    assert tokened(roles.owner) == held and not recovered_files(logs)
    pq.write_table(kept, victim)
    report = verify_and_recover(roles.verifier, out, logs, grace_s=0.0)
    assert report.committed == held and report.lost == 0 and tokened(roles.owner) == 0


def test_a_pass_that_stopped_leaves_the_lock_free_for_the_next_one(tmp_path: Path, roles: Roles, spark: Any) -> None:
    """Found by CI: a pass that raised (missing evidence) or returned early (a dry run) left its advisory lock to the
    server's backend, which lets it go only once it has noticed the closed connection; a pass started at once after
    it (an operator's second try, an Airflow retry) was refused as "another verifier pass is running"."""
    logs = make_logs(tmp_path / "logs", ("dc-a",), seconds=2, rate=100)
    out = tmp_path / "out"
    Joiner("dc-a", logs, out, roles.joiner, spark, SETTINGS).run(until_caught_up=True, drain=True)
    held = tokened(roles.owner)
    assert held > 0
    with autocommit(roles.owner) as conn, conn.cursor() as cur:
        for i in range(100):
            assert verify_and_recover(roles.verifier, out, logs, grace_s=0.0, dry_run=True).checked == held
            assert lock_is_free(cur), f"try {i}: a dry run returned with its lock still held"
            with pytest.raises(EvidenceMissingError, match="nothing was changed"):
                verify_and_recover(roles.verifier, tmp_path / f"typo{i}", logs, grace_s=0.0)
            assert lock_is_free(cur), f"try {i}: a refused pass returned with its lock still held"


def lock_is_free(cur: Any) -> bool:
    """The verifier's lock, tried from another session (advisory locks are per database) and let go at once."""
    cur.execute("SELECT pg_try_advisory_lock(%s)", (verify._LOCK_ID,))
    free = bool(cur.fetchone()[0])
    if free:
        cur.execute("SELECT pg_advisory_unlock(%s)", (verify._LOCK_ID,))
    return free


@pytest.mark.parametrize("dry_run", [True, False])
def test_a_second_pass_is_refused_while_a_pass_runs(
    tmp_path: Path, roles: Roles, monkeypatch: pytest.MonkeyPatch, dry_run: bool
) -> None:
    """Found by review: the test above holds if the lock were never taken. A pass started inside another (at its
    step 2, as a second Airflow task or an operator would, on a connection of its own) is refused and changes
    nothing; the first goes on."""
    logs = make_logs(tmp_path / "logs", ("dc-a",), seconds=1, rate=50)
    real, inner = verify._tokened_rows, []

    def with_a_second_pass(servers: Any) -> Any:
        with pytest.raises(verify.VerifierBusyError, match="nothing was changed"):
            verify_and_recover(roles.verifier, tmp_path / "out", logs, grace_s=0.0, dry_run=dry_run)
        inner.append(True)
        return real(servers)

    monkeypatch.setattr(verify, "_tokened_rows", with_a_second_pass)
    assert verify_and_recover(roles.verifier, tmp_path / "out", logs, grace_s=0.0, dry_run=dry_run).checked == 0
    assert inner == [True]
    with autocommit(roles.owner) as conn, conn.cursor() as cur:
        assert lock_is_free(cur)


def test_a_pass_that_loses_its_server_mid_pass_does_not_wait_on_it(
    tmp_path: Path, roles: Roles, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review of the first fix: a pass leaving on a registry error let go of its lock with one more round
    trip on the lock's session; on a server that has stopped answering that waits forever (no client timeout), so
    the pass never raised and never failed over. Here the lock session's backend is stopped (SIGSTOP) and the next
    step finds the registry unreachable: the pass must give up within its failover budget, not hang."""
    logs = make_logs(tmp_path / "logs", ("dc-a",), seconds=1, rate=50)
    stopped: list[int] = []

    def server_stops_answering(servers: Any) -> Any:
        with autocommit(roles.owner) as conn, conn.cursor() as cur:
            cur.execute("SELECT pid FROM pg_stat_activity WHERE application_name = 'photon-verify'")
            stopped.extend(pid for (pid,) in cur.fetchall())
        assert stopped, "no verifier session found"
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)  # the server's process for this session, on this machine
        raise RegistryUnavailableError("cannot reach registry server (the test stopped it)")

    monkeypatch.setattr(verify, "_tokened_rows", server_stops_answering)
    monkeypatch.setenv("PHOTON_REGISTRY_FAILOVER_S", "3")
    result: list[BaseException] = []
    worker = threading.Thread(
        target=lambda: result.append(_raised(lambda: verify_and_recover(roles.verifier, tmp_path / "out", logs))),
        daemon=True,
    )
    try:
        worker.start()
        worker.join(timeout=60)
        hung = worker.is_alive()
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        worker.join(timeout=60)
    assert not hung, "the pass waited on a server that had stopped answering"
    # Retried within the budget: the stopped session still held the lock, so the retry is refused as busy.
    assert result and isinstance(result[0], (RegistryUnavailableError, verify.VerifierBusyError)), result


def test_a_pass_whose_lock_session_died_is_run_again(
    tmp_path: Path, roles: Roles, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review of the first fix: the lock's session lost after its last use (another pass could take the
    lock and run alongside from then on) must not end the pass as if it had held the lock throughout. Letting go
    at the end fails on the lost session, and the pass is run again from step 1, as before that fix."""
    logs = make_logs(tmp_path / "logs", ("dc-a",), seconds=1, rate=50)
    real_clear, real_pass, passes = verify._clear_tokens, verify._verify_pass, []

    def session_lost(servers: Any, committed: Any) -> None:
        real_clear(servers, committed)
        if len(passes) == 1:
            with autocommit(roles.owner) as conn, conn.cursor() as cur:
                cur.execute(
                    "SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity"
                    " WHERE application_name = 'photon-verify'"
                )

    def counted(*args: Any) -> Any:
        passes.append(True)
        return real_pass(*args)

    monkeypatch.setattr(verify, "_clear_tokens", session_lost)
    monkeypatch.setattr(verify, "_verify_pass", counted)
    assert verify_and_recover(roles.verifier, tmp_path / "out", logs, grace_s=0.0).checked == 0
    assert len(passes) == 2
    with autocommit(roles.owner) as conn, conn.cursor() as cur:
        assert lock_is_free(cur)


def _raised(fn: Callable[[], Any]) -> BaseException:
    try:
        fn()
    except BaseException as exc:  # the test judges what came out
        return exc
    raise AssertionError("the pass returned")


# -- 4. least privilege ----------------------------------------------------------------------------------------------


def test_a_joiner_can_only_move_its_pipeline_forward(tmp_path: Path, roles: Roles, spark: Any) -> None:
    logs = make_logs(tmp_path / "logs", ("dc-a",), seconds=4)
    Joiner("dc-a", logs, tmp_path / "out", roles.joiner, spark, SETTINGS).run(until_caught_up=True)
    refused = [
        "UPDATE photon.pipelines SET epoch = epoch - 1",
        "UPDATE photon.pipelines SET last_batch = last_batch - 1",
        "UPDATE photon.pipelines SET last_batch = last_batch + 2",
        "UPDATE photon.pipelines SET epoch = epoch + 1, last_batch = last_batch + 1",
        "UPDATE photon.pipelines SET owner_id = owner_id + 1, epoch = epoch + 1",
        "UPDATE photon.batches SET published = false",
        "UPDATE photon.batches SET epoch = epoch + 1",
        "DELETE FROM photon.batches",
        "DELETE FROM photon.consumed_files",
        "UPDATE photon.batch_metrics SET joined = 0",
        "UPDATE photon.owners SET retired_at = NULL",
        "SELECT * FROM photon.fence_pipeline('dc-a', 1, 1, 0)",
    ]
    for statement in refused:
        with autocommit(roles.joiner["main"]) as conn, conn.cursor() as cur, pytest.raises(psycopg2.Error):
            cur.execute(statement)
    for statement in (
        "UPDATE photon.pipelines SET epoch = epoch + 1",
        "INSERT INTO photon.ids_c1_s0 VALUES (1, 1, 1)",  # it deletes and clears rows, it never registers
        "UPDATE photon.batches SET published = false",
    ):
        with autocommit(roles.verifier["main"]) as conn, conn.cursor() as cur, pytest.raises(psycopg2.Error):
            cur.execute(statement)
    with autocommit(roles.joiner["main"]) as conn, conn.cursor() as cur:
        cur.execute("UPDATE photon.pipelines SET epoch = epoch + 1 RETURNING epoch")  # what a new lease does
        assert cur.fetchone()[0] > 1


# -- 5. a live joiner is never fenced ---------------------------------------------------------------------------------


def test_an_idle_live_joiner_heartbeats_and_is_not_fenced(tmp_path: Path, roles: Roles, spark: Any) -> None:
    logs, out = tmp_path / "logs", tmp_path / "out"
    (logs / "dc-a" / "clicks").mkdir(parents=True)
    joiner = Joiner("dc-a", logs, out, roles.joiner, spark, SETTINGS)
    lease = joiner.start()
    now = int(time.time() * US)
    with IdRegistry(roles.joiner) as reg:  # a batch in flight: its clicks registered, its files not yet committed
        reg.register([f"10.0.0.1-7-{now - i}" for i in range(5)], lease.token(lease.last_batch + 1))
    thread = threading.Thread(target=joiner.run, kwargs={"run_for_s": 4.0})
    thread.start()
    time.sleep(2.0)  # ten heartbeats, no batch: idle the whole time
    report = verify_and_recover(roles.verifier, out, logs, grace_s=1.0)
    thread.join()
    assert report.fenced == [] and report.in_flight == 5 and report.lost == 0
    assert tokened(roles.owner) == 5


# -- found by a second pair of eyes (an adversarial review of the first version) ---------------------------------------


def strand_batch_2(logs: Path, out: Path, roles: Roles, spark: Any) -> list[str]:
    """dc-a commits batch 1, registers batch 2 (as its executors do) and dies; returns batch 2's click ids."""
    a = Joiner("dc-a", logs, out, roles.joiner, spark, SETTINGS)
    a.run(max_batches=1)
    _, c_files = a.discovery.new_files()
    assert a.lease is not None and c_files
    stranded = click_ids(logs, "dc-a", c_files)
    with IdRegistry(roles.joiner) as reg:
        reg.register(stranded, a.lease.token(2))
    return stranded


def pipeline_row(dsn: str, name: str) -> tuple[Any, ...]:
    with autocommit(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT epoch, owner_id FROM photon.pipelines WHERE pipeline = %s", (name,))
        return tuple(cur.fetchone())


def test_a_pass_that_lost_its_lock_never_publishes_another_pass_s_intent_early(
    tmp_path: Path, roles: Roles, spark: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """V1's lock session is cut (a backend restart, a pooler) and V1 does not notice; V2 takes the lock, fences dc-a,
    writes its intent and is about to delete. If V1 made V2's intent readable now, dc-b's pre-filter would drop the
    clicks (still held by dc-a's retired owner) and V2's delete would leave them nowhere: lost for good. (The
    adversary's reproduction lost 35 of 35 on 4130384.)"""
    logs = make_logs(tmp_path / "logs", ("dc-a", "dc-b"))
    out = tmp_path / "out"
    stranded = strand_batch_2(logs, out, roles, spark)
    Joiner("dc-b", logs, out, roles.joiner, spark, SETTINGS).run(until_caught_up=True, drain=True)
    time.sleep(1.0)
    v2_wrote, v1_done = threading.Event(), threading.Event()
    original_leftovers, original_delete = verify._publish_leftover_intents, verify._delete

    def leftovers(*args: Any) -> None:
        if threading.current_thread().name == "V1":
            with autocommit(roles.owner) as conn, conn.cursor() as cur:  # V1's lock session dies
                # (waiting up to 10 s for it to exit: V2 must find the lock free, not still held by a dying backend)
                cur.execute(
                    "SELECT pg_terminate_backend(pid, 10000) FROM pg_locks WHERE locktype = 'advisory' AND granted"
                )
            v2.start()
            assert v2_wrote.wait(120)
        original_leftovers(*args)

    def delete(*args: Any) -> None:
        if threading.current_thread().name == "V2":
            v2_wrote.set()
            assert v1_done.wait(120)
            assert not recovered_files(logs), "another pass's intent became readable before its delete"
        original_delete(*args)

    monkeypatch.setattr(verify, "_publish_leftover_intents", leftovers)
    monkeypatch.setattr(verify, "_delete", delete)
    errors: dict[str, BaseException] = {}

    def run(name: str) -> None:
        try:
            verify_and_recover(roles.verifier, out, logs, grace_s=0.5)
        except BaseException as exc:  # V1 finds its session gone
            errors[name] = exc
        finally:
            if name == "V1":
                v1_done.set()

    v1, v2 = (threading.Thread(target=run, args=(n,), name=n) for n in ("V1", "V2"))
    v1.start()
    v1.join(180)
    v2.join(180)
    assert "V2" not in errors, errors
    monkeypatch.undo()
    report = drain_and_audit(roles, logs, out, spark, ("dc-b",))
    assert report.duplicate_clicks == 0 and report.ok, report.failures()
    assert set(stranded) <= set(joined_ids_of(out))


def joined_ids_of(out: Path) -> list[str]:
    return [
        c
        for p in sorted(out.glob("[!_]*/joined"))
        for c in DeltaTable(str(p)).to_pyarrow_table()["click_id"].to_pylist()
    ]


def test_missing_evidence_is_found_before_the_fence(tmp_path: Path, roles: Roles, spark: Any) -> None:
    """dc-a is gone with rows in flight, and one of dc-b's published files is missing: the verifier stops before it
    fences anything (it said "nothing was changed" and fenced dc-a first)."""
    logs = make_logs(tmp_path / "logs", ("dc-a", "dc-b"))
    out = tmp_path / "out"
    strand_batch_2(logs, out, roles, spark)
    Joiner("dc-b", logs, out, roles.joiner, spark, SETTINGS).run(max_batches=4)  # tokens not cleared yet
    sorted((out / "dc-b" / "joined").glob("hour=*/*.parquet"))[0].unlink()
    time.sleep(1.0)
    before = pipeline_row(roles.owner, "dc-a")
    with pytest.raises(EvidenceMissingError, match="nothing was changed"):
        verify_and_recover(roles.verifier, out, logs, grace_s=0.5)
    assert pipeline_row(roles.owner, "dc-a") == before


def test_a_lagging_survivor_joins_recovered_clicks_with_their_recovered_queries(
    tmp_path: Path, roles: Roles, spark: Any
) -> None:
    """dc-a joined its clicks' queries in time and is gone; dc-b's query replica lags far behind (its query files
    are not there yet). The verifier re-dispatches the stranded clicks with their queries, so dc-b joins them at once
    instead of giving up on them after the maximum join delay."""
    logs = make_logs(tmp_path / "logs", ("dc-a", "dc-b"))
    out = tmp_path / "out"
    held = tmp_path / "held"
    (logs / "dc-b" / "queries").rename(held)  # dc-b's query replica has received nothing yet
    (logs / "dc-b" / "queries").mkdir()
    stranded = strand_batch_2(logs, out, roles, spark)
    quick = JoinSettings(max_click_files=4, trigger_interval_s=0.1, heartbeat_s=0.2, max_join_delay_s=3.0)
    time.sleep(1.0)
    report = verify_and_recover(roles.verifier, out, logs, grace_s=0.5)
    assert report.fenced == ["dc-a"] and report.recovered == len(stranded)
    Joiner("dc-b", logs, out, roles.joiner, spark, quick).run(until_caught_up=True, drain=True)
    joined = joined_ids_of(out)
    assert sorted(c for c in joined if c in set(stranded)) == sorted(set(stranded))
    assert len(joined) == len(set(joined))


def test_a_joiner_login_cannot_forge_a_commit_or_share_an_owner(tmp_path: Path, roles: Roles) -> None:
    """The triggers of 0005 guard UPDATEs; INSERTs must follow from a commit too. (A forged published batch made the
    verifier recover a live lease's in-flight clicks and blocked its real commit forever; a pipeline sharing an
    owner would share its tokens.)"""
    from photon.joiner.state import PipelineState

    state = PipelineState(roles.joiner["main"], "dc-a")
    lease = state.start_lease()
    forged = [
        (
            "INSERT INTO photon.batches (pipeline, batch_seq, epoch, owner_id, published) VALUES ('dc-a', 1, %s, %s,"
            " true)",
            (lease.epoch, lease.owner_id),
        ),
        (
            "INSERT INTO photon.batches (pipeline, batch_seq, epoch, owner_id) VALUES ('dc-a', 1, %s, %s)",
            (lease.epoch, lease.owner_id),
        ),
        ("INSERT INTO photon.consumed_files VALUES ('dc-a', 'clicks', 'x.jsonl', 1)", ()),
        ("INSERT INTO photon.pipelines (pipeline, owner_id) VALUES ('evil', %s)", (lease.owner_id,)),
        ("INSERT INTO photon.pipelines (pipeline, owner_id, epoch) VALUES ('dc-z', %s, 7)", (lease.owner_id,)),
    ]
    for statement, args in forged:
        with autocommit(roles.joiner["main"]) as conn, conn.cursor() as cur, pytest.raises(psycopg2.Error):
            cur.execute(statement, args)
    assert state.commit(lease, 1, [("clicks", "x.jsonl")], None)  # the real commit goes through
