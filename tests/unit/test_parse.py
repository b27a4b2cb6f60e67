"""The Arrow parsing path gives exactly the reference path's answer: same events, same quarantine records."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from photon.generator import GeneratorSettings, generate
from photon.parse import CHUNK_LINES, CLICK_FIELDS, QUERY_FIELDS, parse_file, parse_file_by_line
from photon.schemas import MAX_LINE_BYTES

START = 1_763_700_000_000_000
US = 1_000_000
Q = (
    b'{"query_id": "10.1.2.3-7-1763700000000001", "ts_us": 1763700000000001, "user_id": "u1", "query_text": "tea", '
    b'"country": "DE", "ads": [{"ad_id": "a1", "advertiser_id": "x1", "bid_micros": 5}]}'
)
C = (
    b'{"click_id": "10.1.2.3-7-1763700000000009", "ts_us": 1763700000000009, '
    b'"query_id": "10.1.2.3-7-1763700000000001", "ad_id": "a1"}'
)

# Lines the generator does not write but a real log might hold; each is malformed unless marked ok.
QUERY_CASES = [
    Q.replace(b'"tea"', b"5"),  # a number where a string belongs
    Q.replace(b"1763700000000001,", b"1763700000000001.0,"),  # a float for an integer
    Q.replace(b"1763700000000001,", b"1.763700000000001e15,"),
    Q.replace(b'"country": "DE"', b'"country": "DE", "country": "FR"'),  # duplicate key
    Q.replace(b'"tea"', b'"te\\ud800a"'),  # an escaped lone surrogate
    Q.replace(b'"tea"', b'"t\xffa"'),  # invalid UTF-8 inside a string
    Q + b" " + Q,  # two objects on one line
    Q + b" x",
    b"",  # an empty line
    b"   ",
    b"[1, 2]",
    b"null",  # first in a file this crashed pyarrow 26's reader with a nested schema
    b"null " + Q,
    Q.replace(b'"10.1.2.3-7-1763700000000001"', b'"10.1.2.3-7-1763700000000001\\n"'),  # id with a newline
    Q.replace(b'"10.1.2.3-7-1763700000000001"', b'"010.1.2.3-7-1763700000000001"'),  # non-canonical id
    Q.replace(b'"10.1.2.3-7-1763700000000001"', b'"10.1.2.300-7-1763700000000001"'),
    Q.replace(b'"ts_us": 1763700000000001', b'"ts_us": 1763700000000002'),  # ts differs from the id's
    Q.replace(b'"ts_us": 1763700000000001', b'"ts_us": null'),
    Q.replace(b', "user_id": "u1"', b""),  # missing field
    Q.replace(b'"u1"', b'""'),  # empty string
    Q.replace(b'[{"ad_id": "a1", "advertiser_id": "x1", "bid_micros": 5}]', b"[]"),
    Q.replace(b'[{"ad_id": "a1", "advertiser_id": "x1", "bid_micros": 5}]', b"[null]"),
    Q.replace(b'"bid_micros": 5', b'"bid_micros": null'),
    Q.replace(b'"advertiser_id": "x1", ', b""),
    Q.replace(b'"tea"', b'"t\\u00e9a"'),  # ok: an escape
    Q.replace(b"}]}", b', "extra": [1]}], "more": {"a": 1}}'),  # ok: unknown fields are ignored
    b'{"query_id": "1.1.1.1-1-5", "ts_us": 5, "user_id": "u", "query_text": "' + b"x" * MAX_LINE_BYTES + b'"}',
]
CLICK_CASES = [
    C.replace(b'"a1"', b"1"),
    C.replace(b'"a1"', b"true"),
    C.replace(b'"10.1.2.3-7-1763700000000001"', b'"10.1.2.3-7-"'),
    C.replace(b'"10.1.2.3-7-1763700000000001"', b"null"),
    C.replace(b'"ts_us": 1763700000000009', b'"ts_us": -0'),
    C.replace(b', "ad_id": "a1"', b""),
    C + b" {",
    b"{",
]


def _sorted(t: pa.Table, keys: list[str]) -> pa.Table:
    return t.sort_by([(k, "ascending") for k in keys]).combine_chunks()


def _same(name: str, content: bytes, kind: str) -> tuple[int, int]:
    key = [f.name for f in (QUERY_FIELDS if kind == "queries" else CLICK_FIELDS) if f.name != "ads"]
    good_ref, bad_ref = parse_file_by_line(name, content, kind)
    good, bad = parse_file(name, content, kind)
    assert _sorted(good, key).equals(_sorted(good_ref, key))
    assert _sorted(bad, ["line"]).equals(_sorted(bad_ref, ["line"]))
    return good.num_rows, bad.num_rows


@pytest.mark.parametrize(("kind", "line", "cases"), [("queries", Q, QUERY_CASES), ("clicks", C, CLICK_CASES)])
def test_odd_lines_between_good_ones(kind: str, line: bytes, cases: list[bytes]) -> None:
    for i, case in enumerate(cases):
        # One odd line in the middle of a chunk, and at the very start and end of a file.
        for before, after in ((CHUNK_LINES // 2, CHUNK_LINES), (0, 3), (3, 0)):
            content = b"\n".join([line] * before + [case] + [line] * after) + b"\n"
            _same(f"case{i}.jsonl", content, kind)
    # All odd lines together, and a torn last line without its newline.
    content = b"\n".join([line, *cases, line]) + b"\n" + line[:40]
    good, bad = _same("all.jsonl", content, kind)
    assert good >= 2 and bad >= len(cases) - 3


def test_generated_logs_with_every_malformed_kind(tmp_path: Path) -> None:
    s = GeneratorSettings(events_per_s=4_000, malformed_fraction=0.02, duplicate_fraction=0.02, rotate_s=10.0)
    generate(s, tmp_path, start_us=START, end_us=START + 10 * US)
    totals = {"queries": [0, 0], "clicks": [0, 0]}
    for kind in totals:
        for f in sorted((tmp_path / "dc-a" / kind).glob("*.jsonl")):
            good, bad = _same(f.name, f.read_bytes(), kind)
            totals[kind][0] += good
            totals[kind][1] += bad
    assert totals["queries"][0] > 30_000 and totals["queries"][1] > 500
    assert totals["clicks"][1] > 20


def test_empty_file() -> None:
    good, bad = parse_file("e.jsonl", b"", "clicks")
    assert good.num_rows == 0 and bad.num_rows == 0
