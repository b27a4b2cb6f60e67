"""The Arrow parsing path gives exactly the reference path's answer: same events, same quarantine records."""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa
import pytest

from photon.logs.parse import CHUNK_LINES, CLICK_FIELDS, MAX_DEPTH, QUERY_FIELDS, parse_file, parse_file_by_line
from photon.logs.schemas import MAX_LINE_BYTES
from photon.tools.generator import GeneratorSettings, generate

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


def _no_shape_screen(mp: pytest.MonkeyPatch) -> None:
    """Every line to Arrow whatever its quotes and brackets: the paths behind the screen of ``_out_of_step``."""
    from photon.logs import parse

    mp.setattr(parse, "SHAPE_BUDGET_LINES", -1)
    mp.setattr(parse, "SHAPE_BUDGET_PER", 1 << 62)


@pytest.mark.parametrize("shape_screen", [True, False])
@pytest.mark.parametrize("after", [0, 1, 5])
def test_a_line_of_two_objects_before_a_refused_one(after: int, shape_screen: bool) -> None:
    """A line holding two objects gives Arrow's stream one row too many, so the row a refusal names is the line after
    the one refused, or past the block's last line: every line still ends up an event or a quarantine record."""
    wrong_type = C.replace(b'"ts_us": 1763700000000009', b'"ts_us": "1763700000000009"')
    content = b"\n".join([C, C + b" " + C, C, wrong_type] + [C] * after) + b"\n"
    with pytest.MonkeyPatch.context() as mp:
        if not shape_screen:
            _no_shape_screen(mp)
        good, bad = _same("two.jsonl", content, "clicks")
    assert (good, bad) == (2 + after, 2)


def _arrow_reads(content: bytes, kind: str) -> tuple[int, int, int, int]:
    """(events, quarantine records, Arrow reads, lines the reference path parsed) of one file, both paths agreeing."""
    from photon.logs import parse

    reads: list[int] = []
    referred: list[int] = []
    real_reference = parse._by_line_numbers
    with pytest.MonkeyPatch.context() as mp:
        for reader in ("open_json", "read_json"):
            real = getattr(parse.pj, reader)
            mp.setattr(parse.pj, reader, lambda *a, real=real, **k: reads.append(1) or real(*a, **k))
        mp.setattr(
            parse,
            "_by_line_numbers",
            lambda name, kind, lines, index: referred.append(len(lines)) or real_reference(name, kind, lines, index),
        )
        good, bad = _same("shape.jsonl", content, kind)
    lines = content.count(b"\n")  # the reference path parsed each line once for _same's comparison
    return good, bad, len(reads), sum(referred) - lines


WRONG_TYPES = {
    "clicks": [
        C.replace(b'"ts_us": 1763700000000009', b'"ts_us": "1763700000000009"'),  # a number quoted
        C.replace(b'"10.1.2.3-7-1763700000000001"', b"101237"),  # an id unquoted
        C.replace(b'"a1"', b'["a1"]'),  # a list for a string
        C.replace(b'"a1"', b'{"id": "a1"}'),
        b'{"click_id": "10.250.0.1-1-1600000000000001", "ts_us": "soon", "query_id": 17, "ad_id": ["a1"]}',
    ],
    "queries": [
        Q.replace(b'"ts_us": 1763700000000001', b'"ts_us": "1763700000000001"'),
        Q.replace(b'"u1"', b"17"),
        Q.replace(b'"bid_micros": 5', b'"bid_micros": "5"'),
        Q.replace(b'[{"ad_id": "a1", "advertiser_id": "x1", "bid_micros": 5}]', b'"a1"'),
        b'{"query_id": "10.250.0.1-1-1600000000000001", "ts_us": "soon", "user_id": 17, "ads": 3}',
    ],
}


@pytest.mark.parametrize("kind", ["clicks", "queries"])
def test_a_value_of_the_wrong_type_goes_to_the_reference_without_an_arrow_refusal(kind: str) -> None:
    """A string where a number or a list belongs, or the other way round, puts a line's quotes and brackets out of
    step: the line goes to the reference path at once, and Arrow reads the file in one stream, refusing nothing
    (each refusal cost a read again of up to a block). Lines laid out otherwise but good stay with Arrow: an
    escaped quote in a text, an empty or a longer list of ads."""
    good_line = C if kind == "clicks" else Q
    fine = [good_line]
    if kind == "queries":
        ad = b'{"ad_id": "a2", "advertiser_id": "x\\"2\\"", "bid_micros": 7}'
        fine += [
            Q.replace(b'"tea"', b'"\\"tea\\" and \\"milk\\""'),
            Q.replace(b"}]}", b"}, " + ad + b", " + ad + b"]}"),
        ]
    else:
        fine.append(C.replace(b'"a1"', b'"a\\"1"'))
    lines = [fine[i % len(fine)] for i in range(3_000)]
    for i, bad_line in enumerate(WRONG_TYPES[kind]):
        lines[100 + 500 * i] = bad_line
    good, bad, reads, referred = _arrow_reads(b"\n".join(lines) + b"\n", kind)
    assert (good, bad) == (3_000 - len(WRONG_TYPES[kind]), len(WRONG_TYPES[kind]))
    assert (reads, referred) == (1, len(WRONG_TYPES[kind]))


def test_a_file_laid_out_its_own_way_goes_to_arrow_whole() -> None:
    """Good lines all out of step (a field the contract does not name, say): past the budget the screen stands
    aside for the file, so that its lines are not all parsed by the reference path; a wrong type among them then
    costs Arrow a refusal, as before the screen."""
    from photon.logs import parse

    extra = C.replace(b'"ad_id": "a1"', b'"ad_id": "a1", "referrer": "news"')
    wrong = extra.replace(b'"ts_us": 1763700000000009', b'"ts_us": "1763700000000009"')
    lines = [extra] * 3_000
    lines[1_500] = wrong
    good, bad, reads, referred = _arrow_reads(b"\n".join(lines) + b"\n", "clicks")
    assert (good, bad, referred) == (2_999, 1, 1)
    assert reads == 3  # the stream refused at the wrong line, the lines before it in its block, the stream again
    budget = parse._shape_budget(3_000)
    lines = [C] * 3_000
    for i in range(budget):
        lines[i * 50] = extra
    assert _arrow_reads(b"\n".join(lines) + b"\n", "clicks")[2:] == (1, budget)
    lines[2_999] = extra  # one more than the budget: the screen stands aside
    assert _arrow_reads(b"\n".join(lines) + b"\n", "clicks")[2:] == (1, 0)


def test_a_small_file_sends_few_good_lines_to_the_reference() -> None:
    """In a file of 64 lines a refusal costs little, so 5 good lines out of step (a bracket in a text) are over its
    budget (4): Arrow reads them all. With 16 allowed, as at first, a quarter of such a file went to the reference
    path, 1.45x slower (a reviewer's files)."""
    bracket = Q.replace(b'"tea"', b'"[deal] tea"')
    lines = [Q] * 64
    for i in range(5):
        lines[i * 12] = bracket
    assert _arrow_reads(b"\n".join(lines) + b"\n", "queries") == (64, 0, 1, 0)
    lines[0] = Q  # 4: within the budget, to the reference at once
    assert _arrow_reads(b"\n".join(lines) + b"\n", "queries") == (64, 0, 1, 4)


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
        for f in sorted((tmp_path / "dc-a" / kind).rglob("*.jsonl")):
            good, bad = _same(f.name, f.read_bytes(), kind)
            totals[kind][0] += good
            totals[kind][1] += bad
    assert totals["queries"][0] > 30_000 and totals["queries"][1] > 500
    assert totals["clicks"][1] > 20


def test_empty_file() -> None:
    good, bad = parse_file("e.jsonl", b"", "clicks")
    assert good.num_rows == 0 and bad.num_rows == 0


# -- hostile lines: each becomes an event or a quarantine record with a reason, never an exception -----------------


def _outcome(content: bytes, kind: str) -> tuple[list[dict[str, object]], list[tuple[int, str]]]:
    """The events and the (line, reason) of each quarantined line, once both paths agree on them."""
    _same("hostile.jsonl", content, kind)
    good, bad = parse_file_by_line("hostile.jsonl", content, kind)
    return good.to_pylist(), list(zip(bad["line"].to_pylist(), bad["reason"].to_pylist(), strict=True))


def _with_extra(line: bytes, extra: bytes) -> bytes:
    """``line`` with one more (unknown) field at its end."""
    return line[:-1] + b', "extra": ' + extra + b"}"


@pytest.mark.parametrize(
    ("kind", "line", "reason"),
    [
        (
            "queries",
            Q.replace(b'"bid_micros": 5', b'"bid_micros": 100000000000000000000'),
            "bid_micros is out of range",
        ),
        ("queries", Q.replace(b'"bid_micros": 5', b'"bid_micros": 9223372036854775808'), "bid_micros is out of range"),
        ("queries", Q.replace(b'"bid_micros": 5', b'"bid_micros": -9223372036854775809'), "bid_micros is out of range"),
        ("queries", Q.replace(b'"bid_micros": 5', b'"bid_micros": 1' + b"0" * 5000), "bid_micros is out of range"),
        ("queries", Q.replace(b'"bid_micros": 5', b'"bid_micros": 1e400'), "bid_micros is not an integer"),
        ("queries", Q.replace(b'"bid_micros": 5', b'"bid_micros": 1e20'), "bid_micros is not an integer"),
        ("clicks", C.replace(b'"ts_us": 1763700000000009', b'"ts_us": 18446744073709551616'), "ts_us is out of range"),
        ("queries", Q.replace(b'"bid_micros": 5', b'"bid_micros": 9223372036854775807'), None),
        ("queries", Q.replace(b'"bid_micros": 5', b'"bid_micros": -9223372036854775808'), None),
        ("clicks", _with_extra(C, b"1" + b"0" * 5000), None),  # any integer where nothing is read
    ],
)
def test_integers_outside_int64_are_malformed(kind: str, line: bytes, reason: str | None) -> None:
    # One such line used to raise OverflowError while the events table was built: the whole file failed.
    good, bad = _outcome(b"\n".join([line, line]) + b"\n", kind)
    assert bad == ([] if reason is None else [(1, reason), (2, reason)])
    assert len(good) == (2 if reason is None else 0)


@pytest.mark.parametrize(
    ("kind", "line", "reason"),
    [
        ("queries", b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),  # used to raise RecursionError
        ("queries", b'{"a":' + b"[" * 100_000, "nested too deeply"),
        ("clicks", _with_extra(C, b"[" * 100_000 + b"]" * 100_000), "nested too deeply"),
        ("clicks", _with_extra(C, b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1)), None),  # the object is one level
        ("clicks", _with_extra(C, b"[" * MAX_DEPTH + b"]" * MAX_DEPTH), "nested too deeply"),
        ("clicks", _with_extra(C, b'{"a": ' * MAX_DEPTH + b"1" + b"}" * MAX_DEPTH), "nested too deeply"),
        ("clicks", _with_extra(C, b'"' + b"[" * 100_000 + b'"'), None),  # brackets inside a string are text
        # Escaped quotes and backslashes inside strings: the brackets there are text too.
        ("clicks", _with_extra(C, b'["\\"[\\\\", ' * (MAX_DEPTH - 1) + b"1" + b"]" * (MAX_DEPTH - 1)), None),
        ("clicks", _with_extra(C, b'["\\"[\\\\", ' * MAX_DEPTH + b"1" + b"]" * MAX_DEPTH), "nested too deeply"),
    ],
)
def test_deep_nesting_is_malformed(kind: str, line: bytes, reason: str | None) -> None:
    good = Q if kind == "queries" else C
    for before in (0, 1):  # first in its file, and between good lines (in one Arrow chunk with them)
        events, bad = _outcome(b"\n".join([good] * before + [line, good]) + b"\n", kind)
        too_deep = f"nested too deeply (more than {MAX_DEPTH} levels)"
        assert bad == ([] if reason is None else [(before + 1, too_deep)])
        assert len(events) == before + 1 + (reason is None)


@pytest.mark.parametrize(
    ("token", "reason"),
    [
        (b"NaN", "NaN is not JSON"),
        (b"Infinity", "Infinity is not JSON"),
        (b"-Infinity", "-Infinity is not JSON"),
        (b"[1, NaN]", "NaN is not JSON"),
        # Arrow's JSON reader takes these too; Python's json does not (they are not JSON).
        (b"Inf", "not valid JSON"),
        (b"-Inf", "not valid JSON"),
        (b"-NaN", "not valid JSON"),
        (b'"NaN"', None),
        (b"1e400", None),  # a number Arrow refuses and Python reads as inf: where nothing is read, it is ignored
    ],
)
def test_nan_and_infinity_are_not_json(token: str, reason: str | None) -> None:
    for kind, line in (("queries", Q), ("clicks", C)):
        odd = _with_extra(line, token)
        good, bad = _outcome(b"\n".join([line, odd, line]) + b"\n", kind)
        assert bad == ([] if reason is None else [(2, reason)])
        assert len(good) == (3 if reason is None else 2)


def test_an_object_across_lines_and_two_on_one_line() -> None:
    # Arrow reads JSON values across newlines and several on one line; here the row count still equals the line
    # count, so the rows once went to the wrong lines and two malformed lines became events.
    other = C.replace(b"09", b"07")
    for sep in (b"\r", b" ", b""):
        content = b'{"x":\n' + C[:-1] + b"}}\n" + C + sep + other + b"\n"
        good, bad = _outcome(content, "clicks")
        assert good == [] and [n for n, _ in bad] == [1, 2, 3]
    content = C + b"\n" + C + b" null\n" + C + b" {}\n" + C + b"\n"
    good, bad = _outcome(content, "clicks")
    assert len(good) == 2 and [n for n, _ in bad] == [2, 3]


BOM = "\ufeff".encode()
# Each kind of odd line EVENTS.md lists in "What each kind of bad line becomes", and what it becomes: None is an
# event, else the quarantine reason.
HOSTILE = [
    (b"", "blank line"),
    (b" \t\r", "blank line"),
    (b"\x00" * 100, "holds a NUL byte"),
    (C.replace(b'"a1"', b'"a\x00"'), "holds a NUL byte"),
    (C + b"\x00", "holds a NUL byte"),
    (C.replace(b'"a1"', b'"a\\u0000"'), None),  # an escaped NUL is a character like any other
    (BOM + C, "starts with a byte-order mark"),
    (C.replace(b'"a1"', b'"' + BOM + b'a1"'), None),  # U+FEFF inside a string is text
    (C.replace(b", ", b", " + BOM), "not valid JSON"),
    (C + b"\r", None),  # CR LF: the CR is JSON whitespace
    (C.replace(b", ", b",\r"), None),  # and so is a CR between fields
    (C.replace(b'"a1"', b'"a1\r"'), "not valid JSON"),  # a raw CR inside a string is a control character
    (C.replace(b'"a1"', b'"\xc0\x81"'), "invalid UTF-8"),  # overlong
    (C.replace(b'"a1"', b'"\xe0\x80\xaf"'), "invalid UTF-8"),  # overlong "/"
    (C.replace(b'"a1"', b'"\xed\xa0\x80"'), "invalid UTF-8"),  # a surrogate, UTF-8 encoded
    (C.replace(b'"a1"', b'"\xf4\x90\x80\x80"'), "invalid UTF-8"),  # above U+10FFFF
    (C.replace(b'"a1"', b'"\xe2\x82"'), "invalid UTF-8"),  # truncated sequence
    (C.replace(b'"a1"', b'"\\ud800"'), "ad_id holds an escaped lone surrogate, not Unicode text"),
    (_with_extra(C, b'"\\udc00"'), None),  # where nothing is read
    (C.replace(b'"a1"', b'"\\ud83d\\ude00"'), None),  # an escaped surrogate pair is one character
    (C.replace(b'"ts_us": 1763700000000009', b'"ts_us": 1763700000000009.0'), "ts_us is not an integer"),
    (C.replace(b'"ts_us": 1763700000000009', b'"ts_us": NaN'), "NaN is not JSON"),
    (C.replace(b'"ts_us": 1763700000000009', b'"ts_us": true'), "ts_us is not an integer"),
    (C.replace(b'"ts_us": 1763700000000009', b'"ts_us": "1763700000000009"'), "ts_us is not an integer"),
    (
        C.replace(b'"ts_us": 1763700000000009', b'"ts_us": -1763700000000009'),
        "ts_us differs from the timestamp in click_id",
    ),
    (C.replace(b'"a1"', b"1e400"), "ad_id is not a non-empty string"),
    (C.replace(b'"a1"', b"null"), "ad_id is not a non-empty string"),
    (C.replace(b'"a1"', b'{"a": 1}'), "ad_id is not a non-empty string"),
    (C.replace(b'"ad_id": "a1"', b'"ad_id": "a1", "ad_id": "a2"'), None),  # the last one wins, as in Python's json
    (C[:-1], "not valid JSON"),
    (C + b",", "not valid JSON"),
    (b"[" + C + b"]", "not a JSON object"),
    (b"  " + C, None),
]


def test_what_each_bad_line_becomes() -> None:
    lines = [line for line, _ in HOSTILE]
    # Around the size limit: exactly the limit is a line; one byte more is not (the newline does not count).
    pad = MAX_LINE_BYTES - len(_with_extra(C, b'""'))
    lines += [_with_extra(C, b'"' + b"x" * pad + b'"'), _with_extra(C, b'"' + b"x" * (pad + 1) + b'"')]
    lines += [_with_extra(C, b'"' + b"x" * (pad - 1) + b'"') + b"\r", _with_extra(C, b'"' + b"x" * pad + b'"') + b"\r"]
    expected = [reason for _, reason in HOSTILE] + [None, f"line longer than {MAX_LINE_BYTES} bytes"] * 2
    assert len(lines[-4]) == MAX_LINE_BYTES and len(lines[-1]) == MAX_LINE_BYTES + 1
    good, bad = _outcome(b"\n".join(lines) + b"\n", "clicks")
    assert dict(bad) == {i + 1: reason for i, reason in enumerate(expected) if reason is not None}
    assert len(good) == expected.count(None)


def test_a_process_forked_after_a_parse_parses_too() -> None:
    """PySpark's daemon forks its Python workers, and a worker may fork in turn: a parse in a child of a process that
    parsed (Polars' thread pool started in the parent, not copied by the fork) must not hang. Polars' expression
    engine did (a regex match of the ids, at c2e5780); the UTF-8 check's cast does not."""
    import os
    import signal

    lines = [C.replace(b'"a1"', b'"\xff"') if i % 97 == 0 else C for i in range(5000)]
    content = b"\n".join([*lines, Q.replace(b'"tea"', b'"t\xc3\xa9a"')]) + b"\n"  # 52 bad UTF-8, 1 not a click
    parse_file("parent.jsonl", content, "clicks")
    pid = os.fork()
    if pid == 0:  # the child: parse, and leave with 0 only if it got the same answer
        signal.alarm(60)
        try:
            good, bad = parse_file("child.jsonl", content, "clicks")
            os._exit(0 if (good.num_rows, bad.num_rows) == (4948, 53) else 1)
        except BaseException:
            os._exit(2)
    deadline = time.monotonic() + 90
    while (done := os.waitpid(pid, os.WNOHANG)) == (0, 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    if done == (0, 0):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise AssertionError("the forked child's parse hung")
    code = os.waitstatus_to_exitcode(done[1])
    assert code != -signal.SIGALRM, "the forked child's parse hung (stopped by its 60 s alarm)"
    assert code == 0, code


@pytest.mark.parametrize("stream_block", [None, 1024])
def test_a_carriage_return_inside_a_line_never_starts_one_of_arrows_blocks(stream_block: int | None) -> None:
    """Arrow's chunker cuts its blocks at a CR as well as at a newline, so a line holding ``\\rnull\\r`` could start a
    block with a top-level null, on which pyarrow 26 crashes (SIGSEGV) with a nested schema. Found by a reviewer with
    a 67 MB file (a chunk longer than a 64 MiB read); here Arrow's block is made 1,024 bytes so that a short file
    reaches the same cut. The parse runs in a child process: a crash must fail the test, not the test run."""
    import os
    import subprocess
    import sys

    code = f"""
import pyarrow.json as pj
from photon.logs import parse
from tests.unit.test_parse import Q
parse._READ = pj.ReadOptions(use_threads=False, block_size=1024)
if {stream_block!r}:
    parse.STREAM_BLOCK = {stream_block!r}
pad = b'{{"pad": "' + b"x" * 1012 + b'"}}'  # 1,023 bytes: the CR after it ends a block
content = pad + b"\\rnull\\r" + Q + b"\\n" + Q + b"\\n"
good, bad = parse.parse_file("cr.jsonl", content, "queries")
ref_good, ref_bad = parse.parse_file_by_line("cr.jsonl", content, "queries")
assert bad.equals(ref_bad) and good.to_pylist() == ref_good.to_pylist(), (good, bad)
print(good.num_rows, bad.num_rows)
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    argv = [sys.executable, "-c", code]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, check=False)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.split() == ["1", "1"]


@pytest.mark.parametrize("two_objects_first", [False, True])
def test_a_file_of_refused_lines_costs_arrow_reads_in_proportion_to_its_size(two_objects_first: bool) -> None:
    """Every other line a wrong type (Arrow refuses it; no byte screen sees it): each refusal costs a read again of
    what came before it in its block, so past a budget the rest of the file goes to the reference path. A 40 MB
    file of these took 160 s before the budget. With a line of two objects first, the stream gives up at once and
    the same holds for the reads by chunks."""
    from photon.logs import parse

    wrong_type = C.replace(b'"ts_us": 1763700000000009', b'"ts_us": "1763700000000009"')
    lines = [C, wrong_type] * 5_000
    if two_objects_first:
        lines.insert(0, C + b" " + C)
    content = b"\n".join(lines) + b"\n"
    calls: list[int] = []
    with pytest.MonkeyPatch.context() as mp:
        for reader in ("open_json", "read_json"):
            real = getattr(parse.pj, reader)
            mp.setattr(parse.pj, reader, lambda *a, real=real, **k: calls.append(1) or real(*a, **k))
        good, bad = _same("refused.jsonl", content, "clicks")
    assert (good, bad) == (5_000, 5_000 + two_objects_first)
    budget = parse.MAX_REFUSALS + len(lines) // parse.REFUSALS_PER_LINES
    assert len(calls) <= 3 * budget + len(lines) // CHUNK_LINES + 2, len(calls)


@pytest.mark.parametrize("large", [False, True])
def test_an_ids_timestamp_part_is_its_digits_after_the_last_dash(large: bool) -> None:
    """The screen reads as many of an id's last characters as its timestamp has digits, as a number: with the pid's
    "-" among them ("2-3" for 173) they are not that timestamp, nor are fewer digits after the dash, nor more."""
    import numpy as np

    from photon.logs.parse import _sure_ids

    ids = ["1.2.3.4-2-3", "1.2.3.4-2-173", "1.2.3.4-12-3", "1.2.3.4-1-73", "1.2.3.4-1-1173", "1.2.3.4-22-1"]
    ts = np.array([173, 173, 123, 173, 173, 221], np.int64)
    sure = _sure_ids(pa.array(ids, pa.large_string() if large else pa.string()), ts)
    assert sure.tolist() == [False, True, False, False, False, False]
    # And a whole file: the click whose id's timestamp part differs from its ts_us is quarantined by the reference.
    lines = [
        b'{"click_id": "%s", "ts_us": %d, "query_id": "1.2.3.4-5-6", "ad_id": "a1"}' % (i.encode(), t)
        for i, t in zip(ids, ts.tolist(), strict=True)
    ]
    good, bad = parse_file("f", b"\n".join(lines) + b"\n", "clicks")
    assert good.column("click_id").to_pylist() == ["1.2.3.4-2-173"]
    assert bad.num_rows == 5


@pytest.mark.parametrize("tried", [4, -1])
def test_an_id_whose_part_goes_on_from_a_good_part_is_not_taken_for_it(
    tried: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The id check tries a sample's parts on every row by their start: a row that starts with a good part and goes
    on before its timestamp ("1.2.3.4-5x", "1.2.3.4-5-") has a part of its own, which decides it; so too where each
    part is matched once (no parts tried)."""
    import numpy as np

    from photon.logs import parse

    monkeypatch.setattr(parse, "_PARTS_TRIED", tried)
    monkeypatch.setattr(parse, "_PARTS_SAMPLE", 1)  # the sample: the first row only, whose part is good
    ts = 1_763_700_000_000_000
    ids = [f"1.2.3.4-5-{ts}", f"1.2.3.4-5x-{ts}", f"1.2.3.4-5--{ts}", f"1.2.3.4-56-{ts}", f"1.2.3.4-5-{ts}"]
    sure = parse._sure_ids(pa.array(ids), np.full(len(ids), ts, np.int64))
    assert sure.tolist() == [True, False, False, True, True]


@pytest.mark.parametrize("every", [1_000, 200, 3])
def test_rows_the_screen_doubts_leave_arrows_chunks_by_slices_or_a_filter(every: int) -> None:
    """Lines Arrow reads but the screen doubts (an id not canonical, a ts its id does not hold) leave their chunk:
    a few by zero-copy slices around them, many (every third line) by a filter; either way each line ends up once,
    an event or a quarantine record, in the reference's answer."""
    bad_id = C.replace(b'"10.1.2.3-7-1763700000000009"', b'"not-an-id"')
    bad_ts = C.replace(b'"ts_us": 1763700000000009', b'"ts_us": 1763700000000008')
    lines = [C if i % every else (bad_id if i % 2 else bad_ts) for i in range(1, 6_001)]
    doubted = sum(1 for line in lines if line != C)
    good, bad = _same("doubted.jsonl", b"\n".join(lines) + b"\n", "clicks")
    assert (good, bad) == (6_000 - doubted, doubted)
