"""Review of the logs-on-a-store change (issue 35): the joiner's reads through ``photon.storage`` keep every rule a
folder had, and an object store's failures fail the work instead of deciding clicks on them. Each test failed on the
commit that moved the reads. Last, a store that could not carry the output's commits (put-if-absent ignored) is
refused."""

from __future__ import annotations

import json
import mmap as real_mmap
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import photon.storage as storage
from photon.joiner import query_index
from photon.joiner.common import JoinSettings
from photon.joiner.discovery import Discovery
from photon.joiner.eventstore import EventStoreCache, LookupStats
from photon.registry.clock import ServerClock
from photon.storage import LocalStore, StorageError

PART = "20250101/0000"  # sealed long ago


def discovery(root: Path) -> Discovery:
    return Discovery(root, "dc-a", "dc-a", JoinSettings(parallelism=1), ServerClock.assumed())


def index_rows(n: int, length: int) -> pa.Table:
    return pa.table(
        {
            "file": pa.array(["q.jsonl"] * n).dictionary_encode(),
            "offset": pa.array([i * (length + 1) for i in range(n)], pa.int64()),
            "length": pa.array([length] * n, pa.int64()),
            "query_id": pa.array(["x"] * n),
            "ts_us": pa.array([1] * n, pa.int64()),
        }
    )


class FailingStore(LocalStore):
    """An object store (atomic puts) whose reads fail as a throttled or unreachable S3 endpoint's do."""

    atomic = True

    def get(self, key: str) -> bytes:
        raise StorageError(f"s3://b/p: {key}: Generic S3 error: HTTP 503 SlowDown")

    def get_ranges(self, key: str, ranges: Any) -> list[bytes]:
        raise StorageError(f"s3://b/p: {key}: Generic S3 error: error sending request (connection reset)")


def test_log_files_named_with_a_backslash_or_an_invisible_character_are_read(tmp_path: Path) -> None:
    """A name ``put`` would refuse (backslash, zero-width space) was refused on read too: held as "cannot be read
    yet" at every batch, the listing mark stuck at its partition for good."""
    for name in ("ok.jsonl", "a\\b.jsonl", "zero\u200bwidth.jsonl"):
        path = tmp_path / "dc-a" / "clicks" / PART / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b'{"a": 1}\n')
    d = discovery(tmp_path)
    _, clicks = d.new_files()
    assert sorted(clicks) == sorted(f"{PART}/{n}" for n in ("ok.jsonl", "a\\b.jsonl", "zero\u200bwidth.jsonl"))
    assert d.next_marks["clicks"] != PART


def test_a_consumed_file_replaced_by_a_named_pipe_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "dc-a" / "clicks" / PART / "a.jsonl"
    path.parent.mkdir(parents=True)
    path.write_bytes(b'{"a": 1}\n')
    d = discovery(tmp_path)
    d.new_files()
    e = LocalStore.entry_of(f"{PART}/a.jsonl", os.stat(path))
    d.committed([("clicks", e.key)], {("clicks", e.key): (e.size, e.etag, e.inode)}, 0, dict(d.marks))
    d.new_files()
    assert d.changed == []  # unchanged: nothing to say
    path.unlink()
    os.mkfifo(path)
    d.new_files()
    assert [c["file"] for c in d.changed] == [e.key] and "closed file changed" in d.changed[0]["reason"]


def test_an_object_stores_failure_fails_the_lookup_never_a_miss(tmp_path: Path) -> None:
    """A miss decides clicks (unjoinable at their deadline): only a log that is gone may cause one. A store that
    failed must fail the batch, which runs again."""
    cache = EventStoreCache(tmp_path / "es", FailingStore(tmp_path), 4)
    with pytest.raises(StorageError, match="connection reset"):
        cache._read_lines(index_rows(1, 8), LookupStats())


def test_an_object_stores_failure_while_indexing_marks_no_partition_indexed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A partition with its done-marker is never parsed again: one marked after a failed read would miss its
    queries for good."""
    logs, root = tmp_path / "logs", tmp_path / "index"
    q = {"query_id": "127.0.0.1-1-1735689600000000", "ts_us": 1735689600000000, "user_id": "u", "query_text": "t"}
    q |= {"country": "DE", "ads": [{"ad_id": "a1", "advertiser_id": "adv1", "bid_micros": 1}]}
    (logs / PART).mkdir(parents=True)
    (logs / PART / "a.jsonl").write_bytes(json.dumps(q).encode() + b"\n")
    monkeypatch.setattr(query_index, "cached_store", FailingStore)
    run = query_index._index_task(str(logs), str(root), [(PART, [f"{PART}/a.jsonl"])], 60, q["ts_us"] + 10**8, 300)
    with pytest.raises(StorageError, match="SlowDown"):
        list(run(iter([pa.RecordBatch.from_pydict({"id": [0]})])))
    assert query_index.indexed(root) == set()


def test_a_query_log_emptied_while_its_lines_are_read_back_is_a_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many ranges are read through one memory map; a file emptied between its size and the map made mmap raise a
    ValueError, out of the lookup and its task."""
    log = tmp_path / "q.jsonl"
    log.write_bytes(b'{"x": 1}\n' * 10)

    class TruncatingMmap:
        ACCESS_READ = real_mmap.ACCESS_READ

        @staticmethod
        def mmap(fd: int, n: int, access: int) -> real_mmap.mmap:
            os.truncate(log, 0)  # the writer, just after the reader's fstat
            return real_mmap.mmap(fd, n, access=access)

    monkeypatch.setattr(storage, "mmap", TruncatingMmap)
    _, ok = EventStoreCache(tmp_path / "es", str(tmp_path), 4)._read_lines(index_rows(10, 8), LookupStats())
    assert not ok.any()


def test_files_named_like_partitions_hold_no_logs_and_crash_no_listing(tmp_path: Path) -> None:
    """A regular file named like a day or a minute (``clicks/20250101``) made every listing raise
    NotADirectoryError: the pipeline stalled on it."""
    from photon.logs.layout import list_closed

    (tmp_path / "20250101").write_text("x")
    (tmp_path / "20250102").mkdir()
    (tmp_path / "20250102" / "0001").write_text("x")
    (tmp_path / "20250103" / "0002").mkdir(parents=True)
    (tmp_path / "20250103" / "0002" / "a.jsonl").write_bytes(b"{}\n")
    assert [f.rel for f in list_closed(tmp_path)] == ["20250103/0002/a.jsonl"]


def test_a_worker_reads_each_query_object_of_a_store_once_while_it_stays_kept(tmp_path: Path) -> None:
    """Issue 35's throughput and live latency: every join task fetched every query object's lines again at every
    batch (a request per object, or the whole object where lines are dense). Now a worker keeps the objects it
    read whole (its stage-1 tasks' and dense lookups') and slices lines out of them, least recently used out first
    past its bound; sparse lookups of an object not kept read ranges; a folder's reads are untouched."""
    from photon.joiner.eventstore import QueryObjects

    class Counting(LocalStore):
        atomic = True

        def __init__(self, root: Path) -> None:
            super().__init__(root)
            self.calls: list[str] = []

        def get(self, key: str) -> bytes:
            self.calls.append(f"get {key}")
            return super().get(key)

        def get_ranges(self, key: str, ranges: Any) -> list[bytes]:
            self.calls.append(f"ranges {key}")
            return super().get_ranges(key, ranges)

    (tmp_path / "q1").write_bytes(b"0123456789" * 20)
    (tmp_path / "q2").write_bytes(b"abcdefghij" * 20)
    (tmp_path / "q3").write_bytes(b"ABCDEFGHIJ" * 20)
    store, cache = Counting(tmp_path), QueryObjects()
    few, many = [(0, 3), (12, 15)], [(i, i + 2) for i in range(0, 190, 2)]
    cache.keep(store, "q1", store.get("q1"))  # parsed by this worker's stage-1 task
    store.calls.clear()
    assert cache.ranges(store, "q1", few) == [b"012", b"234"] and store.calls == []
    assert cache.ranges(store, "q2", few) == [b"abc", b"cde"] and store.calls == ["ranges q2"]  # sparse: ranges
    assert cache.ranges(store, "q2", many)[:2] == [b"ab", b"cd"] and store.calls[-1] == "get q2"  # dense: whole
    assert cache.ranges(store, "q2", few) == [b"abc", b"cde"] and len(store.calls) == 2  # kept, across batches
    folder = LocalStore(tmp_path)
    cache.keep(folder, "q3", b"x")  # a folder's files: the page cache's to keep
    assert (folder.url, "q3") not in cache.objects
    cache.MAX_BYTES = 450
    cache.ranges(store, "q1", few)  # used last: q2 is now the least recently used
    cache.keep(store, "q3", store.get("q3"))
    assert list(cache.objects) == [(store.url, "q1"), (store.url, "q3")] and cache.size == 400
    cache.keep(store, "q3", store.get("q3"))  # kept again: counted once
    assert cache.size == 400


def test_a_bucket_without_credentials_is_said_in_one_line(tmp_path: Path) -> None:
    """Newcomer walk: `photon audit --logs s3://photon/logs` said "--logs s3:/photon/logs: no such folder" (the URL
    mangled into a path); once buckets were read, without any key it said "Generic S3 error: Error performing PUT
    http://169.254.169.254/latest/api/token ..." (the client asking a cloud's instance metadata for one)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env |= {"PYTHONPATH": f"{root / 'plugins'}:{root}", "PHOTON_STORAGE_RETRY_S": "1"}
    for args in (["audit", "--out", str(tmp_path), "--logs"], ["verify", "--out", str(tmp_path), "--logs"]):
        r = subprocess.run(
            [sys.executable, "-m", "photon", *args, "s3://photon/logs"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        said = (r.stdout + r.stderr).strip()
        assert r.returncode == 2 and said.splitlines() == [
            "error: s3://photon/logs: no credentials for the store: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
            " (and AWS_ENDPOINT_URL for a store other than AWS S3), or the Airflow connection photon_storage"
        ], said


class _IgnoresIfNoneMatch(LocalStore):
    """A store as a server that ignores ``If-None-Match`` behaves: every put writes (none runs here to test against;
    SeaweedFS, the one the tests start, honours it)."""

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> bool:
        return super().put(key, data)


def test_a_store_that_ignores_conditional_writes_is_refused_in_one_line_and_left_as_it_was(tmp_path: Path) -> None:
    from photon.storage import check_conditional_writes

    check_conditional_writes(LocalStore(tmp_path / "honest"))  # a store that honours them passes
    assert list(LocalStore(tmp_path / "honest").listing()) == []  # and keeps nothing of the probe
    with pytest.raises(StorageError, match=r"does not honour conditional writes.*wrote over an existing object"):
        check_conditional_writes(_IgnoresIfNoneMatch(tmp_path / "sloppy"))
    assert list(LocalStore(tmp_path / "sloppy").listing()) == []


def test_an_object_store_error_is_one_line_ending_with_its_cause() -> None:
    """A reviewer's: a request to a hung server failed with a line ending "... }", the last line of obstore's debug
    dump, so the cause (a timeout) was lost. The cause is the dump's last quoted message; deltalake's nested causes
    end with the innermost."""
    from photon.storage import error_text

    obstore_dump = (
        "Generic S3 error: Error performing GET http://127.0.0.1:9/b/k in 30s - HTTP error: error sending request\n\n"
        'Debug source:\nGeneric {\n    store: "S3",\n    source: RetryError(\n        HttpError {\n'
        '            source: reqwest::Error { kind: Request, source: "operation timed out" },\n        },\n    ),\n}'
    )
    said = error_text(RuntimeError(obstore_dump))
    assert said.endswith("error sending request ... operation timed out") and "\n" not in said, said
    nested = "Kernel error -> Generic S3 error\n \x1b[31m↳\x1b[0m Error performing GET\n"
    nested += "  ↳ Connection refused (os error 111)"
    assert error_text(OSError(nested)) == "Kernel error -> Generic S3 error ... Connection refused (os error 111)"


def test_reads_in_flight_come_back_in_order_a_few_at_once_and_raise_where_taken() -> None:
    import threading
    import time

    running, most = 0, 0
    lock = threading.Lock()

    def call(i: int) -> int:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.01 * (i % 3))  # later calls finish first now and then
        with lock:
            running -= 1
        if i == 7:
            raise FileNotFoundError(f"call {i}")
        return i

    calls = [lambda i=i: call(i) for i in range(12)]
    got = storage.in_flight(calls, 4)
    assert [next(got) for _ in range(7)] == list(range(7))
    with pytest.raises(FileNotFoundError, match="call 7"):
        next(got)
    assert list(got) == []  # and the reading ends there
    assert 1 < most <= 4  # read ahead, never more than the window
    time.sleep(0.1)  # the calls read ahead past the failure finish on their own
    most = 0
    assert list(storage.in_flight(calls[:3], 1)) == [0, 1, 2] and most == 1  # a window of 1: one after another
