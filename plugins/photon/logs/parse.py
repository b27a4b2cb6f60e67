"""Parsing log lines into events, or into quarantine records with a reason. Runs in Spark executors (one call per
input file's bytes) and returns Arrow tables.

Parsing is total: every line becomes an event or a quarantine record with a reason, never an exception (a line
that makes the reference raise anything unforeseen is quarantined as "unexpected parser error: <type>").

Two paths give the same answer. ``parse_line``-level functions (``parse_query``, ``parse_click``) are the reference:
plain ``json`` and explicit checks, with the reason a line is malformed. ``parse_file`` streams the file's lines
through Arrow's JSON reader (``_Lines``) and screens the result with vectorised checks; a line Arrow refuses, a block
whose row count differs from its line count, an empty or over-long line, and every row the screen doubts go through
the reference path line by line. Arrow is strict (a number where a string belongs, a float or an integer outside
int64 for an integer, or a duplicate key fail the block), so a row it accepts and the screen passes is one the
reference accepts with the same values. Where Arrow is laxer than the reference, a vectorised byte screen sends the
line to the reference before Arrow sees it (``_suspect_lines``, ``_invalid_utf8``): bytes that are not UTF-8 (Arrow
copies them into its strings unchecked), nesting deeper than ``MAX_DEPTH`` and ``NaN``/``Infinity`` (and Arrow's own
``Inf``, ``-NaN``) in fields nobody reads, which Arrow skips, and a line that may go on into the next (Arrow reads one
object across lines, and two on one line, so the row count alone does not prove that rows and lines match). Lines
whose quotes and brackets are out of step with an event's (``_out_of_step``: a value of the wrong type, which Arrow
would refuse, costing a read again of its block) go to the reference too, for speed only.
Quarantine records always come from the reference. Tests hold the two paths equal on every malformed kind the
generator makes, on every kind EVENTS.md lists, and on Hypothesis's random lines
(tests/unit/test_parse_properties.py).
"""

from __future__ import annotations

import collections
import json
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj

from photon.logs.ids import ID_REGEX
from photon.logs.schemas import MAX_LINE_BYTES, RAW_CAP_BYTES

_ID = re.compile(ID_REGEX)

QUERY_FIELDS = pa.schema(
    [
        ("query_id", pa.string()),
        ("ts_us", pa.int64()),
        ("user_id", pa.string()),
        ("query_text", pa.string()),
        ("country", pa.string()),
        (
            "ads",
            pa.list_(pa.struct([("ad_id", pa.string()), ("advertiser_id", pa.string()), ("bid_micros", pa.int64())])),
        ),
    ]
)
CLICK_FIELDS = pa.schema(
    [
        ("click_id", pa.string()),
        ("ts_us", pa.int64()),
        ("query_id", pa.string()),
        ("ad_id", pa.string()),
    ]
)
BAD_FIELDS = pa.schema(
    [
        ("file", pa.string()),
        ("line", pa.int64()),
        ("raw", pa.binary()),
        ("raw_bytes", pa.int64()),
        ("reason", pa.string()),
    ]
)


# JSON nesting a line may have: the object itself is one level, a query's ads two more. Deeper lines are malformed
# (Python's json recurses once per level; Arrow has no limit).
MAX_DEPTH = 64
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class Malformed(ValueError):
    pass


class _OutOfRange:
    """What the reference reads for a JSON integer outside int64 (``int()`` of more than 4,300 digits would raise)."""


_OUT_OF_RANGE = _OutOfRange()


def _json_int(s: str) -> int | _OutOfRange:
    if len(s) > 20:  # longer than "-9223372036854775808"
        return _OUT_OF_RANGE
    v = int(s)
    return v if _INT64_MIN <= v <= _INT64_MAX else _OUT_OF_RANGE


def _no_constant(name: str) -> None:
    raise Malformed(f"{name} is not JSON")  # Python's json would read NaN, Infinity and -Infinity as floats


def _int(v: Any, what: str) -> int:
    if v is _OUT_OF_RANGE:
        raise Malformed(f"{what} is out of range")
    if not isinstance(v, int) or isinstance(v, bool):
        raise Malformed(f"{what} is not an integer")
    return v


def _str(v: Any, what: str) -> str:
    if not isinstance(v, str) or not v:
        raise Malformed(f"{what} is not a non-empty string")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise Malformed(f"{what} holds an escaped lone surrogate, not Unicode text") from None
    return v


def _event_id(v: Any, what: str, ts_us: int | None = None) -> str:
    s = _str(v, what)
    if not _ID.fullmatch(s):
        raise Malformed(f"{what} is not a canonical <ipv4>-<pid>-<ts_us>")
    parts = s.split("-")[0].split(".")
    if any(int(p) > 255 for p in parts) or int(s.split("-")[1]) > 2**32 - 1:
        raise Malformed(f"{what} is out of range")
    if ts_us is not None and int(s.rsplit("-", 1)[1]) != ts_us:
        raise Malformed(f"ts_us differs from the timestamp in {what}")
    return s


def _depth(line: bytes) -> int:
    """The deepest nesting of ``[`` and ``{`` outside strings: exact for valid JSON, some number for anything else."""
    b = np.frombuffer(line, np.uint8)
    if not len(b):
        return 0
    at = np.arange(len(b))
    backslashes = at - np.maximum.accumulate(np.where(b == 92, -1, at))  # the run of backslashes ending at each byte
    escaped = np.zeros(len(b), bool)
    escaped[1:] = backslashes[:-1] % 2 == 1
    in_string = np.cumsum((b == 34) & ~escaped) % 2 == 1
    step = ((b | 32) == 123).astype(np.int64) - ((b | 32) == 125)  # [ or {, ] or }
    return int(np.cumsum(np.where(in_string, 0, step)).max())


def _object(line: bytes) -> dict[str, Any]:
    if len(line) > MAX_LINE_BYTES:
        raise Malformed(f"line longer than {MAX_LINE_BYTES} bytes")
    if not line.strip(b" \t\r"):
        raise Malformed("blank line")
    if b"\x00" in line:
        raise Malformed("holds a NUL byte")
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        raise Malformed("invalid UTF-8") from None
    if text.startswith("\ufeff"):
        raise Malformed("starts with a byte-order mark")
    too_deep = f"nested too deeply (more than {MAX_DEPTH} levels)"
    if line.count(b"[") + line.count(b"{") > MAX_DEPTH and _depth(line) > MAX_DEPTH:
        raise Malformed(too_deep)
    try:
        obj = json.loads(text, parse_int=_json_int, parse_constant=_no_constant)
    except Malformed:
        raise
    except RecursionError:  # not at MAX_DEPTH, unless the caller's stack is nearly full already
        raise Malformed(too_deep) from None
    except ValueError:
        raise Malformed("not valid JSON") from None
    if not isinstance(obj, dict):
        raise Malformed("not a JSON object")
    return obj


def parse_query(line: bytes) -> dict[str, Any]:
    o = _object(line)
    ts = _int(o.get("ts_us"), "ts_us")
    ads = o.get("ads")
    if not isinstance(ads, list) or not ads:
        raise Malformed("ads is not a non-empty list")
    parsed_ads = []
    for ad in ads:
        if not isinstance(ad, dict):
            raise Malformed("an ad is not an object")
        parsed_ads.append(
            {
                "ad_id": _str(ad.get("ad_id"), "ad_id"),
                "advertiser_id": _str(ad.get("advertiser_id"), "advertiser_id"),
                "bid_micros": _int(ad.get("bid_micros"), "bid_micros"),
            }
        )
    return {
        "query_id": _event_id(o.get("query_id"), "query_id", ts),
        "ts_us": ts,
        "user_id": _str(o.get("user_id"), "user_id"),
        "query_text": _str(o.get("query_text"), "query_text"),
        "country": _str(o.get("country"), "country"),
        "ads": parsed_ads,
    }


def parse_click(line: bytes) -> dict[str, Any]:
    o = _object(line)
    ts = _int(o.get("ts_us"), "ts_us")
    return {
        "click_id": _event_id(o.get("click_id"), "click_id", ts),
        "ts_us": ts,
        "query_id": _event_id(o.get("query_id"), "query_id"),
        "ad_id": _str(o.get("ad_id"), "ad_id"),
    }


def parse_file_by_line(name: str, content: bytes, kind: str) -> tuple[pa.Table, pa.Table]:
    """The reference path: every line through ``json`` and the explicit checks."""
    lines = content.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    good, bad = _by_line_numbers(name, kind, lines, range(len(lines)))
    return _good_table(good, kind), pa.table(bad, schema=BAD_FIELDS)


def _by_line_numbers(
    name: str, kind: str, lines: list[bytes], index: Sequence[int]
) -> tuple[list[dict[str, Any]], dict[str, list[Any]]]:
    """Reference-parse ``lines``; ``index`` holds their 0-based positions in the file (reported 1-based)."""
    parser = parse_query if kind == "queries" else parse_click
    good: list[dict[str, Any]] = []
    bad: dict[str, list[Any]] = {f.name: [] for f in BAD_FIELDS}
    for i, line in zip(index, lines, strict=True):
        number = i + 1
        try:
            good.append(parser(line))
            continue
        except Malformed as exc:
            reason = str(exc)
        except Exception as exc:  # a parser bug must cost one line, not the file (tests hold this never happens)
            reason = f"unexpected parser error: {type(exc).__name__}"
        bad["file"].append(name)
        bad["line"].append(number)
        bad["raw"].append(line[:RAW_CAP_BYTES])
        bad["raw_bytes"].append(len(line))
        bad["reason"].append(reason)
    return good, bad


def _good_table(rows: list[dict[str, Any]], kind: str) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=QUERY_FIELDS if kind == "queries" else CLICK_FIELDS)


STREAM_BLOCK = 1 << 18  # bytes per block of Arrow's streaming reader: a refused block's lines before the culprit are
# read twice, a block costs some fixed work
CHUNK_LINES = 2048  # lines per Arrow read where the stream cannot vouch for its rows (see _Lines)
SUB_CHUNK_LINES = 8  # below this, a range refused without a named line goes line by line
MAX_REFUSALS, REFUSALS_PER_LINES = 64, 256  # refusals a file may cost: 64, and one per 256 lines (see _Lines)
_READ = pj.ReadOptions(use_threads=False, block_size=1 << 26)
_PARSE = {
    kind: pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore", newlines_in_values=False)
    for kind, schema in (("queries", QUERY_FIELDS), ("clicks", CLICK_FIELDS))
}


def _one(col: pa.ChunkedArray | pa.Array) -> pa.Array:
    """The column as one array: its only chunk as it is (``combine_chunks`` would copy it)."""
    if isinstance(col, pa.Array):
        return col
    return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()


def _non_empty(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    return pc.fill_null(pc.greater(pc.binary_length(col), 0), False).to_numpy(zero_copy_only=False)


_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
# An id that is canonical with every part surely in range: octets up to 255, a pid of at most 9 digits (a 10-digit
# pid may exceed 2^32 - 1: the reference path decides those). One regex match, no captures.
_PART = rf"{_OCTET}\.{_OCTET}\.{_OCTET}\.{_OCTET}-(0|[1-9][0-9]{{0,8}})"  # an id before its timestamp's "-"
SURE_ID = rf"^{_PART}-(0|[1-9][0-9]{{0,17}})$"
_POWERS = 10 ** np.arange(1, 19, dtype=np.int64)


# SURE_ID up to the "-" before the timestamp. Today's timestamps (years 2001 to 2286) have 16 digits: an id that ends
# in "-" and 16 digits, the first not 0, is surely valid exactly when what comes before that "-" matches _SURE_PREFIX.
_SURE_PREFIX = rf"^{_PART}$"
_TS_DIGITS = 16
_PARTS_SAMPLE, _PARTS_DISTINCT = 256, 8  # parts matched each, not once, where a sample's are over 1 in 8 distinct
_PARTS_TRIED = 4  # a sample's parts tried each against every row, where it holds at most this many
_SURE_PART = re.compile(_PART.encode())  # _SURE_PREFIX for one part, in Python
_TAIL = 24  # bytes read at an id's end as three 64-bit words: "-" the last byte of the first, 16 digits in two more
_U64 = np.uint64
_ZEROS, _NIBBLES, _SIXES = _U64(0x3030303030303030), _U64(0xF0F0F0F0F0F0F0F0), _U64(0x0606060606060606)
_PAIRS, _QUADS, _OCTS = _U64(0x00FF00FF00FF00FF), _U64(0x0000FFFF0000FFFF), _U64(0xFFFFFFFF)


def _eight_digits(w: np.ndarray) -> np.ndarray:
    """Per word: each of its 8 bytes is an ASCII digit (high nibble 3, and no carry out of the low one adding 6)."""
    return ((w & _NIBBLES) == _ZEROS) & (((w + _SIXES) & _NIBBLES) == _ZEROS)


def _eight_digits_value(w: np.ndarray) -> np.ndarray:
    """Per word of 8 ASCII digits, the first in the lowest byte: their number (pairs, then fours, then all eight)."""
    v = w - _ZEROS
    v = (v * _U64(10) + (v >> _U64(8))) & _PAIRS
    v = (v * _U64(100) + (v >> _U64(16))) & _QUADS
    return (v * _U64(10000) + (v >> _U64(32))) & _OCTS


def _sure_ids(col: pa.ChunkedArray | pa.Array, ts: np.ndarray | None = None) -> np.ndarray:
    """Per row: the id is surely valid (see ``SURE_ID``) and, given ``ts``, its timestamp part is exactly ``ts``.

    The ids of a file come from a few servers, so most share their part before the timestamp: each distinct part
    is matched once (a regex match of each id cost 90 ns, for 20,000 ids more than Arrow's parse of a click file's
    ids). An id's last 24 bytes are read as three words: a "-" and 16 digits, checked and read as a number at once.
    Ids not ending so (other lengths of timestamp, no "-", fewer bytes) take ``_sure_ids_by_regex``."""
    arr = _one(col)
    n = len(arr)
    if not n:
        return np.zeros(0, bool)
    ids = arr.view(pa.large_binary() if pa.types.is_large_string(arr.type) else pa.binary())
    if arr.null_count:
        ids = pc.fill_null(ids, b"")
    lengths = pc.binary_length(ids).to_numpy()
    long_enough = lengths >= _TAIL
    padded = ids if long_enough.all() else pc.if_else(pa.array(long_enough), ids, pa.scalar(b" " * _TAIL, ids.type))
    tail = pc.binary_slice(padded, -_TAIL)  # exactly _TAIL bytes a row, one after the other
    width = np.int64 if pa.types.is_large_binary(tail.type) else np.int32
    first = int(np.frombuffer(tail.buffers()[1], width)[tail.offset])
    words = np.frombuffer(tail.buffers()[2], np.uint8)[first : first + n * _TAIL].view("<u8").reshape(n, 3)
    high, low = words[:, 1], words[:, 2]
    ok = (
        ((words[:, 0] >> _U64(56)) == _U64(45))  # the "-"
        & ((high & _U64(0xFF)) != _U64(48))  # no leading 0
        & _eight_digits(high)
        & _eight_digits(low)
    )
    # (a null, filled with "", was padded with blanks: never fast)
    fast = ok.copy()
    if np.count_nonzero(fast) < n // 2:  # timestamps of other lengths, mostly: this much was spent for nothing
        return _sure_ids_by_regex(arr, ts)
    if ts is not None:
        ok &= (_eight_digits_value(high) * _U64(100_000_000) + _eight_digits_value(low)).view(np.int64) == ts
    ok &= _sure_parts(ids, lengths, fast)
    rest = np.flatnonzero(~fast)
    if len(rest):
        ok[rest] = _sure_ids_by_regex(arr.take(pa.array(rest)), None if ts is None else ts[rest])
    return ok


def _sure_parts(ids: pa.Array, lengths: np.ndarray, fast: np.ndarray) -> np.ndarray:
    """Per row of ``fast`` (an id ending in "-" and 16 digits): its part before that "-" matches ``_SURE_PREFIX``.

    A file's ids come mostly from one or two servers: the few parts of a sample of rows are tried first, each found
    by the rows that start with it and are as long as it and a timestamp (no copy of the parts, no hashing), then
    the part of a row they left, up to ``_PARTS_TRIED`` parts; the rows left after that, or all of them where the
    sample holds more parts, are decided by ``_parts_matched``."""
    n = len(ids)
    head = _parts_of(ids.slice(0, _PARTS_SAMPLE)).to_pylist()
    counts = collections.Counter(part for part, f in zip(head, fast[:_PARTS_SAMPLE].tolist(), strict=True) if f)
    if len(counts) > _PARTS_TRIED:
        return _parts_matched(_parts_of(ids))
    queue = sorted(counts, key=counts.__getitem__)  # the sample's most frequent part last: tried first
    sure, found = np.zeros(n, bool), np.zeros(n, bool)
    for _ in range(_PARTS_TRIED):
        if not queue:  # the sample's parts are tried: next, the part of a row they left, if many are left
            left = np.flatnonzero(fast & ~found)
            if len(left) * _PARTS_DISTINCT <= n:
                break
            queue.append(ids[int(left[0])].as_py()[: -(_TS_DIGITS + 1)])
        part = queue.pop()
        try:
            text = part.decode("utf-8")
        except UnicodeDecodeError:  # not a part, then: its rows are left to _parts_matched
            break
        rows = pc.starts_with(ids, text).to_numpy(zero_copy_only=False) & (lengths == len(part) + _TS_DIGITS + 1)
        found |= rows
        if _SURE_PART.fullmatch(part):
            sure |= rows
        if np.count_nonzero(rows) * _PARTS_TRIED < n:  # a part of few rows: the rest are spread wider, for a dictionary
            break
    left = np.flatnonzero(fast & ~found)
    if 2 * len(left) > n:  # most rows: all of them, rather than a copy of most
        sure[left] = _parts_matched(_parts_of(ids))[left]
    elif len(left):
        sure[left] = _parts_matched(_parts_of(ids.take(pa.array(left))))
    return sure


def _parts_of(ids: pa.Array) -> pa.Array:
    """Each id's bytes before its last 17 (the "-" and 16 digits of a fast row's timestamp)."""
    return pc.binary_slice(ids, 0, -(_TS_DIGITS + 1))


def _parts_matched(parts: pa.Array) -> np.ndarray:
    """Per part: it matches ``_SURE_PREFIX``. Each distinct part is matched once (Arrow's dictionary), unless a
    sample's are mostly distinct (ids from thousands of servers): then each row's, for less than the dictionary."""
    sample = parts.slice(0, _PARTS_SAMPLE).to_pylist()
    if len(set(sample)) * _PARTS_DISTINCT > len(sample):
        return pc.fill_null(pc.match_substring_regex(parts, _SURE_PREFIX), False).to_numpy(zero_copy_only=False)
    encoded = pc.dictionary_encode(parts)
    sure = pc.fill_null(pc.match_substring_regex(encoded.dictionary, _SURE_PREFIX), False)
    return sure.to_numpy(zero_copy_only=False)[pc.fill_null(encoded.indices, 0).to_numpy()]


def _sure_ids_by_regex(col: pa.ChunkedArray | pa.Array, ts: np.ndarray | None = None) -> np.ndarray:
    """``_sure_ids`` for any id: a regex match each, then the timestamp part read as a number."""
    arr = _one(col)
    ok = pc.fill_null(pc.match_substring_regex(arr, SURE_ID), False).to_numpy(zero_copy_only=False)
    if ts is None or not ok.any():
        return ok
    # The timestamp part is the digits after the last "-" (the match holds the shape): as many as ts has, after a
    # "-" within the id, read as a number (a digit a column over the rows, Horner's rule) and compared with ts. Each of
    # them must be a digit: with the pid's "-" among them, "2-3" would read as 173.
    width = np.int64 if pa.types.is_large_string(arr.type) else np.int32
    offsets = np.frombuffer(arr.buffers()[1], width)[arr.offset : arr.offset + len(arr) + 1].astype(np.int64)
    data = np.frombuffer(arr.buffers()[2], np.uint8)
    digits = 1 + np.searchsorted(_POWERS, ts, side="right")
    ok &= (ts >= 0) & (digits <= 18)  # SURE_ID's at most; the sums below stay within int64
    first = offsets[1:] - digits
    ok &= first > offsets[:-1]
    first[~ok] = 1
    ok &= data[first - 1] == 45
    for d in np.unique(digits[ok]).tolist():  # one length, as a rule
        rows = np.flatnonzero(ok & (digits == d))
        at = first[rows]
        byte = data[at]
        value, low = byte.astype(np.int64), byte
        for k in range(1, d):
            byte = data[at + k]
            value *= 10
            value += byte
            low = np.minimum(low, byte)
        value -= 48 * ((10**d - 1) // 9)  # each byte's "0"
        ok[rows[(value != ts[rows]) | (low < 48)]] = False
    return ok


def _screen(t: pa.Table, kind: str) -> np.ndarray:
    """Rows of an Arrow-parsed chunk that certainly pass the reference checks (False means: ask the reference)."""
    ts = t.column("ts_us")
    ok = pc.is_valid(ts).to_numpy(zero_copy_only=False)
    ts_np = pc.fill_null(ts, 0).to_numpy()
    own, other = ("query_id", None) if kind == "queries" else ("click_id", "query_id")
    ok &= _sure_ids(t.column(own), ts_np)
    if other:
        ok &= _sure_ids(t.column(other))
    for name in ("ad_id",) if kind == "clicks" else ("user_id", "query_text", "country"):
        ok &= _non_empty(t.column(name))
    if kind == "queries":
        ads = _one(t.column("ads"))
        ok &= pc.fill_null(pc.greater(pc.list_value_length(ads), 0), False).to_numpy(zero_copy_only=False)
        flat = pc.list_flatten(ads)
        if len(flat):
            ad_ok = (
                pc.is_valid(flat).to_numpy(zero_copy_only=False)
                & _non_empty(pc.struct_field(flat, "ad_id"))
                & _non_empty(pc.struct_field(flat, "advertiser_id"))
                & pc.is_valid(pc.struct_field(flat, "bid_micros")).to_numpy(zero_copy_only=False)
            )
            parents = pc.list_parent_indices(ads).to_numpy()
            ok[np.unique(parents[~ad_ok])] = False
    return ok


_ROW = re.compile(r" in row (\d+)")


def _is_lead(b: np.ndarray) -> np.ndarray:
    return (b == 58) | (b == 44) | (b == 91)  # : , [


def _is_blank(b: np.ndarray) -> np.ndarray:
    return (b == 32) | (b == 9) | (b == 13)  # space, tab, CR


SCAN_BYTES = 1 << 18  # a multiple of 64 (the bracket blocks); its temporaries stay in the CPU's cache


def _scan(
    buf: np.ndarray, escapes: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The byte passes parsing needs, block by block: where the newlines are; one bit per byte (packed, byte i of the
    file bit i of its 64-bit word) for ``[`` and ``{``, for ``"`` and, if ``escapes``, for ``\\`` (most files hold
    none: UTF-8 as it is, not escaped); where the bytes ``I`` to ``N`` are; and where bytes that no UTF-8 text holds
    (0xF5 to 0xFF) are. A block's temporaries are reused while still in cache: a pass over the whole file at once
    costs twice as much (each temporary a fresh allocation, read back from memory)."""
    newlines, brackets, quotes, backslashes, letters, never = [], [], [], [], [], []
    for at in range(0, len(buf), SCAN_BYTES):
        block = buf[at : at + SCAN_BYTES]
        # Newlines and the bytes I to N in one pass of positions (each pass of them costs as much as three
        # comparisons): the byte less 73 is 0 to 5 for I to N, and 193 (mod 256) for a newline.
        shifted = block - 73
        found = np.flatnonzero((shifted <= 5) | (shifted == 193))
        is_newline = shifted[found] == 193
        newlines.append(found[is_newline] + at)
        letters.append(found[~is_newline] + at)
        brackets.append(np.packbits((block | 32) == 123, bitorder="little"))  # [ or {
        quotes.append(np.packbits(block == 34, bitorder="little"))
        if escapes:
            backslashes.append(np.packbits(block == 92, bitorder="little"))
        if block.max() >= 0xF5:  # rare: a max costs a fraction of a comparison and its positions
            never.append(np.flatnonzero(block >= 0xF5) + at)
    return (
        np.concatenate(newlines),
        _words(np.concatenate(brackets)),
        _words(np.concatenate(quotes)),
        _words(np.concatenate(backslashes)) if escapes else np.zeros(0, np.uint64),
        np.concatenate(letters),
        np.concatenate(never) if never else np.zeros(0, np.int64),
    )


def _words(bits: np.ndarray) -> np.ndarray:
    """Packed bits as 64-bit words (one word of zeros past the end, so that a count may start at the end)."""
    return np.concatenate((bits, np.zeros(-len(bits) % 8 + 8, np.uint8))).view(np.uint64)


def _per_line(ends: np.ndarray, *words: np.ndarray) -> list[np.ndarray]:
    """Per line, the set bits of each of ``words`` (from ``_scan``) within it. Lines lie back to back, each from
    right after the newline ending the one before (a newline sets no bit), so a line's count is the count up to its
    end less the count up to the previous line's: one running sum by word, and one word masked below each end."""
    word = ends >> 6
    below = (np.uint64(1) << (ends & 63).astype(np.uint64)) - np.uint64(1)
    counts = []
    for w in words:
        cum = np.concatenate(([0], np.cumsum(np.bitwise_count(w), dtype=np.int64)))
        counts.append(np.diff(cum[word] + np.bitwise_count(w[word] & below), prepend=0))
    return counts


def _suspect_lines(
    buf: np.ndarray, starts: np.ndarray, ends: np.ndarray, opening: np.ndarray, letter: np.ndarray
) -> np.ndarray:
    """Per line: whether Arrow might read it otherwise than the reference, judged from bytes alone (strings too, so
    a few good lines are suspected as well: they just take the reference path). Vectorised, no per-line Python.

    - More than ``MAX_DEPTH`` ``[`` and ``{`` (``opening``, per line): it may nest deeper than the reference allows
      (Arrow skips any depth in a field nobody reads).
    - Ending in ``:``, ``,`` or ``[`` (blanks aside): an object may go on into the next line, which Arrow reads as
      one row. Every line Arrow gets starts with ``{``, which may only follow those, so no other line can be
      continued; then each line starts its own row, and a line holding a second value after its object (``} {``,
      ``}null``) makes more rows than lines: the chunk is refused, not misread.
    - ``N`` or ``I`` after ``:``, ``,``, ``[`` or ``-`` (blanks aside): ``NaN``, ``Infinity`` or Arrow's ``Inf``,
      which Arrow reads (and skips, in a field nobody reads) and the reference refuses.

    ``letter`` comes from ``_scan``.
    """
    suspect = opening > MAX_DEPTH
    last, before = buf[np.maximum(ends - 1, 0)], buf[np.maximum(ends - 2, 0)]
    suspect |= _is_lead(last) | (_is_blank(last) & (_is_lead(before) | _is_blank(before)))
    letter = letter[(buf[letter] == 73) | (buf[letter] == 78)]
    one, two = buf[np.maximum(letter - 1, 0)], buf[np.maximum(letter - 2, 0)]
    lead1, lead2 = _is_lead(one) | (one == 45), _is_lead(two) | (two == 45)
    constant = letter[lead1 | (_is_blank(one) & (lead2 | _is_blank(two)))]
    suspect[np.searchsorted(starts, constant, side="right") - 1] = True
    return suspect


# Where a line's bytes are laid out as the contract's events are (its fields and no others, no quote or bracket
# inside a string), its quotes (escaped ones aside) and its opening brackets are in step: a click has 4 keys and 3
# string values, 14 quotes, and one "{"; a query 6 keys and 4 strings, 20 quotes, for "{" and "[", and each ad 3 keys
# and 2 strings, 10 quotes, for its "{". A value of the wrong type (a number quoted, an id unquoted, a string where
# a list belongs) puts them out of step: Arrow would refuse the line, and its block be read again around it (1-1.5
# ms a refusal, a third of a click file's parse beyond Arrow's); such lines go to the reference path at once.
# Lines laid out otherwise (a quote escaped, a bracket in a text, a field the contract does not name) are good too:
# where more than _shape_budget's lines of a file are out of step, its producer lays lines out its own way, and all
# of them go to Arrow as before.
SHAPE_BUDGET_LINES, SHAPE_BUDGET_PER = 16, 256


def _shape_budget(lines: int) -> int:
    """Good lines out of step a file may send to the reference path (24 us each, against a refusal's 1-1.5 ms in a
    file of thousands of lines): SHAPE_BUDGET_LINES and one in SHAPE_BUDGET_PER, but at most one in 16 in a small
    file, whose refusals cost little (a reviewer's 64-line files with 16 such lines parsed 1.45x slower)."""
    return min(SHAPE_BUDGET_LINES, lines // 16) + lines // SHAPE_BUDGET_PER


def _unescaped(quotes: np.ndarray, backslashes: np.ndarray) -> np.ndarray:
    """``_scan``'s quote words without the quotes right after a backslash (as a rule escaped: not counted)."""
    if not backslashes.any():
        return quotes
    after = (backslashes << np.uint64(1)) | np.concatenate(([np.uint64(0)], backslashes[:-1] >> np.uint64(63)))
    return quotes & ~after


def _out_of_step(kind: str, opening: np.ndarray, quoted: np.ndarray) -> np.ndarray:
    """Per line: its quotes (``quoted``, escaped ones aside) and opening brackets are not in step as an event's are
    (see ``_shape_budget``)."""
    return (quoted != 14) | (opening != 1) if kind == "clicks" else quoted != 10 * opening


def _ends_in_brace(buf: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Per line: its last byte, or the one before a trailing CR, is ``}`` (any other line that holds an object
    has blanks after it, which the reference path handles)."""
    last = buf[np.maximum(ends - 1, 0)]
    return (last == 125) | ((last == 13) & (buf[np.maximum(ends - 2, 0)] == 125))


# A file that fails is cut into UTF8_FIRST_FAN_OUT parts, and a part that fails into UTF8_FAN_OUT, each validated
# again: a cast costs about 15 us besides its bytes, and a bad line or two are usual.
UTF8_FIRST_FAN_OUT = 16
UTF8_FAN_OUT = 4
UTF8_BY_LINE = 64  # a failing range this short is decided line by line


def _invalid_utf8(content: bytes, starts: np.ndarray, ends: np.ndarray, never: np.ndarray | None = None) -> np.ndarray:
    """Per line: not valid UTF-8. Lines holding a byte at ``never`` (positions of bytes no UTF-8 text holds) are bad
    at once; the runs of lines between them are validated each at once, and a run that fails is cut into parts
    validated again, down to a few lines that Python's decoder decides one by one. A bad line costs a few passes
    over ever shorter ranges around it, unless a byte of it gave it away. Polars validates with simdutf8: over ten
    times as fast as Arrow's validator on multi-byte text. (A cast only: Polars' expressions hang in a process forked
    after they ran.)"""
    import polars as pl

    bad = np.zeros(len(starts), bool)
    if not len(starts):
        return bad
    if never is not None and len(never):
        bad[np.searchsorted(starts, never, side="right") - 1] = True
    whole = pa.py_buffer(content)
    offsets = np.append(starts, ends[-1]).astype(np.int64)  # a line and its newline

    def check(a: int, b: int, fan_out: int) -> None:
        # The range's lines as one value over their own bytes only: whole lines are valid together exactly when
        # each is (a newline is never part of a multi-byte character), and one value costs a fraction of a value a
        # line; a cast of a slice of an array over the whole file would validate all of its bytes each time.
        lo, hi = int(offsets[a]), int(offsets[b])
        at = pa.py_buffer(np.array([0, hi - lo], np.int64))
        one = pa.Array.from_buffers(pa.large_binary(), 1, [None, at, whole.slice(lo, hi - lo)])
        try:
            pl.Series(one).cast(pl.String)
            return
        except pl.exceptions.PolarsError:
            pass
        if b - a <= UTF8_BY_LINE:
            for i in range(a, b):
                try:
                    content[starts[i] : ends[i]].decode("utf-8")
                except UnicodeDecodeError:
                    bad[i] = True
            return
        step = -(-(b - a) // fan_out)
        for part in range(a, b, step):
            check(part, min(part + step, b), UTF8_FAN_OUT)

    given = np.flatnonzero(bad).tolist()
    for a, b in zip([-1, *given], [*given, len(starts)], strict=True):
        if b > a + 1:
            check(a + 1, b, UTF8_FIRST_FAN_OUT)
    return bad


class _Lines:
    """Arrow's reading of the lines ``keep`` of a file (indices; each ends in a newline), as one buffer of those lines
    alone, in order. ``read`` streams it in blocks of ``STREAM_BLOCK`` bytes: Arrow's streaming reader cuts each block
    at its last newline, so after block i it has read exactly the lines that end within the first (i + 1) *
    ``STREAM_BLOCK`` bytes. Each block's rows are checked against that count (a line holding two objects makes one
    more row: alignment lost), and a block Arrow refuses names the line it choked on: the lines before it are read
    again alone, it goes to the reference path, and streaming goes on after it. Whatever the stream cannot vouch for
    (a count that differs, an error naming no line, a line longer than a block) is read in chunks of
    ``CHUNK_LINES`` lines, each checked the same way, halved on a refusal naming no line. Results: ``parsed``
    (Arrow's rows and the file line of each) and ``doubt`` (file lines for the reference path)."""

    def __init__(self, content: bytes, starts: np.ndarray, ends: np.ndarray, keep: np.ndarray, kind: str) -> None:
        self.keep, self.kind = keep, kind
        self.parsed: list[tuple[pa.Table, np.ndarray]] = []
        self.doubt: list[int] = []
        # Each refusal costs a read again of up to a block; past this many, the rest goes to the reference path, so
        # that a file of lines Arrow refuses (every other one, say) costs time in proportion to its size.
        self.refusals_left = MAX_REFUSALS + len(keep) // REFUSALS_PER_LINES
        # Runs of consecutive kept lines are contiguous bytes: the buffer is one slice of the file when no line is
        # left out, else a join of a few slices.
        self.offsets = np.concatenate(([0], np.cumsum(ends[keep] + 1 - starts[keep])))  # of each in the buffer
        self.buffer = pa.py_buffer(b"")
        if not len(keep):
            return
        gaps = np.flatnonzero(np.diff(keep) != 1)
        firsts = keep[np.concatenate(([0], gaps + 1))].tolist()
        lasts = keep[np.concatenate((gaps, [len(keep) - 1]))].tolist()
        if len(firsts) == 1:
            lo, hi = int(starts[firsts[0]]), int(ends[lasts[0]]) + 1
            self.buffer = pa.py_buffer(content).slice(lo, hi - lo)
        else:
            view = memoryview(content)
            self.buffer = pa.py_buffer(
                b"".join(view[int(starts[f]) : int(ends[t]) + 1] for f, t in zip(firsts, lasts, strict=True))
            )

    def _rows(self, t: pa.Table, first: int) -> None:
        self.parsed.append((t, self.keep[first : first + t.num_rows]))

    def read(self) -> None:
        x = 0
        while x < len(self.keep):
            x = self._stream(x)

    def _stream(self, x: int) -> int:
        """Stream from kept line ``x``; returns where the next stream starts (the end when done)."""
        n = len(self.keep)
        if self.refusals_left <= 0:
            self.doubt.extend(self.keep[x:].tolist())
            return n
        block = STREAM_BLOCK
        done = x  # lines read and checked
        ends = self.offsets[1:]  # where each kept line ends (after its newline) in the buffer
        start = int(self.offsets[x])

        def lines_after(blocks: int) -> int:  # lines read once that many blocks are: those ending within them
            return int(np.searchsorted(ends, start + blocks * block, side="right"))

        opts = pj.ReadOptions(use_threads=False, block_size=block)
        source = pa.BufferReader(self.buffer.slice(start))
        i = 0
        try:
            for batch in pj.open_json(source, read_options=opts, parse_options=_PARSE[self.kind]):
                expect = lines_after(i + 1)
                if done + batch.num_rows != expect:
                    self._chunks(done, n)
                    return n
                self._rows(pa.Table.from_batches([batch]), done)
                done = expect
                i += 1
        except pa.ArrowInvalid as exc:
            m = _ROW.search(str(exc))
            expect = lines_after(i + 1)
            culprit = done + int(m.group(1)) if m else expect
            if culprit >= expect:  # no line named, or one outside the block
                self._chunks(done, n)
                return n
            self.refusals_left -= 1
            self._run(done, culprit)
            self.doubt.append(int(self.keep[culprit]))
            return culprit + 1
        if done != n:
            self._chunks(done, n)
        return n

    def _arrow(self, a: int, b: int) -> tuple[pa.Table | None, int | None]:
        """Arrow's reading of kept lines [a, b), or None and, where Arrow names it, the line it choked on."""
        lo, hi = int(self.offsets[a]), int(self.offsets[b])
        try:
            t = pj.read_json(
                pa.BufferReader(self.buffer.slice(lo, hi - lo)), read_options=_READ, parse_options=_PARSE[self.kind]
            )
        except pa.ArrowInvalid as exc:
            m = _ROW.search(str(exc))
            return None, (a + int(m.group(1)) if m and a + int(m.group(1)) < b else None)
        return (t, None) if t.num_rows == b - a else (None, None)  # e.g. two objects on one line

    def _chunks(self, a: int, b: int) -> None:
        for lo in range(a, b, CHUNK_LINES):
            self._run(lo, min(lo + CHUNK_LINES, b))

    def _run(self, a: int, b: int) -> None:
        while a < b:
            if self.refusals_left <= 0:
                self.doubt.extend(self.keep[a:b].tolist())
                return
            t, culprit = self._arrow(a, b)
            if t is not None:
                self._rows(t, a)
                return
            self.refusals_left -= 1
            if culprit is not None:  # Arrow named the line: the lines before it, it alone, then the rest
                if culprit > a:
                    self._run(a, culprit)
                self.doubt.append(int(self.keep[culprit]))
                a = culprit + 1
            elif b - a <= SUB_CHUNK_LINES:
                self.doubt.extend(self.keep[a:b].tolist())
                return
            else:
                mid = (a + b) // 2
                self._run(a, mid)
                a = mid


SLICES_AT_MOST = 16  # doubtful rows of a chunk left out by zero-copy slices; more, by a filter


def _without(t: pa.Table, rows: np.ndarray) -> list[pa.Table]:
    """``t`` without ``rows`` (ascending): the slices between them, which copy nothing, where they are few; a
    filter copies every column of the chunk."""
    if not len(rows):
        return [t]
    if len(rows) > SLICES_AT_MOST:
        keep = np.ones(t.num_rows, bool)
        keep[rows] = False
        return [t.filter(pa.array(keep))]
    starts = [0, *(rows + 1).tolist()]
    stops = [*rows.tolist(), t.num_rows]
    return [t.slice(a, b - a) for a, b in zip(starts, stops, strict=True) if b > a]


def parse_file(name: str, content: bytes, kind: str) -> tuple[pa.Table, pa.Table]:
    """(events, quarantine records) of one closed log file. Events keep line order except for lines the reference
    path decided. A file not ending in a newline has a torn last line (closed files end in one): it is parsed like
    any other line, so it is malformed unless it happens to be a whole event."""
    good, bad, _, _ = parse_file_located(name, content, kind)
    return good, bad


def parse_file_located(name: str, content: bytes, kind: str) -> tuple[pa.Table, pa.Table, np.ndarray, np.ndarray]:
    """``parse_file``, and where each event's line is: its first byte's offset and its length (without the
    newline), per event row."""
    if not content:
        good, bad = parse_file_by_line(name, content, kind)
        return good, bad, np.zeros(0, np.int64), np.zeros(0, np.int64)
    buf = np.frombuffer(content, np.uint8)
    ends, brackets, quotes, backslashes, letters, never = _scan(buf, b"\\" in content)
    if buf[-1] != 10:
        ends = np.append(ends, len(content))
    starts = np.concatenate(([0], ends[:-1] + 1))
    lengths = ends - starts
    # Lines that are empty, too long or do not start with "{" never reach Arrow: it skips blank lines, and
    # pyarrow 26 crashes (SIGSEGV) on a nested explicit schema when the first value it reads is a top-level null.
    # Nor do lines Arrow might read otherwise than the reference (it does not check UTF-8 inside strings), nor lines
    # certainly malformed (not ending in "}", blanks aside: a truncated line, say), each of which would make Arrow
    # refuse a block, and the block be read again around it; nor a torn last line (no newline after it), so that
    # every line Arrow reads ends in one and its blocks end where _Lines.read predicts; nor a line with a CR inside,
    # where Arrow's chunker may end a block and the next start with a top-level null (the crash above).
    first_byte = buf[np.minimum(starts, len(buf) - 1)]
    odd = (lengths == 0) | (lengths > MAX_LINE_BYTES) | (first_byte != ord("{")) | (ends >= len(content))
    opening, quoted = _per_line(ends, brackets, _unescaped(quotes, backslashes))
    odd |= _suspect_lines(buf, starts, ends, opening, letters) | ~_ends_in_brace(buf, ends)
    off = _out_of_step(kind, opening, quoted) & ~odd
    if np.count_nonzero(off) <= _shape_budget(len(starts)):
        odd |= off
    if b"\r" in content:  # Arrow cuts its blocks at a CR too: a line may hold one only right before its newline
        cr = np.flatnonzero(buf == 13)
        cr = cr[buf[np.minimum(cr + 1, len(buf) - 1)] != 10]
        odd[np.searchsorted(starts, cr, side="right") - 1] = True
    odd |= _invalid_utf8(content, starts, ends, never)
    lines = _Lines(content, starts, ends, np.flatnonzero(~odd), kind)
    lines.read()
    parsed = lines.parsed
    doubt = [*np.flatnonzero(odd).tolist(), *lines.doubt]

    schema = QUERY_FIELDS if kind == "queries" else CLICK_FIELDS
    pieces: list[pa.Table] = []
    located = [np.zeros(0, np.int64)]  # the line of each event row
    if parsed:
        chunks = [t if t.schema == schema else t.select(schema.names).cast(schema) for t, _ in parsed]
        at_line = np.concatenate([at for _, at in parsed])
        ok = _screen(pa.concat_tables(chunks), kind)
        at = 0
        for t in chunks:
            keep = ok[at : at + t.num_rows]
            at += t.num_rows
            pieces.extend(_without(t, np.flatnonzero(~keep)))
        located.append(at_line[ok])
        doubt.extend(at_line[~ok].tolist())
    doubt.sort()
    good, bad = _by_line_numbers(name, kind, [content[starts[i] : ends[i]] for i in doubt], doubt)
    pieces.append(_good_table(good, kind))
    refused = np.asarray(bad["line"], np.int64) - 1
    located.append(np.setdiff1d(np.asarray(doubt, np.int64), refused))  # in order, as _by_line_numbers kept them
    rows = np.concatenate(located)
    # Chunked (one chunk per Arrow read): combining would copy every column, and a query's are mostly not kept.
    return pa.concat_tables(pieces), pa.table(bad, schema=BAD_FIELDS), starts[rows], lengths[rows]
