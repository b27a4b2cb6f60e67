"""A batch's own queries shipped to their clicks through the shuffle (``tasks.Wanted``): each wanted pair gets the very
line its query was parsed from, a pair is named exactly (whatever its ids hold), and a click's lookup takes a shipped
query first, looks a named click up in the stored EventStore only and any other in the staged one too."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from photon.joiner.eventstore import EventStoreCache, index_of, write_index
from photon.joiner.tasks import CANDIDATE, SHUFFLED, Wanted, _look_up
from photon.logs.parse import parse_file_located

T0 = 1_763_700_000_000_000
BUCKET_S = 10


def qid(t: int) -> str:
    return f"10.0.0.1-7-{t}"


def line(t: int, text: str = "q") -> bytes:
    ad = {"ad_id": "a", "advertiser_id": "x", "bid_micros": 1}
    q = {"query_id": qid(t), "ts_us": t, "user_id": "u", "query_text": f"{text}{t}", "country": "DE", "ads": [ad]}
    return json.dumps(q, ensure_ascii=False).encode()


def pairs(*pairs: tuple[str, str], parts: int = 1) -> Wanted:
    """A ``Wanted`` of ``pairs``, the i-th click in partition i % ``parts``."""
    found = {"click_id": [c for c, _ in pairs], "query_id": [q for _, q in pairs]}
    return Wanted.of(pa.table(found | {"part": [i % parts for i in range(len(pairs))]}))


def test_each_wanted_pair_gets_the_line_its_query_was_parsed_from() -> None:
    a, b, c = T0, T0 + 1, T0 + 2
    lines = [line(a, "ü"), b"{broken", line(b), line(b, "second copy"), line(c)]
    content = b"\n".join(lines) + b"\n"
    good, _, offsets, lengths = parse_file_located("q.jsonl", content, "queries")
    # c2 and c3 in partitions of their own, c5 in c2's: c3 and c5 want the same query
    wanted = pairs(("c1", qid(a)), ("c2", qid(b)), ("c3", qid(b)), ("c4", qid(T0 + 9)), ("c5", qid(b)), parts=3)
    shipped = wanted.ship(good, content, offsets, lengths, 7 << 32)
    assert shipped is not None and shipped.schema == SHUFFLED
    got = {r["click_id"]: r for r in shipped.to_pylist()}
    assert sorted(got) == ["c1", "c2", "c3"]  # c4's query is not in the file; c5 takes the line sent to c2
    assert got["c1"]["line"] == lines[0] and got["c1"]["query_id"] == qid(a)
    assert got["c2"]["line"] == got["c3"]["line"] == lines[2]  # the first copy of a query logged twice
    assert (got["c1"]["order"], got["c2"]["order"]) == ((7 << 32) + 0, (7 << 32) + 1)  # rows of the parsed file
    # A shipped row is a query's, never a candidate: every candidate column but the ids is null
    assert all(got["c1"][n] is None for n in CANDIDATE.names if n not in ("click_id", "query_id"))
    assert pairs(("c9", qid(T0 + 9))).ship(good, content, offsets, lengths, 0) is None


ids = st.text(alphabet="0123456789-.:ab\n", max_size=6)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(ids, ids), min_size=1, max_size=8, unique=True), st.lists(st.tuples(ids, ids), max_size=8))
def test_a_pair_is_named_exactly_whatever_its_ids_hold(
    named: list[tuple[str, str]], asked: list[tuple[str, str]]
) -> None:
    asked = asked + named
    got = pairs(*named).named(pa.array([c for c, _ in asked]), pa.array([q for _, q in asked])).to_pylist()
    assert got == [p in set(named) for p in asked]


def index(logs: Path, folder: Path, name: str, ts: list[int]) -> None:
    """What a batch's first stage does with one query file: log it, parse it, index it by bucket."""
    file = f"20251121/0440/{name}.jsonl"
    content = b"".join(line(t) + b"\n" for t in ts)
    (logs / file).parent.mkdir(parents=True, exist_ok=True)
    (logs / file).write_bytes(content)
    good, _, offsets, lengths = parse_file_located(file, content, "queries")
    write_index(index_of(good, file, offsets, lengths), folder, "", name, BUCKET_S)


def live(rows: list[tuple[str, int, bool]]) -> pa.Table:
    """Due candidates: (click id, its query's time, named by the batch's Wanted)."""
    n = len(rows)
    cols = {f.name: pa.nulls(n, f.type) for f in CANDIDATE}
    cols |= {"click_id": pa.array([c for c, _, _ in rows]), "query_id": pa.array([qid(t) for _, t, _ in rows])}
    return pa.table(cols, schema=CANDIDATE).append_column("wanted", pa.array([w for _, _, w in rows]))


def test_a_click_takes_its_shipped_query_first_and_a_named_one_is_never_looked_up_in_the_staged_store(
    tmp_path: Path,
) -> None:
    logs, store, stage = tmp_path / "logs", tmp_path / "store", tmp_path / "stage"
    stored, staged, shipped_t, staged_named = T0, T0 + 1, T0 + 2, T0 + 3
    index(logs, store, "b1-q0", [stored])  # a batch before this one's
    index(logs, stage, "b2-q0", [staged, staged_named])  # this batch's
    clicks = live(
        [
            ("shipped", shipped_t, True),
            ("named-stored", stored, True),
            ("named-staged", staged_named, True),  # cannot happen: a staged query a named click wants is shipped
            ("unnamed-staged", staged, False),
            ("bad-ship", T0 + 4, True),  # the line shipped for its query is another's: taken for none
            ("nowhere", T0 + 9, False),
        ]
    )
    sent = pa.table(
        {
            "click_id": ["shipped", "bad-ship"],
            "query_id": [qid(shipped_t), qid(T0 + 4)],
            "line": [line(shipped_t, "shipped"), line(shipped_t)],
            "order": [0, 1],
        }
    )
    cache = EventStoreCache(store, logs, max_buckets=4)
    queries, hit, stats = _look_up(SimpleNamespace(bucket_s=BUCKET_S), cache, clicks, sent, stage)  # type: ignore[arg-type]
    assert hit.tolist() == [True, True, False, True, False, False]
    texts = queries.column("query_text").to_pylist()
    assert [texts[i] for i in np.flatnonzero(hit)] == [f"shipped{shipped_t}", f"q{stored}", f"q{staged}"]
    assert queries.column("query_id").to_pylist()[1] == qid(stored)
    assert (stats.lookups, stats.shipped, stats.unreadable.tolist()) == (6, 1, [False] * 6)

    # Nothing shipped (no Wanted, or one past its bound): every click looked up in both stores.
    queries, hit, stats = _look_up(
        SimpleNamespace(bucket_s=BUCKET_S),
        cache,
        clicks.drop_columns(["wanted"]).append_column("wanted", pa.array([False] * 6)),
        None,
        stage,
    )  # type: ignore[arg-type]
    assert hit.tolist() == [False, True, True, True, False, False] and stats.shipped == 0


def test_a_partition_whose_shipped_lines_no_live_click_takes_still_decides_its_clicks(tmp_path: Path) -> None:
    """Lines shipped to clicks since dropped (pre-filtered: joined by an earlier batch; stamped ahead), beside clicks
    that wait for queries not logged yet: the lookup goes on (it raised on the lengths of two lists once)."""
    logs, store, stage = tmp_path / "logs", tmp_path / "store", tmp_path / "stage"
    index(logs, store, "b1-q0", [T0])
    clicks = live([("waits", T0 + 9, True), ("also-waits", T0 + 8, False)])
    sent = pa.table({"click_id": ["dropped"], "query_id": [qid(T0 + 5)], "line": [line(T0 + 5)], "order": [0]})
    cache = EventStoreCache(store, logs, max_buckets=4)
    _, hit, stats = _look_up(SimpleNamespace(bucket_s=BUCKET_S), cache, clicks, sent, stage)  # type: ignore[arg-type]
    assert hit.tolist() == [False, False] and stats.shipped == 0


def test_a_copy_stored_before_wins_over_one_shipped_and_the_first_shipped_over_a_later_one(tmp_path: Path) -> None:
    """A query logged again with other content: every click of it joins the first copy that reads back (README), as a
    lookup in the store reads them: one stored by an earlier batch first, then the batch's own in store order."""
    logs, store, stage = tmp_path / "logs", tmp_path / "store", tmp_path / "stage"
    index(logs, store, "b1-q0", [T0])  # text "q<T0>"
    t = T0 + 1
    clicks = live([("again", T0, True), ("new", t, True)])
    sent = pa.table(
        {
            "click_id": ["again", "x", "x"],
            "query_id": [qid(T0), qid(t), qid(t)],
            "line": [line(T0, "second "), line(t, "later "), line(t, "first ")],
            "order": [0, 7, 3],
        }
    )
    cache = EventStoreCache(store, logs, max_buckets=4)
    queries, hit, stats = _look_up(SimpleNamespace(bucket_s=BUCKET_S), cache, clicks, sent, stage)  # type: ignore[arg-type]
    assert hit.tolist() == [True, True] and stats.shipped == 1
    assert queries.column("query_text").to_pylist() == [f"q{T0}", f"first {t}"]


def test_a_query_many_clicks_want_is_shipped_once_per_partition() -> None:
    """A line goes to each partition of the shuffle its clicks are in, once, whatever their number (a line per click
    once put 1,200 copies of a 1 MiB query in one Spark batch, past the JVM's direct memory)."""
    n = 1_200
    found = pa.table(
        {
            "click_id": [f"c{i}" for i in range(n)] + ["c0"],  # c0 found twice (its click logged twice)
            "query_id": [qid(T0)] * (n + 1),
            "part": [i % 4 for i in range(n)] + [0],
        }
    )
    wanted = Wanted.of(found)
    assert wanted.pairs.num_rows == n
    content = line(T0) + b"\n"
    good, _, offsets, lengths = parse_file_located("q.jsonl", content, "queries")
    shipped = wanted.ship(good, content, offsets, lengths, order=5 << 32)
    assert shipped is not None and shipped.num_rows == 4  # one per partition
    parts = {int(c[1:]) % 4 for c in shipped.column("click_id").to_pylist()}  # each addressed to a click there
    assert parts == {0, 1, 2, 3} and set(shipped.column("order").to_pylist()) == {5 << 32}
