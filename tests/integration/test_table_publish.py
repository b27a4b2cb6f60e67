"""The output tables are exactly once for every reader, at every snapshot: a batch is committed to a table once, keyed
by its Delta application transaction ``txn(photon/<pipeline>, batch)``, whoever publishes it and however many at once
(the lease that committed it, a lease start rolling it forward, the verifier, a zombie lease waking up). Checked
here by reading the tables with deltalake directly, not through photon's readers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from photon.logs.schemas import UNJOINABLE_SCHEMA
from photon.logs.tables import OutputTableError, ensure_tables, stage_rows
from photon.pg import autocommit
from photon.registry.admin import init_registry, status
from tests.integration.test_join_signals import ROOT, five_seconds_of_logs, join, lease_holder

pytestmark = pytest.mark.integration
US = 1_000_000

# One publisher, as a lease start and the verifier's roll-forward call it, started at an agreed instant.
PUBLISHER = """
import sys, time
from pathlib import Path
from photon.joiner.publish import publish_files
root, pipeline, first, last, epoch, at = sys.argv[1:]
for batch in range(int(first), int(last) + 1):
    time.sleep(max(0.0, float(at) + (batch - int(first)) * 0.25 - time.time()))
    print(batch, publish_files(Path(root), pipeline, batch, int(epoch))["unjoinable"], flush=True)
"""


def _commits_per_batch(path: Path) -> Counter[int]:
    """How many commits of the table carry each batch's transaction (its custom metadata names the batch)."""
    found: Counter[int] = Counter()
    for entry in sorted((path / "_delta_log").glob("*.json")):
        for line in entry.read_text().splitlines():
            action = json.loads(line)
            if "txn" in action:
                found[int(action["txn"]["version"])] += 1
    return found


def _stage(root: Path, batch: int, rows: int) -> None:
    """Stage batch ``batch`` (epoch 1) as its tasks would: unjoinable rows spread over two hours."""
    ts = 1_764_300_000 * US + batch * 1800 * US
    table = pa.table(
        {
            "click_id": [f"b{batch}-c{i}" for i in range(rows)],
            "query_id": [f"q{i}" for i in range(rows)],
            "ad_id": ["a"] * rows,
            "click_ts_us": [ts + i * 100 * US for i in range(rows)],
            "decided_at_us": [ts] * rows,
            "pipeline": ["dc-a"] * rows,
            "reason": ["test"] * rows,
        },
        schema=UNJOINABLE_SCHEMA,
    )
    stage_rows(root, "unjoinable", f"_staging/b{batch:010d}-e1", f"b{batch:010d}-e1-p0000", table, batch)


def test_three_processes_publishing_the_same_batches_at_once_commit_each_once(tmp_path: Path) -> None:
    root = tmp_path / "out" / "dc-a"
    ensure_tables(root)
    batches = 12
    for k in range(1, batches + 1):
        _stage(root, k, 50)
    at = time.time() + 3  # every process imports first, then all start together
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}"}
    args = [str(root), "dc-a", "1", str(batches), "1", str(at)]
    procs = [
        subprocess.Popen([sys.executable, "-c", PUBLISHER, *args], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outcomes = [p.communicate(timeout=300)[0].split("\n") for p in procs]
    assert all(p.returncode == 0 for p in procs), outcomes
    won = Counter(line.split()[0] for out in outcomes for line in out if line.endswith("committed"))
    assert sorted(won.values()) == [1] * batches, won  # each batch committed by exactly one of them
    table = DeltaTable(str(root / "unjoinable"))
    ids = table.to_pyarrow_table(columns=["click_id", "batch"])
    assert ids.num_rows == len(set(ids.column("click_id").to_pylist())) == batches * 50
    assert table.transaction_version("photon/dc-a") == batches
    assert _commits_per_batch(root / "unjoinable") == Counter(dict.fromkeys(range(1, batches + 1), 1))

    # A zombie waking up with batch 3's stage (restored here: its files are still in place) commits nothing.
    _stage(root, 3, 50)
    out = subprocess.run(
        [sys.executable, "-c", PUBLISHER, str(root), "dc-a", "3", "3", "1", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.split() == ["3", "already"], out.stdout + out.stderr
    assert DeltaTable(str(root / "unjoinable")).to_pyarrow_table(columns=["click_id"]).num_rows == batches * 50


def _published(dsn: str, batch: int) -> bool:
    with autocommit(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT published FROM photon.batches WHERE pipeline = 'dc-a' AND batch_seq = %s", (batch,))
        return bool(cur.fetchone()[0])


def test_a_batch_committed_but_not_published_is_published_once_by_two_leases_and_the_verifier_at_once(
    tmp_path: Path, make_db: Callable[[], str], login_as: Callable[[str, str], str]
) -> None:
    dsn = make_db()
    five_seconds_of_logs(dsn, tmp_path, malformed_fraction=0.02)  # some 30 quarantine rows in batch 1
    joiner = login_as(dsn, "photon_joiner")
    # The driver dies between the registry commit of batch 1 and its table commit.
    p = join(tmp_path, joiner, "--run-for", "120", crash_at="after_commit@1")
    out, _ = p.communicate(timeout=300)
    assert p.returncode == -9, out
    assert lease_holder(dsn)[1] == 1
    staged = list((tmp_path / "out" / "dc-a" / "joined").rglob("*.parquet"))
    assert staged and DeltaTable(str(tmp_path / "out" / "dc-a" / "joined")).version() == 0  # written, not committed

    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}",
        "PHOTON_REGISTRY_DSN": login_as(dsn, "photon_verifier"),
    }
    env.pop("PHOTON_CRASH_AT", None)
    verify = [
        sys.executable,
        "-m",
        "photon",
        "verify",
        "--logs",
        str(tmp_path / "logs"),
        "--out",
        str(tmp_path / "out"),
    ]

    # A stage that lists short of what batch 1 committed (an object store's listing missing the quarantine rows'
    # adds record, as one missed a stage's under a store SIGKILLed again and again): neither a lease start nor the
    # verifier publishes the batch without them; each fails in one line and leaves it unpublished.
    (aside,) = (tmp_path / "out" / "dc-a" / "_staging").glob("*/_adds/quarantine-*.json")
    held = aside.read_bytes()
    aside.unlink()
    short = {**env, "PHOTON_STORAGE_RETRY_S": "2"}
    checked = subprocess.run([*verify, "--grace", "0"], env=short, cwd=ROOT, capture_output=True, text=True)
    lease = join(tmp_path, joiner, "--until-caught-up", env={"PHOTON_STORAGE_RETRY_S": "2"})
    started = lease.communicate(timeout=300)[0]
    for what, rc, said in (
        ("verify", checked.returncode, checked.stdout + checked.stderr),
        ("join", lease.returncode, started),
    ):
        assert rc == 2 and re.search(r"the stage lists 0 quarantine rows of the [1-9]\d* its tasks", said), (what, said)
        assert "Traceback" not in said, (what, said)
    assert not _published(dsn, 1)
    assert DeltaTable(str(tmp_path / "out" / "dc-a" / "quarantine")).version() == 0
    aside.write_bytes(held)

    # Two lease processes and the verifier at once: each may roll batch 1 forward.
    procs = [join(tmp_path, joiner, "--until-caught-up", "--drain") for _ in range(2)]
    procs.append(subprocess.Popen([*verify, "--grace", "0"], env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True))
    outs = [q.communicate(timeout=300)[0] for q in procs]
    assert [q.returncode for q in procs[:2]].count(0) >= 1, outs

    joined = tmp_path / "out" / "dc-a" / "joined"
    table = DeltaTable(str(joined))
    ids = table.to_pyarrow_table(columns=["click_id"]).column("click_id").to_pylist()
    registered = sum(sh["rows"] for cfg in status({"main": dsn})["configs"] for sh in cfg["shards"])
    assert len(ids) == len(set(ids)), "a click twice in the joined table"
    assert Counter(_commits_per_batch(joined).values()) == {1: len(_commits_per_batch(joined))}
    assert 1 in _commits_per_batch(joined)
    assert len(ids) <= registered
    assert _published(dsn, 1)
    quarantined = DeltaTable(str(tmp_path / "out" / "dc-a" / "quarantine")).to_pyarrow_table(columns=["batch"])
    held_rows = sum(json.loads(f["stats"])["numRecords"] for f in json.loads(held)["files"])
    assert quarantined["batch"].to_pylist().count(1) == held_rows > 0


def test_an_out_holding_an_old_folder_layout_or_another_table_is_refused_in_one_line(
    tmp_path: Path, make_db: Callable[[], str], login_as: Callable[[str, str], str]
) -> None:
    old = tmp_path / "old" / "dc-a" / "joined"
    old.mkdir(parents=True)
    (old / "b0000000001-e1-p0000.parquet").write_bytes(b"PAR1")
    with pytest.raises(OutputTableError, match=r"not a Delta table but holds b0000000001-e1-p0000\.parquet"):
        ensure_tables(tmp_path / "old" / "dc-a")
    assert sorted(p.name for p in old.iterdir()) == ["b0000000001-e1-p0000.parquet"]  # untouched

    other = tmp_path / "other" / "dc-a"
    DeltaTable.create(str(other / "joined"), pa.schema([("x", pa.int64())]))
    with pytest.raises(OutputTableError, match="a Delta table but not photon's joined table"):
        ensure_tables(other)

    # The command line says it in one line and exits non-zero, before any lease is taken.
    dsn = make_db()
    init_registry({"main": dsn}, num_shards=1)
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}",
        "PHOTON_REGISTRY_DSN": login_as(dsn, "photon_joiner"),
    }
    logs = tmp_path / "logs" / "dc-a" / "clicks"
    logs.mkdir(parents=True)
    cmd = [sys.executable, "-m", "photon", "join", "--dc", "dc-a", "--logs", str(tmp_path / "logs")]
    res = subprocess.run(
        [*cmd, "--out", str(tmp_path / "old"), "--run-for", "1"], env=env, capture_output=True, text=True, timeout=300
    )
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode != 0 and "not a Delta table" in res.stderr, res.stdout + res.stderr
    assert not any("Traceback" in line for line in lines), res.stderr


def test_two_attempts_of_a_task_at_once_leave_every_published_file_whole(tmp_path: Path) -> None:
    """Spark may run two attempts of a task at once (a speculative one, or an orphan on an executor it took for lost):
    each writes its data files and then its adds record, and their rows may differ in bytes (a joined row's
    ``joined_at_us``). Under one name per task, a late adds record of one attempt described the other's file, of
    another size: the table's reader failed on it. Each call writes files of its own, which its record names: the
    staged rows all read back whichever record lands last; the other's files stay unnamed, for the vacuum."""
    from photon.joiner.publish import publish_files, stage_key
    from photon.logs.tables import adds_key

    root = tmp_path / "out" / "dc-a"
    ensure_tables(root)
    stage, name = stage_key(1, 1), "t0-lookup"
    ts = 1_764_300_000 * US

    def attempt(reason: str) -> bytes:
        n = 40
        rows = pa.table(
            {
                "click_id": [f"c{i}" for i in range(n)], "query_id": [f"q{i}" for i in range(n)],
                "ad_id": [f"a{i}" for i in range(n)], "click_ts_us": [ts + i * US for i in range(n)],
                "reason": [reason] * n, "decided_at_us": [ts] * n, "pipeline": ["dc-a"] * n,
            },
            schema=UNJOINABLE_SCHEMA,
        )  # fmt: skip
        assert stage_rows(root, "unjoinable", stage, name, rows, 1) == n
        return (root / adds_key(stage, "unjoinable", name)).read_bytes()

    first = attempt("too_late")
    attempt("query log line no longer readable " * 3)  # the second attempt: files of another size
    (root / adds_key(stage, "unjoinable", name)).write_bytes(first)  # the first attempt's record, put last
    assert publish_files(root, "dc-a", 1, 1, expect={"unjoinable": 40})["unjoinable"] == "committed"
    got = DeltaTable(str(root / "unjoinable")).to_pyarrow_table()
    assert sorted(got["click_id"].to_pylist()) == sorted(f"c{i}" for i in range(40))
    assert set(got["reason"].to_pylist()) == {"too_late"}


def test_a_stage_holding_more_rows_than_its_batch_committed_is_never_published(tmp_path: Path) -> None:
    """Found by review: of two tries of a task at once, the record landing last may be the try Spark did not accept,
    with other rows than the counts the batch committed (an orphan try registering after the verifier cleared the
    batch's token, an adapter failing in one try only). Fewer was refused; more was published: rows the batch never
    counted, a click possibly decided twice. The publish refuses in one line before any commit: neither table holds
    the batch (its joined rows, as counted, were committed before the refusal, the batch half published)."""
    from photon.joiner.publish import publish_files, stage_key
    from photon.logs.schemas import JOINED_SCHEMA
    from photon.logs.tables import StageExcessError

    root = tmp_path / "out" / "dc-a"
    ensure_tables(root)
    ts = 1_764_300_000 * US
    rows = pa.table(
        {
            "click_id": [f"c{i}" for i in range(45)], "query_id": ["q"] * 45, "ad_id": ["a"] * 45,
            "click_ts_us": [ts] * 45, "decided_at_us": [ts] * 45, "pipeline": ["dc-a"] * 45, "reason": ["r"] * 45,
        },
        schema=UNJOINABLE_SCHEMA,
    )  # fmt: skip
    stage_rows(root, "unjoinable", stage_key(1, 1), "t0", rows, 1)  # the try not accepted; the accepted one had 40
    joined = {f.name: [f"{f.name}-{i}" for i in range(2)] for f in JOINED_SCHEMA}
    joined |= {n: [ts] * 2 for n in ("click_ts_us", "query_ts_us", "joined_at_us", "bid_micros")}
    stage_rows(root, "joined", stage_key(1, 1), "t1", pa.table(joined | {"pipeline": ["dc-a"] * 2}), 1)
    with pytest.raises(StageExcessError, match="lists 45 unjoinable rows, more than the 40 its tasks reported"):
        publish_files(root, "dc-a", 1, 1, expect={"joined": 2, "unjoinable": 40, "quarantine": 0})
    assert [DeltaTable(str(root / k)).version() for k in ("joined", "unjoinable", "quarantine")] == [0, 0, 0]


def test_a_lease_start_checks_the_kinds_its_batch_committed_none_of(tmp_path: Path, servers: dict[str, str]) -> None:
    """Found by review: a lease start and the verifier read a batch's committed counts without its zeros, so a kind
    the batch committed none of went unchecked: the lease's own publish refused a stage holding 3 joined rows of a
    batch that committed 0 (a first try's record beside the rerun that gave those clicks up), and the next lease start
    published them, 3 clicks joined and unjoinable at once. The counts keep their zeros, and the publish refuses."""
    from photon.joiner.publish import publish_files, stage_key
    from photon.joiner.state import PipelineState
    from photon.logs.schemas import JOINED_SCHEMA
    from photon.logs.tables import StageExcessError

    state = PipelineState(servers["main"], "dc-a")
    lease = state.start_lease()
    metrics: dict[str, float] = {"started_at_us": 1, "duration_s": 0.1, "query_files": 0, "click_files": 1}
    metrics |= dict.fromkeys(("queries", "retries_in", "prefiltered", "won_again", "wasted", "retried"), 0)
    metrics |= dict.fromkeys(("cache_hits", "cache_lookups", "registry_txns", "registry_rows", "registry_retries"), 0)
    metrics |= {"clicks": 3, "joined": 0, "unjoinable": 3, "quarantined": 0}
    assert state.commit(lease, 1, [("clicks", "x.jsonl")], metrics)
    rows = next(b for b in state.open_batches() if b.batch == 1).rows
    assert rows == {"joined": 0, "unjoinable": 3, "quarantine": 0}
    root = tmp_path / "out" / "dc-a"
    ensure_tables(root)
    joined = {f.name: [f"{f.name}-{i}" for i in range(3)] for f in JOINED_SCHEMA}
    joined |= {n: [1] * 3 for n in ("click_ts_us", "query_ts_us", "joined_at_us", "bid_micros")}
    stage_rows(root, "joined", stage_key(1, lease.epoch), "t0", pa.table(joined | {"pipeline": ["dc-a"] * 3}), 1)
    with pytest.raises(StageExcessError, match="lists 3 joined rows, more than the 0 its tasks reported"):
        publish_files(root, "dc-a", 1, lease.epoch, expect=rows)
    assert DeltaTable(str(root / "joined")).version() == 0


def test_the_verifier_never_rolls_forward_a_batch_staging_more_joined_rows_than_it_committed(tmp_path: Path) -> None:
    """The verifier's roll-forward checks a dead pipeline's committed, unpublished batch against its stage: more joined
    rows than the batch committed (a record of a try Spark did not accept) is refused, and said so, not taken for
    missing output; the table unchanged."""
    from photon.joiner.publish import stage_key
    from photon.logs.schemas import JOINED_SCHEMA
    from photon.recovery.verify import EvidenceMissingError, _Batch, _check_staged
    from photon.storage import LocalStore

    root = tmp_path / "out" / "dc-a"
    ensure_tables(root)
    joined = {f.name: [f"{f.name}-{i}" for i in range(3)] for f in JOINED_SCHEMA}
    joined |= {n: [1] * 3 for n in ("click_ts_us", "query_ts_us", "joined_at_us", "bid_micros")}
    stage_rows(root, "joined", stage_key(1, 1), "t0", pa.table(joined | {"pipeline": ["dc-a"] * 3}), 1)
    with pytest.raises(EvidenceMissingError, match=r"committed 2 joined rows .* stages 3, more .*: not rolled forward"):
        _check_staged(LocalStore(root), "dc-a", 1, _Batch(1, 1, False, 2, {"joined": 2}))
    assert DeltaTable(str(root / "joined")).version() == 0
