"""Property tests of parsing: hostile input of every shape, parsed by both paths.

For any file content and either kind of log:

- ``parse_file`` (the Arrow path) and ``parse_file_by_line`` (the reference) never raise;
- every line is accounted for exactly once: it is an event or it has one quarantine record (line numbers 1-based,
  none twice, none outside the file), and no reason is "unexpected parser error";
- they agree line for line: the reference's answer is ``parse_query``/``parse_click`` of each line in turn (an
  event, or the ``Malformed`` reason); the Arrow path's quarantine table is identical to the reference's (every
  column, same order: the same lines, raw bytes and reasons), and its events are the reference's events as a
  multiset (equal values; the Arrow path lists the lines it sent to the reference after the others, so only the
  order may differ). With every line counted once on both sides, the Arrow path's events are then those of the
  very lines the reference made events of.

The normal suite runs each file property on 1,500 examples and each single-function one on 1,000 (the size-limit one
on a few, they are megabytes each), derandomized and without an example database, so CI is reproducible; at 3,000
they took 309 s of a worker in a 30-minute suite on 2 cores, and the deep search is `make fuzz`'s. ``make fuzz``
selects the ``fuzz`` profile (``HYPOTHESIS_PROFILE=fuzz``): 500,000 random examples per property (``FUZZ_EXAMPLES``
to change it).
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from photon.logs import parse
from photon.logs.parse import (
    CLICK_FIELDS,
    MAX_DEPTH,
    QUERY_FIELDS,
    parse_file,
    parse_file_by_line,
)
from photon.logs.schemas import MAX_LINE_BYTES
from tests.unit.test_parse import C, Q  # one valid query and click line, shared

_COMMON = {
    "deadline": None,
    "database": None,
    "print_blob": True,
    "suppress_health_check": list(HealthCheck),
}
settings.register_profile("parse", max_examples=1_500, derandomize=True, **_COMMON)  # type: ignore[arg-type]
settings.register_profile(
    "fuzz",
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "500000")),
    derandomize=False,
    **_COMMON,  # type: ignore[arg-type]
)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "parse")
EXAMPLES = settings.get_profile(PROFILE)
# Lines of a megabyte: a few in the suite, more when fuzzing. When fuzzing, FUZZ_EXAMPLES caps these too.
BIG = settings(EXAMPLES, max_examples=50 if PROFILE == "parse" else min(2_000, EXAMPLES.max_examples))
SMALL = settings(  # a single function, no files
    EXAMPLES, max_examples=1_000 if PROFILE == "parse" else min(100_000, EXAMPLES.max_examples)
)

KINDS = ("queries", "clicks")


# Arrow's stream in blocks of these many bytes: the default; a few lines a block, so that the properties' short files
# span several and a refusal lands in a later block than the first; less than a line, so that every stream gives up
# and the lines go in chunks.
BLOCKS = (None, 512, 64)


def test_the_properties_files_reach_arrow() -> None:
    """A one-line file goes through Arrow's reader, streamed at the default block and in a chunk at the smallest:
    the properties below test the fast path, not only the reference."""
    import pyarrow.json as pj

    from photon.logs import parse

    for block, reader in ((None, "open_json"), (BLOCKS[-1], "read_json")):
        calls: list[int] = []
        real = getattr(pj, reader)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(parse.pj, reader, lambda *a, real=real, calls=calls, **k: calls.append(1) or real(*a, **k))
            if block:
                mp.setattr(parse, "STREAM_BLOCK", block)
            good, _ = parse_file(NAME, C + b"\n", "clicks")
        assert calls and good.num_rows == 1, reader


NAME = "10.9.8.7-42-1.jsonl"


# -- the property -------------------------------------------------------------------------------------------------


def _lines(content: bytes) -> list[bytes]:
    lines = content.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return lines


def _key(event: dict[str, Any]) -> str:
    return json.dumps(event, sort_keys=True)


def check(content: bytes, kind: str) -> None:
    """Both paths total, every line accounted for once, and the two paths agreeing line for line."""
    # One block size per file, picked by its bytes: each size sees a third of the examples at a third of the cost.
    crc = zlib.crc32(content)
    block = BLOCKS[crc % len(BLOCKS)]
    with pytest.MonkeyPatch.context() as mp:
        if block:
            mp.setattr(parse, "STREAM_BLOCK", block)
        if (crc >> 8) % 2:  # half the files without the quote count's screen: their wrong types reach Arrow
            _no_shape_screen(mp)
        _check(content, kind)


def _no_shape_screen(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(parse, "SHAPE_BUDGET_LINES", -1)
    mp.setattr(parse, "SHAPE_BUDGET_PER", 1 << 62)


def _check(content: bytes, kind: str) -> None:
    schema = QUERY_FIELDS if kind == "queries" else CLICK_FIELDS
    good, bad = parse_file(NAME, content, kind)
    ref_good, ref_bad = parse_file_by_line(NAME, content, kind)
    lines = _lines(content)

    numbers = bad["line"].to_pylist()
    assert len(set(numbers)) == len(numbers)
    assert all(1 <= n <= len(lines) for n in numbers)
    assert good.num_rows + bad.num_rows == len(lines)
    assert good.schema == schema and ref_good.schema == schema
    assert not [r for r in bad["reason"].to_pylist() if r.startswith("unexpected")]

    # The Arrow path and the reference (parse_query or parse_click of each line in turn): the same quarantine
    # records, the same events.
    assert bad.equals(ref_bad)
    assert sorted(map(_key, good.to_pylist())) == sorted(map(_key, ref_good.to_pylist()))


# -- strategies ---------------------------------------------------------------------------------------------------

# Bytes that matter to a JSON reader, a UTF-8 decoder or a line splitter.
HOSTILE_BYTES = [
    b"\x00",
    b"\xef\xbb\xbf",  # BOM
    b"\r",
    b"\r\n",
    b"\n",
    b"\t",
    b"\x0c",
    b"\x7f",
    b"\xc0\xaf",  # overlong "/"
    b"\xc1\xbf",
    b"\xe0\x80\xaf",
    b"\xf0\x80\x80\xaf",
    b"\xed\xa0\x80",  # a surrogate, UTF-8 encoded
    b"\xed\xbf\xbf",
    b"\xed\xa0\xbd\xed\xb8\x80",  # a surrogate pair, UTF-8 encoded (CESU-8)
    b"\xf4\x90\x80\x80",  # above U+10FFFF
    b"\xff",
    b"\xe2\x82",  # truncated
    b"\x80",
    b"\\u0000",
    b"\\ud800",
    b"\\udc00",
    b"\\ud83d\\ude00",
    b"\\ude00\\ud83d",
    b"\\",
    b'\\"',
    b'"',
    b"\\u00e9",
    "é".encode(),
    "\u2028".encode(),
]
NUMBER_TOKENS = [
    b"0",
    b"-0",
    b"-0.0",
    b"1.0",
    b"1E2",
    b"1e-400",
    b"1e400",
    b"-1e400",
    b"1e20",
    b"100000000000000000000",
    b"9223372036854775807",
    b"9223372036854775808",
    b"-9223372036854775808",
    b"-9223372036854775809",
    b"18446744073709551616",
    b"1" + b"0" * 5000,
    b"NaN",
    b"-NaN",
    b"Infinity",
    b"-Infinity",
    b"+Infinity",
    b"Inf",
    b"-Inf",
    b"nan",
    b"inf",
    b"+1",
    b".5",
    b"1.",
    b"01",
    b"0x10",
    b"1_000",
    b"true",
    b"false",
    b"null",
    b"True",
    b"None",
]
JSON_TOKENS = [
    b"{",
    b"}",
    b"[",
    b"]",
    b":",
    b",",
    b" ",
    b'"',
    b'"ts_us"',
    b'"ads"',
    b'"ad_id"',
    b'"click_id"',
    b'"query_id"',
    b'"10.1.2.3-7-5"',
    b"5",
    b'{"a":',
    b"} {",
    b"}null",
    b"}\r{",
    *NUMBER_TOKENS,
    *HOSTILE_BYTES,
]

random_bytes = st.binary(max_size=300)
token_soup = st.lists(st.sampled_from(JSON_TOKENS), max_size=24).map(b"".join)


def _nest(value: bytes, depth: int, brackets: str) -> bytes:
    """``value`` inside ``depth`` arrays or objects, built as bytes (``json.dumps`` would recurse)."""
    if brackets == "[":
        return b"[" * depth + value + b"]" * depth
    return b'{"k": ' * depth + value + b"}" * depth


depths = st.one_of(
    st.integers(0, 4),
    st.integers(MAX_DEPTH - 4, MAX_DEPTH + 1),
    st.integers(0, 3 * MAX_DEPTH),
    st.sampled_from([1_000, 20_000]),
)
# Strings worth trying: empty, escapes, a NUL, a BOM, line and paragraph separators, lone surrogates (which
# json.dumps escapes, or writes as UTF-8-encoded surrogates without ensure_ascii), a surrogate pair.
TEXTS = [
    "",
    "a1",
    "x",
    "DE",
    "é",
    "\x00",
    "\ufeff",
    "\u2028",
    "\ud800",
    "\udc00",
    "\ud83d\ude00",
    "😀",
    '"',
    "\\",
    "\n",
    "\r",
    "\t",
    "\x7f",
    "10.1.2.3-7-5",
    "NaN",
    "[[[",
    "}{",
    "x" * 40,
]
texts = st.sampled_from(TEXTS)  # Hypothesis's own text (below) is rarer: it costs ten times as much to draw
scalars = st.one_of(
    st.sampled_from([None, True, False, 0, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, 10**20, 1.5, -0.0]),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    texts,
    st.text(max_size=4),
)
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(texts, children, max_size=3),
    max_leaves=6,
)
# A cheaper stand-in where any JSON value will do.
SMALL_JSON = [[], {}, [1], {"a": 1}, [[]], {"a": {"b": [None]}}, [1.5, "x"], {"ts_us": 1, "ts_us ": [True]}]
small_json = st.sampled_from(SMALL_JSON)
SPELLINGS = [(", ", ": "), (",", ":"), (" ,\t", " :\r")]


def _dumps(value: Any, ensure_ascii: bool, spelling: tuple[str, str]) -> bytes:
    text = json.dumps(value, ensure_ascii=ensure_ascii, separators=spelling, allow_nan=True)
    return text.encode("utf-8", "surrogatepass")


json_text = st.builds(_dumps, json_values, st.booleans(), st.sampled_from(SPELLINGS))
any_json = st.builds(_nest, json_text | st.sampled_from(NUMBER_TOKENS), depths, st.sampled_from(["[", "{"]))

# Valid events, from which mutations start.
event_ids = st.one_of(
    st.sampled_from([("10.1.2.3-7-1763700000000001", 1_763_700_000_000_001), ("0.0.0.0-0-0", 0)]),
    st.builds(
        lambda ip, pid, ts: (f"{ip}-{pid}-{ts}", ts),
        st.sampled_from(["10.1.2.3", "255.255.255.255", "1.2.3.4"]),
        st.sampled_from([0, 7, 2**32 - 1]),
        st.integers(0, 10**18 - 1),
    ),
)
ads = st.fixed_dictionaries(
    {"ad_id": texts, "advertiser_id": texts, "bid_micros": st.integers(-(2**63), 2**63 - 1) | st.just(5)}
)
queries = st.builds(
    lambda q, user, text, country, ads: {
        "query_id": q[0],
        "ts_us": q[1],
        "user_id": user,
        "query_text": text,
        "country": country,
        "ads": ads,
    },
    event_ids,
    texts,
    texts,
    texts,
    st.lists(ads, min_size=1, max_size=2),
)
clicks = st.builds(
    lambda c, q, ad: {"click_id": c[0], "ts_us": c[1], "query_id": q[0], "ad_id": ad}, event_ids, event_ids, texts
)
EVENTS = {"queries": queries, "clicks": clicks}

INDEX = st.integers(0, 1 << 16)  # taken modulo a length: cheaper than a strategy built for each length
ACTIONS = st.lists(st.sampled_from(["replace", "drop", "double", "unknown", "ad"]), max_size=2)
AD_KEYS = st.sampled_from(["ad_id", "advertiser_id", "bid_micros", "extra"])
SPLICES = st.sampled_from(["none", "none", "none", "insert", "replace", "cut"])
RAW = "@@raw{}@@"  # a placeholder, replaced by raw bytes after json.dumps
mutant_values = st.one_of(
    scalars,
    small_json,
    st.sampled_from(NUMBER_TOKENS).map(lambda t: ("raw", t)),
    st.builds(_nest, st.just(b"1"), depths, st.sampled_from(["[", "{"])).map(lambda t: ("raw", t)),
)


@st.composite
def mutated_event(draw: st.DrawFn, kind: str) -> bytes:
    """An event with some fields replaced by other values, removed, given twice, or unknown fields added, spelled
    one of several ways, and perhaps with hostile bytes spliced in or cut short. Often it stays valid."""
    event = draw(EVENTS[kind])
    raws: list[bytes] = []

    def value() -> Any:
        v = draw(mutant_values)
        if isinstance(v, tuple):
            raws.append(v[1])
            return RAW.format(len(raws) - 1)
        return v

    pairs: list[tuple[str, Any]] = list(event.items())
    for action in draw(ACTIONS):
        i = draw(INDEX) % len(pairs)
        if action == "replace":
            pairs[i] = (pairs[i][0], value())
        elif action == "drop" and len(pairs) > 1:
            del pairs[i]
        elif action == "double":
            pairs.insert(i, (pairs[i][0], value()))
        elif action == "unknown":
            pairs.insert(i, (draw(texts), value()))
        elif action == "ad" and kind == "queries":
            ad = event["ads"][0]
            ad[draw(AD_KEYS)] = value()
    # Built by hand, so that a key may appear twice.
    ensure_ascii = draw(st.booleans())
    comma, colon = draw(st.sampled_from(SPELLINGS))
    body = comma.join(
        json.dumps(k, ensure_ascii=ensure_ascii) + colon + json.dumps(v, ensure_ascii=ensure_ascii, allow_nan=True)
        for k, v in pairs
    )
    line = ("{" + body + "}").encode("utf-8", "surrogatepass")
    for n, raw in enumerate(raws):
        line = line.replace(json.dumps(RAW.format(n)).encode(), raw)
    how = draw(SPLICES)
    if how != "none":
        where = draw(INDEX) % (len(line) + 1)
        piece = draw(st.sampled_from(HOSTILE_BYTES))
        if how == "insert":
            line = line[:where] + piece + line[where:]
        elif how == "replace":
            line = line[:where] + piece + line[where + len(piece) :]
        else:
            line = line[:where]
    return line


# Ready-made good lines (cheap to draw) in a few spellings, to surround the lines under test.
GOOD = {
    kind: [
        _dumps(json.loads(line), ensure_ascii, spelling) + end
        for line in (Q if kind == "queries" else C, (Q if kind == "queries" else C).replace(b"a1", b"\\u00e9"))
        for ensure_ascii in (True, False)
        for spelling in SPELLINGS
        for end in (b"", b"\r")
    ]
    for kind in KINDS
}


def valid_line(kind: str) -> st.SearchStrategy[bytes]:
    return st.sampled_from(GOOD[kind]) | st.builds(_dumps, EVENTS[kind], st.booleans(), st.sampled_from(SPELLINGS))


def line_of(kind: str) -> st.SearchStrategy[bytes]:
    return st.one_of(
        valid_line(kind),
        valid_line(kind),
        mutated_event(kind),
        any_json,
        token_soup,
        random_bytes,
        st.sampled_from([b"", b"\r", b" ", b"\xef\xbb\xbf", b"null", b"{}", b"[]", b"\x00" * 8]),
    )


def _join(lines: list[bytes], sep: bytes, last: bool) -> bytes:
    return sep.join(lines) + (sep if lines and last else b"")


def files(kind: str) -> st.SearchStrategy[bytes]:
    """Lines of every kind mixed, joined by LF or CR LF, with or without the last newline."""
    return st.builds(
        _join,
        st.lists(line_of(kind), max_size=4),
        st.sampled_from([b"\n", b"\n", b"\r\n"]),
        st.sampled_from([True, True, True, False]),
    )


MUTATED = {kind: st.lists(mutated_event(kind), min_size=1, max_size=2) for kind in KINDS}
GOOD_LINE = {kind: st.sampled_from(GOOD[kind]) for kind in KINDS}
FILES = {kind: files(kind) for kind in KINDS}
LINES = {kind: st.lists(line_of(kind), max_size=3) for kind in KINDS}


# -- properties ---------------------------------------------------------------------------------------------------


@EXAMPLES
@given(lines=st.lists(random_bytes | token_soup | any_json, max_size=4), kind=st.sampled_from(KINDS))
def test_random_bytes_and_json_of_any_shape(lines: list[bytes], kind: str) -> None:
    check(b"\n".join(lines), kind)


@EXAMPLES
@given(data=st.data(), kind=st.sampled_from(KINDS))
def test_mutated_events(data: st.DataObject, kind: str) -> None:
    """One or two mutated events between good lines (which Arrow reads in the same chunk)."""
    lines = [data.draw(GOOD_LINE[kind]), *data.draw(MUTATED[kind]), data.draw(GOOD_LINE[kind])]
    check(b"\n".join(lines) + b"\n", kind)


@EXAMPLES
@given(data=st.data(), kind=st.sampled_from(KINDS))
def test_files_mixing_good_and_bad_lines(data: st.DataObject, kind: str) -> None:
    check(data.draw(FILES[kind]), kind)


@BIG
@given(
    data=st.data(),
    kind=st.sampled_from(KINDS),
    delta=st.integers(-2, 2),
    cr=st.booleans(),
    where=st.sampled_from(["start", "end", "alone"]),  # the odd part, or the big line alone in its file
)
def test_lines_around_the_size_limit(data: st.DataObject, kind: str, delta: int, cr: bool, where: str) -> None:
    """A line of MAX_LINE_BYTES + delta bytes (a CR counts, the newline does not), padded in a field nobody reads,
    perhaps with something hostile at its start or end, among ordinary lines."""
    base = data.draw(valid_line(kind) | mutated_event(kind)).rstrip(b"\r")
    if not base.endswith(b"}"):
        base = GOOD[kind][0]
    odd = data.draw(st.sampled_from([b"", b"NaN", b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), b'"\xff"']))
    if odd and where == "start":
        base = b'{"odd": ' + odd + b", " + base[1:]
    head = base[:-1] + (b', "odd": ' + odd if odd and where != "start" else b"") + b', "pad": "'
    tail = b'"}' + (b"\r" if cr else b"")
    big = head + b"x" * (MAX_LINE_BYTES + delta - len(head) - len(tail)) + tail
    assert len(big) == MAX_LINE_BYTES + delta
    others = data.draw(LINES[kind]) if where != "alone" else []
    check(b"\n".join([*others, big, *others]) + b"\n", kind)


def _id_and_ts() -> st.SearchStrategy[tuple[str, int]]:
    # Mostly canonical (so that the ids the screen accepts are many), with every kind of near miss.
    octet = st.integers(0, 255).map(str) | st.integers(0, 300).map(str) | st.sampled_from(["00", "01", "-1", ""])
    pid = st.integers(0, 99_999).map(str) | st.integers(0, 2**33).map(str) | st.sampled_from(["007", "4294967296"])
    ts = st.integers(0, 10**19).map(str) | st.sampled_from(["0", "00", "01", "9" * 18, "1" + "0" * 18, "-5", ""])
    sep = st.sampled_from(["-"] * 8 + ["--", "_", " -"])
    ident = st.tuples(octet, octet, octet, octet, pid, ts, sep).map(
        lambda p: f"{p[0]}.{p[1]}.{p[2]}.{p[3]}-{p[4]}{p[6]}{p[5]}"
    )

    def with_ts(s: str, d: st.DrawFn) -> tuple[str, int]:
        tail = s.rsplit("-", 1)[-1]
        own = int(tail) if tail.isascii() and tail.isdigit() and int(tail) < 2**63 else 0
        tail_of = own % 10 ** d(st.integers(1, 18))  # the id's last digits only: "-112" is not ts 12
        near = d(st.sampled_from([own, own, own + 1, own - 1, own * 10, own // 10, tail_of, -own, 0, 2**63 - 1]))
        return s + d(st.sampled_from([""] * 8 + ["x", " ", "\n"])), max(-(2**63), min(2**63 - 1, near))

    return st.composite(lambda d: with_ts(d(ident | ident | ident | st.text(max_size=30)), d))()


@SMALL
@given(rows=st.lists(_id_and_ts(), min_size=1, max_size=8))
def test_the_screens_id_check_is_sound_and_takes_every_ordinary_id(rows: list[tuple[str, int]]) -> None:
    """The fast screen's id check (one regex match and a digit comparison) accepts only ids the reference accepts
    with exactly that timestamp; and it accepts every canonical one whose pid has at most 9 digits."""
    import numpy as np
    import pyarrow as pa

    from photon.logs.ids import valid_ids
    from photon.logs.parse import _sure_ids

    ids, ts = pa.array([i for i, _ in rows], pa.string()), np.array([t for _, t in rows], np.int64)
    sure = _sure_ids(ids, ts)
    valid, id_ts = valid_ids(ids)
    assert not (sure & ~(valid & (id_ts == ts))).any()
    ordinary = valid & (id_ts == ts) & np.array([len([*i.split("-"), "", ""][1]) <= 9 for i, _ in rows])
    assert (sure | ~ordinary).all()
    sliced = _sure_ids(pa.array(["x", *(i for i, _ in rows)], pa.string()).slice(1), ts)
    assert (sliced == sure).all()


def _shared_parts() -> st.SearchStrategy[tuple[list[str | None], list[int]]]:
    """Ids as a file holds them: a few parts before the timestamp, each shared by many rows (some going on from
    another), and timestamps of today's 16 digits, with near misses on both sides of the last "-" (and rows of no id
    at all)."""
    octet = st.integers(0, 255).map(str) | st.sampled_from(["256", "00", "01", "", "1a", "é"])
    pid = st.integers(0, 10**9 - 1).map(str) | st.sampled_from(["007", "1234567890", "", "-", "x"])
    part = st.tuples(octet, octet, octet, octet, pid).map(lambda p: f"{p[0]}.{p[1]}.{p[2]}.{p[3]}-{p[4]}")
    part = part | st.text(max_size=30)
    sixteen = st.integers(10**15, 10**16 - 1).map(str)
    tail = sixteen | sixteen | st.sampled_from(["0" + "1" * 15, "1" * 15, "1" * 17, "1" * 15 + "x", "1" * 8 + "é"])
    tail = tail | st.text(alphabet="0123456789-x ", min_size=14, max_size=18)

    @st.composite
    def rows(d: st.DrawFn) -> tuple[list[str | None], list[int]]:
        parts = d(st.lists(part, min_size=1, max_size=4))
        # and parts that go on from another (an id of one starts with the other)
        parts += [p + d(st.sampled_from(["-", "0", "1", "x", "-1", ".", "é"])) for p in parts if d(st.booleans())]
        ids: list[str | None] = []
        ts: list[int] = []
        for _ in range(d(st.integers(1, 12))):
            t = d(tail)
            sep = d(st.sampled_from(["-"] * 6 + ["--", "_", ""]))
            ids.append(None if d(st.integers(0, 15)) == 0 else d(st.sampled_from(parts)) + sep + t)
            own = int(t) if t.isascii() and t.isdigit() else 0
            ts.append(d(st.sampled_from([own, own, own, own + 1, own - 10**15, 0])))
        return ids, ts

    return rows()


@SMALL
@given(
    rows=_shared_parts(),
    large=st.booleans(),
    offset=st.integers(0, 2),
    tried=st.sampled_from([4, 1, -1]),
    each=st.booleans(),
    sample=st.integers(1, 16),
)
def test_the_id_check_by_shared_parts_agrees_with_a_match_of_each_id(
    rows: tuple[list[str | None], list[int]], large: bool, offset: int, tried: int, each: bool, sample: int
) -> None:
    """``_sure_ids`` decides the part before a 16-digit timestamp by the parts of a sample tried on every row (or
    none tried), then the rows left by a match of each distinct part or of each row's, and reads the timestamp as
    two words: it answers exactly as a regex match of each id and its digits read one by one
    (``_sure_ids_by_regex``), and accepts nothing the reference (``valid_ids``) refuses or with another timestamp;
    for string and large string arrays, sliced or not, with nulls, whatever the sample holds."""
    import numpy as np
    import pyarrow as pa

    from photon.logs.ids import valid_ids
    from photon.logs.parse import _sure_ids, _sure_ids_by_regex

    ids, ts_list = rows
    ts = np.array(ts_list, np.int64)
    arr = pa.array(["x" * 30] * offset + ids, pa.large_string() if large else pa.string()).slice(offset)
    # Parts tried on every row (at most 4 or 1, or none), then each distinct part matched once, or each row's.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(parse, "_PARTS_TRIED", tried)
        mp.setattr(parse, "_PARTS_DISTINCT", 1 << 30 if each else 0)
        mp.setattr(parse, "_PARTS_SAMPLE", sample)
        sure = _sure_ids(arr, ts)
        assert sure.tolist() == _sure_ids_by_regex(arr, ts).tolist()
        assert _sure_ids(arr).tolist() == _sure_ids_by_regex(arr).tolist()
    valid, id_ts = valid_ids(pa.array([i or "" for i in ids], pa.string()))
    assert not (sure & ~(valid & (id_ts == ts))).any()


@SMALL
@given(
    lines=st.lists(
        st.lists(
            st.sampled_from([b"a", b"{}", "é".encode(), "😀".encode(), *(b for b in HOSTILE_BYTES if b"\n" not in b)])
        ).map(b"".join),
        max_size=300,
    ),
    first_fan_out=st.integers(2, 20),
    fan_out=st.integers(2, 5),
    by_line=st.integers(1, 70),
    torn=st.booleans(),
)
def test_the_utf8_check_finds_exactly_the_lines_pythons_decoder_refuses(
    lines: list[bytes], first_fan_out: int, fan_out: int, by_line: int, torn: bool
) -> None:
    """Per line, the fast UTF-8 check (a whole file at once, a failing range cut into parts, a few lines decided
    one by one) says invalid exactly where Python's decoder raises: whatever the bad lines' number and places, the
    cuts' fan-outs and where they stop. With the defaults, files of at most 64 lines never leave the first check or
    the line-by-line step: small fan-outs and thresholds take these files through every level."""
    import numpy as np

    from photon.logs import parse

    content = b"".join(line + b"\n" for line in lines)
    if torn and lines and lines[-1]:
        content = content[:-1]  # a torn last line: no newline after it
    buf = np.frombuffer(content, np.uint8)
    ends = np.flatnonzero(buf == 10)
    if content and buf[-1] != 10:
        ends = np.append(ends, len(content))
    starts = np.concatenate(([0], ends[:-1] + 1)).astype(np.int64)[: len(ends)]  # no line in an empty file
    want = np.array([_refused_by_python(line) for line in lines], bool)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(parse, "UTF8_FIRST_FAN_OUT", first_fan_out)
        mp.setattr(parse, "UTF8_FAN_OUT", fan_out)
        mp.setattr(parse, "UTF8_BY_LINE", by_line)
        got = parse._invalid_utf8(content, starts, ends)
        # And with the bytes no UTF-8 text holds found by the byte passes (such lines decided at once, the runs
        # between them validated each on its own).
        given = parse._invalid_utf8(content, starts, ends, np.flatnonzero(buf >= 0xF5))
    assert got.tolist() == want.tolist()
    assert given.tolist() == want.tolist()


def _refused_by_python(line: bytes) -> bool:
    try:
        line.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False
