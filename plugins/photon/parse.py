"""Parsing log lines into events, or into quarantine records with a reason. Runs in Spark executors (one call per
input file's bytes), so it is plain Python over one file at a time and returns Arrow tables."""

from __future__ import annotations

import json
import re
from typing import Any

import pyarrow as pa

from photon.ids import ID_REGEX
from photon.schemas import MAX_LINE_BYTES, RAW_CAP_BYTES

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


class Malformed(ValueError):
    pass


def _int(v: Any, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise Malformed(f"{what} is not an integer")
    return v


def _str(v: Any, what: str) -> str:
    if not isinstance(v, str) or not v:
        raise Malformed(f"{what} is not a non-empty string")
    return v


def _event_id(v: Any, what: str, ts_us: int | None = None) -> str:
    s = _str(v, what)
    if not _ID.match(s):
        raise Malformed(f"{what} is not a canonical <ipv4>-<pid>-<ts_us>")
    parts = s.split("-")[0].split(".")
    if any(int(p) > 255 for p in parts) or int(s.split("-")[1]) > 2**32 - 1:
        raise Malformed(f"{what} is out of range")
    if ts_us is not None and int(s.rsplit("-", 1)[1]) != ts_us:
        raise Malformed(f"ts_us differs from the timestamp in {what}")
    return s


def _object(line: bytes) -> dict[str, Any]:
    if len(line) > MAX_LINE_BYTES:
        raise Malformed(f"line longer than {MAX_LINE_BYTES} bytes")
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        raise Malformed("invalid UTF-8") from None
    try:
        obj = json.loads(text)
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


def parse_file(name: str, content: bytes, kind: str) -> tuple[pa.Table, pa.Table]:
    """(events, quarantine records) of one closed log file. A file not ending in a newline has a torn last
    line; closed files end in one, so a missing newline only happens to a corrupt file: the tail is malformed."""
    parser, schema = (parse_query, QUERY_FIELDS) if kind == "queries" else (parse_click, CLICK_FIELDS)
    good: list[dict[str, Any]] = []
    bad: dict[str, list[Any]] = {f.name: [] for f in BAD_FIELDS}
    lines = content.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    for number, line in enumerate(lines, start=1):
        try:
            good.append(parser(line))
        except Malformed as exc:
            bad["file"].append(name)
            bad["line"].append(number)
            bad["raw"].append(line[:RAW_CAP_BYTES])
            bad["raw_bytes"].append(len(line))
            bad["reason"].append(str(exc))
    return pa.Table.from_pylist(good, schema=schema), pa.table(bad, schema=BAD_FIELDS)
