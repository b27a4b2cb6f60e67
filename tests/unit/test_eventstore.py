"""The EventStore: an index of where each query's line is in the logs (Photon's LogsEventStore), cached per worker.
It finds stored and staged queries, reads each index file once, forgets what was never committed, reads back exactly
the query that was indexed (or misses, never a wrong one) and still reads a store written before the index."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from photon.joiner.eventstore import EventStoreCache, index_of, write_index
from photon.logs.parse import QUERY_FIELDS, parse_file_located, parse_query

T0 = 1_763_700_000_000_000
BUCKET_S = 10


def line(t: int, text: str = "q") -> bytes:
    ad = {"ad_id": "a", "advertiser_id": "x", "bid_micros": 1}
    q = {"query_id": f"10.0.0.1-7-{t}", "ts_us": t, "user_id": "u", "query_text": f"{text}{t}", "country": "DE"}
    return json.dumps(q | {"ads": [ad]}, ensure_ascii=False).encode()


def log_and_index(logs: Path, folder: Path, file: str, content: bytes, name: str) -> None:
    """What a batch's first stage does with one query file: log it, parse it, index it by bucket."""
    (logs / file).parent.mkdir(parents=True, exist_ok=True)
    (logs / file).write_bytes(content)
    good, _, offsets, lengths = parse_file_located(file, content, "queries")
    write_index(index_of(good, file, offsets, lengths), folder, "", name, BUCKET_S)


def store_queries(logs: Path, folder: Path, name: str, ts: list[int], text: str = "q") -> None:
    log_and_index(logs, folder, f"20251121/0440/{name}.jsonl", b"".join(line(t, text) + b"\n" for t in ts), name)


def ids(ts: list[int]) -> pa.Array:
    return pa.array([f"10.0.0.1-7-{t}" for t in ts], pa.string())


def test_lookup_hits_staged_files_and_forgets_uncommitted(tmp_path: Path) -> None:
    logs, store, stage = tmp_path / "logs", tmp_path / "store", tmp_path / "stage"
    a, b = T0, T0 + 15_000_000  # two buckets
    store_queries(logs, store, "b1-q0", [a, a + 1])
    store_queries(logs, stage, "b2-q0", [b])
    cache = EventStoreCache(store, logs, max_buckets=4)

    found_q, found, stats = cache.lookup(ids([a, b, a + 5, a + 1]), BUCKET_S, stage)
    assert found.tolist() == [True, True, False, True]
    assert found_q.column("query_text").to_pylist()[:2] == [f"q{a}", f"q{b}"]
    assert found_q.column("query_text")[3].as_py() == f"q{a + 1}"
    assert (stats.lookups, stats.hits, stats.files_read, stats.lines_read) == (4, 0, 2, 3)

    # The batch commits: its staged file moves into the store under the same name; no index file is read again.
    folder = f"bucket={b // (BUCKET_S * 1_000_000)}"
    os.makedirs(store / folder, exist_ok=True)
    shutil.move(stage / folder / "b2-q0.arrow", store / folder / "b2-q0.arrow")
    _, found, stats = cache.lookup(ids([a, b]), BUCKET_S, tmp_path / "next-stage")
    assert found.tolist() == [True, True] and (stats.hits, stats.files_read) == (2, 0)

    # A batch that never commits: its staged queries are seen by that batch only.
    store_queries(logs, stage, "b3-q0", [a + 2])
    assert cache.lookup(ids([a + 2]), BUCKET_S, stage)[1].tolist() == [True]
    shutil.rmtree(stage)
    assert cache.lookup(ids([a + 2]), BUCKET_S, tmp_path / "b4")[1].tolist() == [False]


def test_the_index_points_at_each_line_among_bad_lines_crlf_and_non_ascii(tmp_path: Path) -> None:
    """Offsets are the events' own lines whichever parser path took them: Arrow's chunks, the reference's doubtful
    lines (a CR LF ending, a key given twice), with malformed lines and long non-ASCII texts in between."""
    logs, store = tmp_path / "logs", tmp_path / "store"
    ts = [T0 + i for i in range(8)]
    lines = [
        line(ts[0], "größer 東京 "),
        b"{truncated",
        line(ts[1]) + b"\r",
        b"\xff\xfe not UTF-8",
        line(ts[2])[:-1] + b', "query_text": "twice"}',
        b"",
        line(ts[3], "x" * 5000),
        line(ts[4]),
    ]
    log_and_index(logs, store, "20251121/0440/mixed.jsonl", b"\n".join(lines) + b"\n", "b1-q0")
    q, found, _ = EventStoreCache(store, logs, 4).lookup(ids(ts[:5]), BUCKET_S)
    assert found.tolist() == [True] * 5
    expected = [parse_query(raw) for raw in (lines[0], lines[2], lines[4], lines[6], lines[7])]
    assert q.to_pylist() == expected


def test_duplicates_invalid_ids_and_eviction(tmp_path: Path) -> None:
    logs, store = tmp_path / "logs", tmp_path / "store"
    store_queries(logs, store, "b1-q0", [T0], "first")
    store_queries(logs, store, "b2-q0", [T0], "second")
    cache = EventStoreCache(store, logs, max_buckets=2)
    q, found, _ = cache.lookup(pa.array([f"10.0.0.1-7-{T0}", "not-an-id", None], pa.string()), BUCKET_S)
    assert found.tolist() == [True, False, False]
    assert q.column("query_text")[0].as_py() == f"first{T0}"
    for i in range(1, 4):  # three more buckets: the oldest is evicted
        store_queries(logs, store, f"b{i + 2}-q0", [T0 + i * 10_000_000])
        cache.lookup(ids([T0 + i * 10_000_000]), BUCKET_S)
    assert len(cache.buckets) == 2
    _, found, stats = cache.lookup(ids([T0]), BUCKET_S)
    assert found.tolist() == [True] and stats.hits == 0 and stats.files_read == 2


def test_row_bound_evicts_least_recently_used_buckets(tmp_path: Path) -> None:
    logs, store = tmp_path / "logs", tmp_path / "store"
    for i in range(3):
        store_queries(logs, store, f"b{i}-q0", [T0 + i * 10_000_000 + j for j in range(10)])
    cache = EventStoreCache(store, logs, max_buckets=10, max_rows=25)
    for i in range(3):
        assert cache.lookup(ids([T0 + i * 10_000_000]), BUCKET_S)[1].tolist() == [True]
    assert len(cache.buckets) == 2 and cache.rows() == 20  # the oldest bucket went to keep 25 rows at most


def test_a_log_file_gone_or_changed_is_a_logged_miss_never_a_wrong_query(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The index trusts the logs (closed files never change). When that is broken, by a log deleted too early or a
    file rewritten, the lookup misses (the click waits, then is unjoinable here) and says which file: it never hands
    out another query's fields, and never fails the batch."""
    logs, store = tmp_path / "logs", tmp_path / "store"
    store_queries(logs, store, "gone", [T0])
    store_queries(logs, store, "changed", [T0 + 1, T0 + 2])
    store_queries(logs, store, "emptied", [T0 + 3])
    store_queries(logs, store, "kept", [T0 + 4])
    files = logs / "20251121" / "0440"
    (files / "gone.jsonl").unlink()
    (files / "emptied.jsonl").write_bytes(b"")
    # The second line's bytes now hold a different query (same length): it must not be taken for T0 + 2.
    first, second = line(T0 + 1), line(T0 + 2)
    (files / "changed.jsonl").write_bytes(first + b"\n" + second.replace(b"q", b"Q", 1).replace(b"-7-", b"-8-") + b"\n")
    with caplog.at_level(logging.ERROR, logger="photon.joiner.eventstore"):
        q, found, stats = EventStoreCache(store, logs, 4).lookup(ids([T0, T0 + 1, T0 + 2, T0 + 3, T0 + 4]), BUCKET_S)
    assert found.tolist() == [False, True, False, False, True]
    assert q.column("query_id")[4].as_py() == f"10.0.0.1-7-{T0 + 4}"
    assert stats.lines_missing == 3 and stats.unreadable.tolist() == [True, False, True, True, False]
    assert "gone.jsonl" in caplog.text and "emptied.jsonl" in caplog.text and "did not read back" in caplog.text


def test_a_store_written_before_the_index_is_still_read(tmp_path: Path) -> None:
    """A pipeline upgraded mid-flight: its clicks still waiting find the queries its older version stored whole."""
    logs, store = tmp_path / "logs", tmp_path / "store"
    folder = store / f"bucket={T0 // (BUCKET_S * 1_000_000)}"
    folder.mkdir(parents=True)
    legacy = pa.Table.from_pylist([parse_query(line(T0, "old"))], schema=QUERY_FIELDS)
    pq.write_table(legacy, folder / "b1-e1-q000000.parquet")
    store_queries(logs, store, "b2-q0", [T0 + 1], "new")
    q, found, _ = EventStoreCache(store, logs, 4).lookup(ids([T0 + 1, T0, T0 + 2]), BUCKET_S)
    assert found.tolist() == [True, True, False]
    assert q.column("query_text").to_pylist()[:2] == [f"new{T0 + 1}", f"old{T0}"]
    assert q.column("ads")[1].as_py() == [{"ad_id": "a", "advertiser_id": "x", "bid_micros": 1}]


def test_a_copy_whose_log_is_gone_does_not_hide_a_later_copy(tmp_path: Path) -> None:
    """The same query stored twice (logged twice, recovered, or its file moved into a partition and read again):
    the lookup takes the first copy that reads back, not just the first copy."""
    logs, store = tmp_path / "logs", tmp_path / "store"
    store_queries(logs, store, "b1-q0", [T0, T0 + 1], "first")
    store_queries(logs, store, "b2-q0", [T0], "second")
    (logs / "20251121" / "0440" / "b1-q0.jsonl").unlink()
    q, found, stats = EventStoreCache(store, logs, 4).lookup(ids([T0, T0 + 1, T0 + 2]), BUCKET_S)
    assert found.tolist() == [True, False, False]
    assert q.column("query_text")[0].as_py() == f"second{T0}"
    assert stats.unreadable.tolist() == [False, True, False]  # T0 + 2 was never stored: a plain miss


def test_a_query_log_reshipped_with_its_lines_reordered_is_a_logged_miss(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 19, reproduced: a replica re-shipped under the same name with its lines in another order. An indexed
    slice then holds the tail of one line, a newline and another whole line; the lookup raised IndexError (every
    lease, the click file never consumed). Now: a miss for each query whose line moved, a hit for one that did not."""
    logs, store = tmp_path / "logs", tmp_path / "store"
    ts = [T0, T0 + 1, T0 + 2]
    short, long = line(ts[0], "short"), line(ts[1], "a much longer query text " * 3)
    log_and_index(logs, store, "20251121/0440/r.jsonl", short + b"\n" + long + b"\n", "b1-q0")
    store_queries(logs, store, "a-kept", [ts[2]], "mid")  # read before r.jsonl: r's lines come last
    (logs / "20251121/0440/r.jsonl").write_bytes(long + b"\n" + short + b"\n")  # long's slice now ends in short
    with caplog.at_level(logging.ERROR, logger="photon.joiner.eventstore"):
        q, found, stats = EventStoreCache(store, logs, 4).lookup(ids(ts), BUCKET_S)
    assert found.tolist() == [False, False, True]
    assert q.column("query_text")[2].as_py() == f"mid{ts[2]}"
    assert stats.unreadable.tolist() == [True, True, False] and stats.lines_missing == 2
    assert "did not read back" in caplog.text


_REWRITES = ("reorder", "truncate", "append", "replace", "splice", "other", "delete")


@st.composite
def rewritten_log(draw: st.DrawFn) -> tuple[list[bytes], bytes | None]:
    """An indexed query log's lines, and what the file holds after an arbitrary rewrite under its name (None: gone)."""
    n = draw(st.integers(1, 6))
    texts = draw(st.lists(st.text(max_size=40), min_size=n, max_size=n))
    lines = [line(T0 + i, t) for i, t in enumerate(texts)]
    content = b"".join(x + b"\n" for x in lines)
    for how in draw(st.lists(st.sampled_from(_REWRITES), min_size=1, max_size=3)):
        if how == "delete":
            return lines, None
        parts = content.split(b"\n")
        if how == "reorder":
            content = b"\n".join(draw(st.permutations(parts)))
        elif how == "truncate":
            content = content[: draw(st.integers(0, len(content)))]
        elif how == "append":
            content += draw(st.binary(max_size=60) | st.sampled_from(lines))
        elif how == "replace":  # some bytes overwritten in place, the size unchanged or not
            at = draw(st.integers(0, len(content)))
            content = content[:at] + draw(st.binary(max_size=30)) + content[at + draw(st.integers(0, 30)) :]
        elif how == "splice":  # a line taken out or duplicated
            i = draw(st.integers(0, len(parts) - 1))
            parts = parts[:i] + parts[i + 1 :] if draw(st.booleans()) else parts[: i + 1] + parts[i:]
            content = b"\n".join(parts)
        else:  # other queries' lines, some of them the same length as the ones indexed
            others = [line(T0 + 100 + i, t) for i, t in enumerate(texts)]
            content = b"".join(x + b"\n" for x in draw(st.permutations(others + lines[: draw(st.integers(0, n))])))
    return lines, content


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(case=rewritten_log())
def test_any_rewrite_of_an_indexed_log_is_a_miss_or_the_same_query(
    tmp_path_factory: pytest.TempPathFactory, case: tuple[list[bytes], bytes | None]
) -> None:
    """Whatever happened to an indexed log file (reordered, truncated, appended, bytes overwritten, lines removed or
    doubled, other queries' lines, deleted): the lookup never raises, and finds a query only where the bytes its index
    row names still parse as that very query (same id and time), handing out exactly those bytes' fields; a line that
    is still there unchanged is always found."""
    lines, content = case
    tmp = tmp_path_factory.mktemp("rewrite")
    logs, store, name = tmp / "logs", tmp / "store", "20251121/0440/q.jsonl"
    original = b"".join(x + b"\n" for x in lines)
    log_and_index(logs, store, name, original, "b1-q0")
    if content is None:
        (logs / name).unlink()
    else:
        (logs / name).write_bytes(content)
    ts = [T0 + i for i in range(len(lines))]
    q, found, stats = EventStoreCache(store, logs, 4).lookup(ids([*ts, T0 + 99]), BUCKET_S)
    assert not found[-1] and not stats.unreadable[-1]  # never stored: a plain miss
    offsets = [sum(len(x) + 1 for x in lines[:i]) for i in range(len(lines))]
    for i, t in enumerate(ts):
        now = (content or b"")[offsets[i] : offsets[i] + len(lines[i])]
        assert found[i] == (not stats.unreadable[i])
        if now == lines[i]:  # its line still there, whatever happened around it
            assert found[i]
        if found[i]:
            expected = parse_query(now)  # raises if those bytes are no query: then it must not have been found
            assert (expected["query_id"], expected["ts_us"]) == (f"10.0.0.1-7-{t}", t)
            got = q.slice(i, 1).to_pylist()[0]
            assert got == {k: expected[k] for k in got}


def test_a_query_log_replaced_by_a_fifo_or_a_directory_is_a_logged_miss_not_a_hang(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Review: an indexed query log replaced under its name by a named pipe (``mkfifo``, a botched shipper) made the
    lookup block for good in ``open`` (no writer ever comes): the batch, and the lease, hung. A directory in its place
    is an error the lookup already catches. Both are now misses of the queries indexed there, logged."""
    import threading

    logs, store = tmp_path / "logs", tmp_path / "store"
    ts = [T0, T0 + 1]
    log_and_index(logs, store, "20251121/0440/p.jsonl", line(ts[0]) + b"\n", "b1-q0")
    log_and_index(logs, store, "20251121/0440/d.jsonl", line(ts[1]) + b"\n", "b1-q1")
    (logs / "20251121/0440/p.jsonl").unlink()
    os.mkfifo(logs / "20251121/0440/p.jsonl")
    (logs / "20251121/0440/d.jsonl").unlink()
    (logs / "20251121/0440/d.jsonl").mkdir()
    got: list[tuple[pa.Table, object, object]] = []
    with caplog.at_level(logging.ERROR, logger="photon.joiner.eventstore"):
        lookup = threading.Thread(target=lambda: got.append(EventStoreCache(store, logs, 4).lookup(ids(ts), BUCKET_S)))
        lookup.start()
        lookup.join(timeout=10)
    hung = lookup.is_alive()
    if hung:  # let the blocked open return, so the test ends (and fails)
        fd = os.open(logs / "20251121/0440/p.jsonl", os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        lookup.join(timeout=10)
    assert not hung, "the lookup blocked on a named pipe in place of a query log"
    ((_, found, stats),) = got
    assert found.tolist() == [False, False]  # type: ignore[attr-defined]
    assert stats.unreadable.tolist() == [True, True]  # type: ignore[attr-defined]
    assert "p.jsonl" in caplog.text and "d.jsonl" in caplog.text
