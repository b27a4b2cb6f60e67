"""`photon generate`: realistic query and click logs for several data centers, with a ground-truth manifest.

The world is simulated once, in chunks of log time: query servers log queries, click servers log clicks some
heavy-tailed delay after their query, each server on its own skewed clock, rotating its file every `rotate_s` of
its clock. Every data center holds a replica of the same files; a file reaches a replica when it closes plus that
replica's shipping lag (heavy-tailed, larger for queries than clicks, so a click often arrives before its query),
later still during an outage of that replica (it catches up when the outage ends). Some queries are never logged,
some lines are sent twice (same file or the next one), some lines are malformed in every way EVENTS.md lists.

Lines are built column-wise with Arrow's string kernels, so no Python object is made per event. In historical mode
every file is written at once; in live mode (real timestamps) each replica's file is materialised at its arrival
time: first as ``.inprogress`` while it is open, renamed to ``.jsonl`` once it has arrived whole.

The manifest (``<logs>/_manifest/``) holds, for every click, the outcome it must have, and per file the number of
malformed lines. See ``expectation()`` for the rule. Each run adds its own part (``clicks.parquet/<run>.parquet``,
``files.parquet/<run>.parquet``, ``runs/<run>.json``), so logs generated in several runs (history, then live) keep
one manifest that covers them all; ``manifest.json`` sums the runs.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from photon.logs.layout import partition_of
from photon.logs.schemas import MANIFEST_DIR, MAX_LINE_BYTES
from photon.storage import Store, open_store

log = logging.getLogger(__name__)
US = 1_000_000
KINDS = ("queries", "clicks")
MALFORMED_KINDS = ("truncated", "wrong_type", "missing_id", "bad_id", "invalid_utf8", "not_an_object", "huge")
_WORDS = tuple(
    "cheap flights hotel berlin paris london shoes running red dress laptop phone case pizza near me weather "  # noqa: SIM905
    "tomorrow car rental insurance jobs remote python tutorial café crème brûlée 東京 ホテル münchen zürich "
    "garden chair bike repair coffee beans tea vegan recipes yoga mat headphones wireless tv sale".split()
)
# Every word non-ASCII, in several scripts (2 to 3 bytes a character in UTF-8): long query texts of this kind are
# the hard case for a JSON reader (``--set query_vocabulary=non_ascii --set query_words_max=60``).
_NON_ASCII_WORDS = tuple(
    "günstige flüge münchen zürich straße größe schön café crème brûlée déjà façade naïve señor año mañana "  # noqa: SIM905
    "jalapeño łódź kraków żółty świeże отель москва дешёвые билеты погода завтра ремонт велосипеда "
    "ξενοδοχείο αθήνα καιρός αύριο 東京 ホテル 格安 航空券 天気 明日 北京 酒店 便宜 机票 서울 호텔 날씨 항공권 "
    "القاهرة فندق رحلات طقس".split()
)
_VOCABULARIES = {"mixed": _WORDS, "non_ascii": _NON_ASCII_WORDS}
_COUNTRIES = ("DE", "FR", "GB", "US", "JP", "CH", "NL", "ES", "IT", "PL")


@dataclass(frozen=True)
class Outage:
    """A replica that stops receiving files from `start_s` (after the start of the logs) for `duration_s`."""

    dc: str
    start_s: float
    duration_s: float

    @classmethod
    def parse(cls, text: str) -> Outage:
        try:
            dc, start, duration = text.split(":")
            return cls(dc, float(start), float(duration))
        except ValueError:
            raise ValueError(f"outage {text!r}: expected DC:START_S:DURATION_S") from None


@dataclass(frozen=True)
class GeneratorSettings:
    dcs: tuple[str, ...] = ("dc-a", "dc-b")
    seed: int = 1
    events_per_s: float = 2_000.0  # queries + clicks, in log time
    query_servers: int = 8
    click_servers: int = 4
    ads_per_query: float = 3.0  # mean of a Poisson, clipped to 1..8
    query_words_min: int = 1  # words per query text, uniform in [min, max]
    query_words_max: int = 4
    query_vocabulary: str = "mixed"  # "mixed": mostly ASCII, a few accented and CJK words; "non_ascii": every word
    clicks_per_query: float = 0.1  # mean clicks per query (click-through rate)
    click_delay_median_s: float = 4.0  # most clicks come seconds after their query...
    click_delay_sigma: float = 1.0
    late_click_fraction: float = 0.03  # ...some after minutes or hours (log-uniform up to the maximum)
    late_click_max_s: float = 3_600.0
    query_lag_median_s: float = 2.0  # shipping lag of a query file to a replica
    query_lag_sigma: float = 0.8
    late_query_file_fraction: float = 0.03  # query files shipped minutes late: the delayed primary
    late_query_lag_max_s: float = 180.0
    click_lag_median_s: float = 0.5
    click_lag_sigma: float = 0.5
    dc_lag_factor: dict[str, float] = field(default_factory=lambda: {"dc-b": 1.5})
    outages: tuple[Outage, ...] = ()
    lost_query_fraction: float = 0.01  # queries never logged: their clicks can never join
    duplicate_fraction: float = 0.005  # lines sent twice, in the same file or the next one
    malformed_fraction: float = 0.001  # of all lines
    malformed_weights: dict[str, float] = field(
        default_factory=lambda: {
            "truncated": 1.0,
            "wrong_type": 1.0,
            "missing_id": 1.0,
            "bad_id": 1.0,
            "invalid_utf8": 1.0,
            "not_an_object": 0.5,
            "huge": 0.05,
        }
    )
    huge_line_bytes: int = 2_000_000
    max_clock_skew_s: float = 10.0  # each server's clock is off by at most half of this
    max_join_delay_s: float = 120.0  # for the manifest: a click must join if its query arrived within this
    boundary_margin_s: float = 5.0  # arrivals this close to the deadline may go either way
    rotate_s: float = 1.0  # a server closes its file at least this often (log time)
    chunk_s: float = 10.0  # simulation chunk (log time); a multiple of rotate_s

    def __post_init__(self) -> None:
        if self.events_per_s <= 0 or self.query_servers < 1 or self.click_servers < 1:
            raise ValueError("events_per_s, query_servers and click_servers must be positive")
        if (
            not 0 < self.rotate_s <= self.chunk_s
            or abs(self.chunk_s / self.rotate_s - round(self.chunk_s / self.rotate_s)) > 1e-9
        ):
            raise ValueError("rotate_s must divide chunk_s")
        for name in (
            "lost_query_fraction",
            "duplicate_fraction",
            "malformed_fraction",
            "late_click_fraction",
            "late_query_file_fraction",
        ):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1)")
        if not 1 <= self.query_words_min <= self.query_words_max:
            raise ValueError("query_words_min and query_words_max: 1 <= min <= max")
        if self.query_vocabulary not in _VOCABULARIES:
            raise ValueError(f"query_vocabulary {self.query_vocabulary!r}: one of {sorted(_VOCABULARIES)}")
        if self.huge_line_bytes <= MAX_LINE_BYTES:
            raise ValueError(f"huge_line_bytes must exceed the {MAX_LINE_BYTES}-byte line limit to be malformed")
        unknown = set(self.malformed_weights) - set(MALFORMED_KINDS)
        if unknown:
            raise ValueError(f"unknown malformed kinds {sorted(unknown)}; known: {MALFORMED_KINDS}")
        for o in self.outages:
            if o.dc not in self.dcs:
                raise ValueError(f"outage of unknown data center {o.dc!r}")

    def with_overrides(self, pairs: list[str]) -> GeneratorSettings:
        """Apply ``key=value`` overrides (the CLI's ``--set``), typed by the field's default."""
        types = {f.name: f for f in fields(self)}
        changes: dict[str, Any] = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or key not in types:
                raise ValueError(f"--set {pair!r}: expected KEY=VALUE with KEY one of {sorted(types)}")
            current = getattr(self, key)
            if isinstance(current, bool):
                changes[key] = value.lower() in ("1", "true", "yes")
            elif isinstance(current, int | float) and not isinstance(current, bool):
                changes[key] = type(current)(value)
            elif isinstance(current, dict | tuple):
                changes[key] = json.loads(value)
            else:
                changes[key] = value
        return replace(self, **changes)


@dataclass
class Servers:
    ip: np.ndarray  # uint32 per server
    pid: np.ndarray  # int64 per server
    skew_us: np.ndarray  # int64 per server
    prefix: pa.Array  # "<ipv4>-<pid>-" per server

    @classmethod
    def make(cls, rng: np.random.Generator, n: int, net: int, max_skew_s: float) -> Servers:
        ip = (10 << 24) | (net << 16) | rng.choice(np.arange(1, 65_000), n, replace=False)
        pid = rng.integers(1_000, 60_000, n)
        skew = rng.uniform(-max_skew_s / 2, max_skew_s / 2, n) * US
        prefix = [f"{i >> 24}.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}-{p}-" for i, p in zip(ip, pid, strict=True)]
        return cls(ip.astype(np.uint32), pid.astype(np.int64), skew.astype(np.int64), pa.array(prefix, pa.string()))

    def name(self, server: int, seq: int) -> str:
        i = int(self.ip[server])
        return f"{i >> 24}.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}-{int(self.pid[server])}-{seq}.jsonl"


def _join_lists(offsets: np.ndarray, values: pa.Array, sep: str) -> pa.Array:
    """Join each list (``values[offsets[i]:offsets[i + 1]]``) into one string with ``sep``."""
    lists = pa.LargeListArray.from_arrays(pa.array(offsets.astype(np.int64)), values.cast(pa.large_string()))
    return pc.binary_join(lists, pa.scalar(sep, pa.large_string()))


def _concat(*parts: Any) -> pa.Array:
    """Element-wise concatenation of arrays and literal strings (large strings: a chunk can exceed 2 GB)."""
    cast = [
        p.cast(pa.large_string()) if isinstance(p, pa.Array | pa.ChunkedArray) else pa.scalar(p, pa.large_string())
        for p in parts
    ]
    return pc.binary_join_element_wise(*cast, pa.scalar("", pa.large_string()))


def _unique_increasing(server: np.ndarray, ts: np.ndarray, last: np.ndarray) -> np.ndarray:
    """Per server, make timestamps strictly increasing (a process never logs two events at one ts_us), continuing
    after ``last`` (updated in place). Rows must be sorted by (server, ts).

    out[i] = max(ts[i], out[i-1] + 1) is y[i] = max(ts[i] - i, y[i-1]) with y = out - i: a running maximum, run per
    server group by lifting each group far above the previous one."""
    n = len(ts)
    if n == 0:
        return ts
    i = np.arange(n, dtype=np.int64)
    first = np.r_[True, server[1:] != server[:-1]]
    v = ts - i
    v = np.where(first, np.maximum(v, last[server] + 1 - i), v)
    lift = (np.cumsum(first) - 1).astype(np.int64) << np.int64(40)
    out = np.maximum.accumulate(v + lift) - lift + i
    ends = np.r_[server[1:] != server[:-1], True]
    last[server[ends]] = out[ends]
    return out


@dataclass
class Chunk:
    """Everything logged in one chunk of log time: lines ready to write, and the manifest rows."""

    # (kind, name, line_start, line_end, malformed, close_us, server, seq)
    files: list[tuple[str, str, int, int, int, int, int, int]]
    lines: pa.LargeBinaryArray  # every line of every file, file after file, each ending in "\n"
    clicks: pa.Table  # manifest rows of the clicks logged in this chunk


class World:
    """The deterministic simulation: ``chunks(start_us, end_us)`` yields one Chunk per ``chunk_s`` of log time."""

    def __init__(self, settings: GeneratorSettings):
        self.s = settings
        self.rng = np.random.default_rng(settings.seed)
        self.qs = Servers.make(self.rng, settings.query_servers, 1, settings.max_clock_skew_s)
        self.cs = Servers.make(self.rng, settings.click_servers, 9, settings.max_clock_skew_s)
        self.q_last = np.full(settings.query_servers, -1, dtype=np.int64)
        self.c_last = np.full(settings.click_servers, -1, dtype=np.int64)
        self.pending: pa.Table | None = None  # clicks whose log time falls in a later chunk
        catalogue = 100_000
        self.ad_ids = pa.array([f"a{i}" for i in range(catalogue)], pa.large_string())
        self.ad_json = _concat(
            '{"ad_id": "',
            self.ad_ids,
            '", "advertiser_id": "adv',
            pc.cast(pa.array(self.rng.integers(1, 500, catalogue)), pa.string()),
            '", "bid_micros": ',
            pc.cast(pa.array(self.rng.integers(1, 2_000, catalogue) * 1_000), pa.string()),
            "}",
        )
        self.malformed_counter = 0
        self.queries_logged = 0
        self.duplicate_lines = 0
        self.malformed_by_kind: dict[str, int] = {}

    # -- queries ---------------------------------------------------------------------------------------------
    def _queries(self, t0: int, t1: int) -> tuple[pa.Table, pa.Table]:
        """Queries whose true time is in [t0, t1), and their clicks (any later time)."""
        s, rng = self.s, self.rng
        qps = s.events_per_s / (1 + s.clicks_per_query)
        n = int(rng.poisson(qps * (t1 - t0) / US))
        true = np.sort(rng.integers(t0, t1, n))
        server = rng.integers(0, s.query_servers, n)
        order = np.lexsort((true, server))
        true, server = true[order], server[order]
        ts = _unique_increasing(server, true + self.qs.skew_us[server], self.q_last)
        qseq = np.clip(ts - self.qs.skew_us[server], t0, t1 - 1) // int(s.rotate_s * US)  # the query's file
        logged = rng.random(n) >= s.lost_query_fraction
        n_ads = np.clip(rng.poisson(s.ads_per_query, n), 1, 8)
        ad_offsets = np.r_[0, np.cumsum(n_ads)].astype(np.int32)
        total_ads = int(ad_offsets[-1])
        # Ads come from a catalogue (fixed advertiser and bid per ad); a query shows n_ads consecutive catalogue
        # entries from a random start, so no ad appears twice in one query.
        first_ad = rng.integers(0, len(self.ad_ids), n)
        within = np.arange(total_ads) - np.repeat(ad_offsets[:-1], n_ads)
        ad_idx = pa.array((np.repeat(first_ad, n_ads) + within) % len(self.ad_ids))
        ad_id = pc.take(self.ad_ids, ad_idx)
        ts_str = pc.cast(pa.array(ts), pa.string())
        qid = _concat(pc.take(self.qs.prefix, pa.array(server)), ts_str)
        # Clicks: each ad clicked with probability clicks_per_query / ads_per_query.
        p_click = min(1.0, s.clicks_per_query / max(s.ads_per_query, 1e-9))
        clicked = np.flatnonzero(rng.random(total_ads) < p_click)
        owner = np.searchsorted(ad_offsets, clicked, side="right") - 1
        delay = rng.lognormal(np.log(s.click_delay_median_s * US), s.click_delay_sigma, len(clicked))
        late = rng.random(len(clicked)) < s.late_click_fraction
        delay[late] = np.exp(rng.uniform(np.log(60 * US), np.log(s.late_click_max_s * US), int(late.sum())))
        clicks = pa.table(
            {
                "true_us": true[owner] + delay.astype(np.int64),
                "query_id": pc.take(qid, pa.array(owner)),
                "query_ts_us": ts[owner],
                "ad_id": pc.take(ad_id, pa.array(clicked)),
                "query_logged": logged[owner],
                "query_server": server[owner],
                "query_seq": qseq[owner],
            }
        )
        vocabulary = _VOCABULARIES[s.query_vocabulary]
        words = pa.array(vocabulary, pa.string())
        n_words = rng.integers(s.query_words_min, s.query_words_max + 1, n)
        w_offsets = np.r_[0, np.cumsum(n_words)]
        text = _join_lists(
            w_offsets, pc.take(words, pa.array(rng.integers(0, len(vocabulary), int(w_offsets[-1])))), " "
        )
        ads = _join_lists(ad_offsets, pc.take(self.ad_json, ad_idx), ", ")
        line = _concat(
            '{"query_id": "',
            qid,
            '", "ts_us": ',
            ts_str,
            ', "user_id": "u',
            pc.cast(pa.array(rng.integers(1, 1_000_000, n)), pa.string()),
            '", "query_text": "',
            text,
            '", "country": "',
            pc.take(pa.array(_COUNTRIES), pa.array(rng.integers(0, len(_COUNTRIES), n))),
            '", "ads": [',
            ads,
            "]}\n",
        )
        queries = pa.table({"server": server, "ts_us": ts, "line": line.cast(pa.large_binary())}).filter(
            pa.array(logged)
        )
        self.queries_logged += int(logged.sum())
        return queries, clicks

    # -- clicks ----------------------------------------------------------------------------------------------
    def _clicks_due(self, new: pa.Table, t1: int) -> pa.Table:
        """Clicks whose true time is before t1 (this chunk); the rest wait in ``pending``."""
        allc = new if self.pending is None else pa.concat_tables([self.pending, new])
        due = pc.less(allc["true_us"], t1)
        self.pending = allc.filter(pc.invert(due))
        return allc.filter(due)

    def _click_lines(self, clicks: pa.Table) -> tuple[pa.Table, pa.Table]:
        rng, n = self.rng, clicks.num_rows
        true = clicks["true_us"].to_numpy()
        server = rng.integers(0, self.s.click_servers, n)
        order = np.lexsort((true, server))
        clicks = clicks.take(pa.array(order))
        server, true = server[order], true[order]
        ts = _unique_increasing(server, true + self.cs.skew_us[server], self.c_last)
        ts_str = pc.cast(pa.array(ts), pa.string())
        cid = _concat(pc.take(self.cs.prefix, pa.array(server)), ts_str)
        line = _concat(
            '{"click_id": "',
            cid,
            '", "ts_us": ',
            ts_str,
            ', "query_id": "',
            clicks["query_id"],
            '", "ad_id": "',
            clicks["ad_id"],
            '"}\n',
        )
        lines = pa.table({"server": server, "ts_us": ts, "line": line.cast(pa.large_binary())})
        manifest = pa.table(
            {
                "click_id": cid,
                "click_ts_us": ts,
                "query_id": clicks["query_id"],
                "query_ts_us": clicks["query_ts_us"],
                "ad_id": clicks["ad_id"],
                "query_logged": clicks["query_logged"],
                "query_server": clicks["query_server"],
                "query_seq": clicks["query_seq"],
            }
        )
        return lines, manifest

    # -- malformed -------------------------------------------------------------------------------------------
    def _malformed(self, kind: str, sample: bytes, log: str) -> bytes:
        """One malformed line of the given kind, shaped like the lines of its file (queries or clicks)."""
        rng = self.rng
        self.malformed_counter += 1
        self.malformed_by_kind[kind] = self.malformed_by_kind.get(kind, 0) + 1
        fresh = f"10.250.0.1-{self.malformed_counter}-{1_600_000_000_000_000 + self.malformed_counter}".encode()
        key = b"click_id" if log == "clicks" else b"query_id"
        rest = (
            b'"query_id": "10.1.2.3-4711-1763737200000000", "ad_id": "a1"'
            if log == "clicks"
            else (b'"user_id": "u1", "query_text": "q", "country": "DE", "ads": []')
        )
        if kind == "truncated":
            return sample[: max(1, int(len(sample) * rng.uniform(0.1, 0.9)))].rstrip(b"\n") + b"\n"
        if kind == "wrong_type":
            if log == "clicks":
                return b'{"click_id": "' + fresh + b'", "ts_us": "soon", "query_id": 17, "ad_id": ["a1"]}\n'
            return b'{"query_id": "' + fresh + b'", "ts_us": "soon", "user_id": 17, "ads": 3}\n'
        if kind == "missing_id":
            return b'{"ts_us": 1763737200000000, ' + rest + b"}\n"
        if kind == "bad_id":
            return b'{"' + key + b'": "not-an-id", "ts_us": 1763737200000000, ' + rest + b"}\n"
        if kind == "invalid_utf8":
            cut = max(1, len(sample) // 2)
            return sample[:cut] + b"\xff\xfe\xc3(" + sample[cut:]
        if kind == "not_an_object":
            return b'["' + fresh + b'", 1763737200000000]\n'
        pad = b"x" * self.s.huge_line_bytes
        return (
            b'{"' + key + b'": "' + fresh + b'", "ts_us": 1763737200000000, ' + rest + b', "padding": "' + pad + b'"}\n'
        )

    # -- files -----------------------------------------------------------------------------------------------
    def _files(self, kind: str, servers: Servers, rows: pa.Table, t0: int, t1: int) -> tuple[list[Any], pa.Array]:
        """Cut one kind's lines into files: one per server and rotation window (absolute, by true time, so close
        times are exact and no file spans two chunks), with duplicates and malformed lines mixed in."""
        s, rng = self.s, self.rng
        rot = int(s.rotate_s * US)
        server = rows["server"].to_numpy()
        ts = rows["ts_us"].to_numpy()
        true = np.clip(ts - servers.skew_us[server], t0, t1 - 1)
        seq = true // rot
        last_seq = (t1 - 1) // rot
        line = rows["line"].combine_chunks()
        n = len(ts)
        # Duplicates: the same line again later in the same file, or early in the server's next file.
        dup = np.flatnonzero(rng.random(n) < s.duplicate_fraction)
        to_next = (rng.random(len(dup)) < 0.5) & (seq[dup] < last_seq)
        d_seq = seq[dup] + to_next
        d_key = np.where(to_next, ts[dup] - rot, ts[dup] + rng.integers(1, 1000, len(dup)))
        # Malformed lines at random places.
        n_bad = int(rng.binomial(n + len(dup), s.malformed_fraction)) if n else 0
        weights = np.array([s.malformed_weights.get(k, 0.0) for k in MALFORMED_KINDS], dtype=np.float64)
        bad_kinds = rng.choice(len(MALFORMED_KINDS), n_bad, p=weights / weights.sum()) if n_bad else np.empty(0, int)
        bad_at = rng.integers(0, n, n_bad) if n_bad else np.empty(0, np.int64)
        bad_lines = [
            self._malformed(MALFORMED_KINDS[k], line[int(i)].as_py(), kind)
            for k, i in zip(bad_kinds, bad_at, strict=True)
        ]
        all_server = np.r_[server, server[dup], server[bad_at]]
        all_seq = np.r_[seq, d_seq, seq[bad_at]]
        all_key = np.r_[ts, d_key, ts[bad_at] + rng.integers(1, 1000, n_bad)]
        is_bad = np.r_[np.zeros(n + len(dup), bool), np.ones(n_bad, bool)]
        lines = pa.concat_arrays([line, line.take(pa.array(dup, pa.int64())), pa.array(bad_lines, pa.large_binary())])
        order = np.lexsort((all_key, all_seq, all_server))
        lines = lines.take(pa.array(order))
        all_server, all_seq, is_bad = all_server[order], all_seq[order], is_bad[order]
        if len(order) == 0:
            return [], lines
        cut = np.flatnonzero(np.r_[True, (all_server[1:] != all_server[:-1]) | (all_seq[1:] != all_seq[:-1]), True])
        bad_cum = np.r_[0, np.cumsum(is_bad)]
        files = []
        for a, b in itertools.pairwise(cut):
            srv, sq = int(all_server[a]), int(all_seq[a])
            files.append(
                (kind, servers.name(srv, sq), int(a), int(b), int(bad_cum[b] - bad_cum[a]), (sq + 1) * rot, srv, sq)
            )
        self.duplicate_lines += len(dup)
        return files, lines

    def chunks(self, start_us: int, end_us: int) -> Iterator[Chunk]:
        step = int(self.s.chunk_s * US)
        for t0 in range(start_us, end_us, step):
            t1 = min(t0 + step, end_us)
            queries, new_clicks = self._queries(t0, t1)
            due = self._clicks_due(new_clicks, t1)
            click_rows, click_manifest = self._click_lines(due)
            q_files, q_lines = self._files("queries", self.qs, queries, t0, t1)
            c_files, c_lines = self._files("clicks", self.cs, click_rows, t0, t1)
            offset = len(q_lines)
            c_files = [(f[0], f[1], f[2] + offset, f[3] + offset, *f[4:]) for f in c_files]
            yield Chunk(q_files + c_files, pa.concat_arrays([q_lines, c_lines]), click_manifest)


# -- arrival, expectations, writing ---------------------------------------------------------------------------


class Arrivals:
    """When each file reaches each replica: close time + shipping lag, pushed past any outage of that replica."""

    def __init__(self, settings: GeneratorSettings, start_us: int, live: bool):
        self.s = settings
        self.start_us = start_us
        self.live = live
        self.rng = np.random.default_rng([settings.seed, 7])  # its own stream: the world's draws stay the same

    def of(self, kind: str, close_us: int) -> dict[str, int]:
        if not self.live:  # historical: every file is on disk before anything reads it
            return {dc: close_us for dc in self.s.dcs}
        s, rng, out = self.s, self.rng, {}
        for dc in s.dcs:
            factor = s.dc_lag_factor.get(dc, 1.0)
            if kind == "queries":
                lag = rng.lognormal(np.log(s.query_lag_median_s), s.query_lag_sigma)
                if rng.random() < s.late_query_file_fraction:
                    lag += rng.uniform(s.late_query_lag_max_s / 4, s.late_query_lag_max_s)
            else:
                lag = rng.lognormal(np.log(s.click_lag_median_s), s.click_lag_sigma)
            arrival = close_us + int(lag * factor * US)
            for o in s.outages:
                begin = self.start_us + int(o.start_s * US)
                end = begin + int(o.duration_s * US)
                if o.dc == dc and begin <= arrival < end:
                    arrival = end + int(rng.uniform(0, 2) * US)  # the replica catches up when it comes back
            out[dc] = arrival
        return out


def expectation(
    click_ts_us: np.ndarray, first_arrival_us: np.ndarray, logged: np.ndarray, max_join_delay_s: float, margin_s: float
) -> np.ndarray:
    """The outcome a click must have. ``join`` if its query reached some replica at least ``margin_s`` before the
    click's deadline (click time + maximum join delay); ``unjoinable`` if the query was never logged or reached
    every replica at least ``margin_s`` after it; ``either`` in between (retry timing and clock skew decide)."""
    deadline = click_ts_us + int(max_join_delay_s * US)
    margin = int(margin_s * US)
    out = np.full(len(click_ts_us), "either", dtype=object)
    out[logged & (first_arrival_us <= deadline - margin)] = "join"
    out[~logged | (first_arrival_us >= deadline + margin)] = "unjoinable"
    return out


def file_bytes(lines: pa.LargeBinaryArray, a: int, b: int) -> memoryview:
    offsets = np.frombuffer(lines.buffers()[1], dtype=np.int64)[lines.offset : lines.offset + len(lines) + 1]
    return memoryview(lines.buffers()[2])[int(offsets[a]) : int(offsets[b])]


def write_file(path: Path, data: bytes | memoryview) -> None:
    """Write ``<name>.jsonl.inprogress`` and rename it: readers only ever see whole closed files."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".inprogress")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def link_or_copy(src: Path, dst: Path) -> None:
    """A second replica of a closed file: a hard link where the file system allows one, else a copy."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".inprogress")
    try:
        os.link(src, tmp)
    except OSError:
        write_file(dst, src.read_bytes())
        return
    os.replace(tmp, dst)


_CLICK_SCHEMA = pa.schema(
    [
        ("click_id", pa.string()),
        ("click_ts_us", pa.int64()),
        ("query_id", pa.string()),
        ("query_ts_us", pa.int64()),
        ("ad_id", pa.string()),
        ("query_logged", pa.bool_()),
        ("first_query_arrival_us", pa.int64()),
        ("expect", pa.string()),
    ]
)


@dataclass
class GenerateReport:
    mode: str
    start_us: int
    end_us: int
    queries: int = 0
    clicks: int = 0
    lines: int = 0
    duplicate_lines: int = 0
    malformed_lines: int = 0
    files: int = 0  # per data center
    bytes: int = 0  # per data center
    expect: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def events_per_s(self) -> float:
        return (self.queries + self.clicks) / self.seconds if self.seconds else 0.0


# `photon generate` says so (one line on stderr, before it writes anything) when a run will put more than this on disk:
# the README's old example wrote 26 GB per data center without a word.
LARGE_RUN_BYTES = 1_000_000_000
_SAMPLE_EVENTS = 20_000  # simulated to measure the lines' mean sizes (tens of milliseconds)


@dataclass(frozen=True)
class SizeEstimate:
    """What a run writes: events logged (queries and clicks, as ``GenerateReport`` counts them), lines and bytes per
    data center (a replica), and bytes on disk (historical replicas share their files as hard links)."""

    events: int
    lines: int
    bytes_per_dc: int
    bytes_on_disk: int

    def line(self, settings: GeneratorSettings, live: bool) -> str:
        """The warning: one line."""
        dcs = len(settings.dcs)
        how = "each replica written apart" if live else "the replicas hard-linked"
        return (
            f"photon generate: this run writes about {self.events:,} events, {self.bytes_per_dc / 1e9:,.1f} GB per "
            f"data center ({dcs} data center{'s' if dcs != 1 else ''}, {self.bytes_on_disk / 1e9:,.1f} GB on disk, "
            f"{how}): more than {LARGE_RUN_BYTES / 1e9:g} GB; Ctrl-C now to stop, or make it smaller with --rate or "
            "--duration"
        )


def estimate_size(settings: GeneratorSettings, duration_s: float, *, live: bool = False) -> SizeEstimate:
    """What ``generate`` writes for ``duration_s`` of log time, without writing it: the mean sizes of a query line and
    a click line, measured on a few thousand events simulated with the same settings (the words, ads and ids the run
    draws), times the lines the settings imply (queries lost, lines sent twice, malformed lines, the huge ones at
    their size). Within a few percent of the run (tested)."""
    s = settings
    world = World(s)
    start = 1_700_000_000 * US  # any time: the sizes do not depend on it
    query_lines, their_clicks = world._queries(start, start + max(1, int(_SAMPLE_EVENTS / s.events_per_s * US)))
    click_lines, _ = world._click_lines(their_clicks)  # every click of the sample's queries, however late
    mean = {
        kind: (pc.sum(pc.binary_length(t["line"])).as_py() or 0) / max(t.num_rows, 1)
        for kind, t in (("queries", query_lines), ("clicks", click_lines))
    }
    events = s.events_per_s * duration_s
    queries = events / (1 + s.clicks_per_query)
    clicks = events - queries
    lines = {"queries": queries * (1 - s.lost_query_fraction), "clicks": clicks}
    good_lines = sum(lines.values()) * (1 + s.duplicate_fraction)
    good_bytes = sum(n * mean[kind] for kind, n in lines.items()) * (1 + s.duplicate_fraction)
    weights = sum(s.malformed_weights.get(k, 0.0) for k in MALFORMED_KINDS) or 1.0
    huge = s.malformed_weights.get("huge", 0.0) / weights
    malformed = good_lines * s.malformed_fraction
    mean_line = good_bytes / max(good_lines, 1)
    per_dc = good_bytes + malformed * (huge * s.huge_line_bytes + (1 - huge) * mean_line)
    logged = queries * (1 - s.lost_query_fraction) + clicks
    return SizeEstimate(
        events=round(logged),
        lines=round(good_lines + malformed),
        bytes_per_dc=round(per_dc),
        bytes_on_disk=round(per_dc) * (len(s.dcs) if live else 1),
    )


def _bytes_at_most(settings: GeneratorSettings, duration_s: float, live: bool) -> float:
    """A bound from above on what a run writes, without simulating it: no line is longer than a query line with the
    most words, each of the longest, and eight ads (the most a query shows), except the huge malformed ones."""
    s = settings
    longest_word = max(len(w.encode()) for w in _VOCABULARIES[s.query_vocabulary]) + 1
    longest_line = 256 + s.query_words_max * longest_word + 8 * 100  # ids, stamps, keys; words; ads of < 100 bytes
    lines = s.events_per_s * duration_s * (1 + s.duplicate_fraction) * (1 + s.malformed_fraction)
    huge = s.malformed_weights.get("huge", 0.0) / (sum(s.malformed_weights.values()) or 1.0)
    per_dc = lines * longest_line + lines * s.malformed_fraction * huge * (s.huge_line_bytes + 256)
    return per_dc * (len(s.dcs) if live else 1)


def generate(
    settings: GeneratorSettings,
    logs: Path | str,
    *,
    start_us: int,
    end_us: int,
    live: bool = False,
    on_progress: Callable[[int, int], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    manifest: Path | None = None,
) -> GenerateReport:
    """Write logs for [start_us, end_us) of log time under ``logs/<dc>/{queries,clicks}/`` and the manifest under
    ``manifest`` (default ``logs/_manifest/``). ``logs``: a folder, or an s3:// URL (each file one PutObject: whole
    once it exists; the manifest then goes to a folder of its own, ``manifest``). Historical mode writes as fast as
    it can; live mode writes each replica's files at their arrival times (so start_us should be about now) and
    returns once the last one has arrived. In live mode the manifest records when each file truly arrived (a writer
    held up writes late, under the minute it writes in) and owes a click its join by those times."""
    store = open_store(logs) if str(logs).startswith("s3://") else None
    if store is not None and manifest is None:
        raise ValueError(f"{logs}: logs in a bucket need a manifest folder of their own (--manifest)")
    logs = Path(logs) if store is None else Path()
    t_begin = time.perf_counter()
    rot = int(settings.rotate_s * US)
    start_us -= start_us % rot
    if _bytes_at_most(settings, (end_us - start_us) / US, live) > LARGE_RUN_BYTES:  # the sample costs 0.1-0.3 s
        size = estimate_size(settings, (end_us - start_us) / US, live=live)
        if size.bytes_on_disk > LARGE_RUN_BYTES:
            # sys.stderr as it is now: under a progress bar, rich has put a writer there that keeps the bar whole.
            print(size.line(settings, live), file=sys.stderr, flush=True)
    world = World(settings)
    arrivals = Arrivals(settings, start_us, live)
    report = GenerateReport("live" if live else "historical", start_us, end_us)
    mdir = manifest if manifest is not None else logs / MANIFEST_DIR
    mdir.mkdir(parents=True, exist_ok=True)
    run = _run_id(settings, start_us, end_us, live)
    _adopt_legacy(mdir)
    clicks_dir, files_dir = _parts_dir(mdir / "clicks.parquet"), _parts_dir(mdir / "files.parquet")
    _warn_on_overlap(mdir, run, start_us, end_us)
    query_arrival: dict[tuple[int, int], int] = {}  # (query server, seq) -> first arrival over replicas
    file_rows: list[tuple[str, str, str, int, int, int, int]] = []
    # live: (planned arrival, order, opened, dc, kind, name, data, (lines, malformed, closed))
    pending: list[tuple[int, int, int, str, str, str, bytes, tuple[int, int, int]]] = []
    query_file: dict[str, tuple[int, int, int]] = {}  # live: a query file's name -> (query server, seq, chunk)
    # live: a chunk's clicks are written once every copy of every query file of that chunk and the ones before has
    # landed (a click's query is never in a later chunk): held while query files are late, not for the whole run.
    clicks_held: deque[tuple[int, pa.Table]] = deque()
    unlanded: Counter[int] = Counter()  # chunk -> copies of its query files not written yet

    def landed(dc: str, kind: str, rel: str, row: tuple[int, int, int], at: int) -> None:
        file_rows.append((dc, kind, rel, *row, at))
        if kind == "queries":
            srv, seq, chunk = query_file[rel.rsplit("/", 1)[-1]]
            query_arrival[(srv, seq)] = min(at, query_arrival.get((srv, seq), at))
            unlanded[chunk] -= 1

    def write_landed() -> None:
        waiting = min((c for c, n in unlanded.items() if n > 0), default=None)
        while clicks_held and (waiting is None or clicks_held[0][0] < waiting):
            _add_manifest_rows(writer, clicks_held.popleft()[1], query_arrival, settings, expect_counts)

    expect_counts: dict[str, int] = {}
    # Parts are written under a dot name (readers skip those) and renamed once whole.
    clicks_part = clicks_dir / f".{run}.parquet.tmp"
    writer = pq.ParquetWriter(clicks_part, _CLICK_SCHEMA)
    try:
        for number, chunk in enumerate(world.chunks(start_us, end_us)):
            for kind, name, a, b, bad, close, srv, seq in chunk.files:
                data = file_bytes(chunk.lines, a, b)
                arr = arrivals.of(kind, close)
                if kind == "queries" and not live:
                    query_arrival[(srv, seq)] = min(arr.values())
                if kind == "queries" and live:
                    query_file[name] = (srv, seq, number)
                    unlanded[number] += len(arr)
                first_copy: Path | None = None
                for dc, at in arr.items():
                    if live:  # its partition and arrival are those of the moment it is written (_drain)
                        row = (b - a, bad, close)
                        pending.append((at, len(pending), close - rot, dc, kind, name, bytes(data), row))
                        continue
                    rel = f"{partition_of(at)}/{name}"  # under the minute it arrives in this replica (EVENTS.md)
                    file_rows.append((dc, kind, rel, b - a, bad, close, at))
                    if store is not None:
                        store.put(f"{dc}/{kind}/{rel}", bytes(data))
                    elif first_copy is None:
                        first_copy = logs / dc / kind / rel
                        write_file(first_copy, data)
                    else:  # a closed file never changes: the other replicas can share its bytes
                        link_or_copy(first_copy, logs / dc / kind / rel)
                report.files += 1
                report.bytes += len(data)
                report.lines += b - a
                report.malformed_lines += bad
            if live:  # whether a click must join depends on when its query truly arrived: written once it has
                clicks_held.append((number, chunk.clicks))
            else:
                _add_manifest_rows(writer, chunk.clicks, query_arrival, settings, expect_counts)
            report.clicks += chunk.clicks.num_rows
            chunk_end = max((f[5] for f in chunk.files), default=start_us)
            if on_progress:
                on_progress(min(end_us, chunk_end) - start_us, end_us - start_us)
            if live:  # the next chunk's first file closes after this one's end: write until then
                _drain(pending, store or logs, sleep, landed, until_us=min(end_us, chunk_end))
                write_landed()
        if live:
            _drain(pending, store or logs, sleep, landed, until_us=None)
            write_landed()
            assert not clicks_held, "a chunk's query files never landed"
    finally:
        writer.close()
    report.queries = world.queries_logged
    report.duplicate_lines = world.duplicate_lines
    report.expect = dict(sorted(expect_counts.items()))
    os.replace(clicks_part, clicks_dir / f"{run}.parquet")
    columns = ("dc", "kind", "name", "lines", "malformed", "close_us", "arrival_us")
    files_part = files_dir / f".{run}.parquet.tmp"
    pq.write_table(pa.table({c: [r[i] for r in file_rows] for i, c in enumerate(columns)}), files_part)
    os.replace(files_part, files_dir / f"{run}.parquet")
    summary = {
        "run": run,
        "mode": report.mode,
        "start_us": start_us,
        "end_us": end_us,
        "settings": _jsonable(settings),
        "queries": report.queries,
        "clicks": report.clicks,
        "lines": report.lines,
        "duplicate_lines": report.duplicate_lines,
        "malformed_lines": report.malformed_lines,
        "malformed_by_kind": dict(sorted(world.malformed_by_kind.items())),
        "files_per_dc": report.files,
        "expect": report.expect,
    }
    (mdir / "runs").mkdir(exist_ok=True)
    _write_json(mdir / "runs" / f"{run}.json", summary)
    _write_json(mdir / "manifest.json", _sum_runs(mdir))
    report.seconds = time.perf_counter() - t_begin
    return report


def _run_id(settings: GeneratorSettings, start_us: int, end_us: int, live: bool) -> str:
    """Names a run's manifest parts: the same run again (same settings and range) replaces its own parts."""
    key = json.dumps([_jsonable(settings), start_us, end_us, live], sort_keys=True).encode()
    return f"{'live' if live else 'historical'}-{start_us}-{end_us}-{hashlib.sha256(key).hexdigest()[:8]}"


def _adopt_legacy(mdir: Path) -> None:
    """A manifest written before runs had parts (one ``clicks.parquet`` file) becomes the run ``legacy``."""
    old = mdir / "manifest.json"
    if (mdir / "clicks.parquet").is_file() and old.is_file() and not (mdir / "runs").is_dir():
        (mdir / "runs").mkdir()
        _write_json(mdir / "runs" / "legacy.json", {"run": "legacy", **json.loads(old.read_text())})


def _parts_dir(path: Path) -> Path:
    """The folder of a manifest table's per-run parts. A manifest from before parts (one file) becomes a part."""
    if path.is_file():
        legacy = path.with_name(f".{path.name}.legacy")
        os.replace(path, legacy)
        path.mkdir()
        os.replace(legacy, path / "legacy.parquet")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _warn_on_overlap(mdir: Path, run: str, start_us: int, end_us: int) -> None:
    for f in sorted((mdir / "runs").glob("*.json")):
        other = json.loads(f.read_text())
        if other["run"] != run and other["start_us"] < end_us and start_us < other["end_us"]:
            log.warning(
                "this run overlaps run %s in time: the manifest holds both, so the audit expects the clicks of both",
                other["run"],
            )


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _sum_runs(mdir: Path) -> dict[str, Any]:
    """``manifest.json``: the totals over every run in the manifest (and the settings, when all runs share them)."""
    runs = [json.loads(f.read_text()) for f in sorted((mdir / "runs").glob("*.json"))]
    out: dict[str, Any] = {
        "runs": [r["run"] for r in runs],
        "mode": runs[0]["mode"] if len({r["mode"] for r in runs}) == 1 else "mixed",
        "start_us": min(r["start_us"] for r in runs),
        "end_us": max(r["end_us"] for r in runs),
    }
    for key in ("queries", "clicks", "lines", "duplicate_lines", "malformed_lines", "files_per_dc"):
        out[key] = sum(r[key] for r in runs)
    for key in ("malformed_by_kind", "expect"):
        total: dict[str, int] = {}
        for r in runs:
            for k, v in r[key].items():
                total[k] = total.get(k, 0) + v
        out[key] = dict(sorted(total.items()))
    if all(r["settings"] == runs[0]["settings"] for r in runs):
        out["settings"] = runs[0]["settings"]
    return out


def _add_manifest_rows(
    writer: Any,
    m: pa.Table,
    query_arrival: dict[tuple[int, int], int],
    settings: GeneratorSettings,
    counts: dict[str, int],
) -> None:
    keys = zip(m["query_server"].to_pylist(), m["query_seq"].to_pylist(), strict=True)
    first = np.array([query_arrival.get(k, -1) for k in keys], dtype=np.int64)
    logged = m["query_logged"].to_numpy(zero_copy_only=False) & (first >= 0)
    never = np.iinfo(np.int64).max
    exp = expectation(
        m["click_ts_us"].to_numpy(),
        np.where(first >= 0, first, never),
        logged,
        settings.max_join_delay_s,
        settings.boundary_margin_s,
    ).astype(str)
    for k, v in zip(*np.unique(exp, return_counts=True), strict=True):
        counts[str(k)] = counts.get(str(k), 0) + int(v)
    writer.write_table(
        pa.table(
            {
                "click_id": m["click_id"],
                "click_ts_us": m["click_ts_us"],
                "query_id": m["query_id"],
                "query_ts_us": m["query_ts_us"],
                "ad_id": m["ad_id"],
                "query_logged": logged,
                "first_query_arrival_us": pa.array(first, mask=first < 0),
                "expect": pa.array(exp, pa.string()),
            },
            schema=_CLICK_SCHEMA,
        )
    )


def _drain(
    pending: list[Any],
    logs: Path | Store,
    sleep: Callable[[float], None],
    landed: Callable[[str, str, str, tuple[int, int, int], int], None],
    until_us: int | None,
) -> None:
    """Live mode: write each replica's files at their arrival (wall-clock) time, until ``until_us`` (or until none
    is left), and tell ``landed`` each file's partition and when it was there. A writer held up (a stalled process,
    a store down) writes late: a file goes under the minute it is written in, as a log writer's would (EVENTS.md),
    and its arrival is when its write returned, never the plan, so the manifest never owes a join of a click whose
    query in truth came after its deadline. In a folder, a file still on its way has an ``.inprogress`` copy of its
    first half where it is planned to appear (an object store shows nothing before the put)."""
    pending.sort()
    while pending and (until_us is None or time.time() * US < until_us):
        while pending and pending[0][0] <= time.time() * US:
            at, _, _, dc, kind, name, data, row = pending.pop(0)
            rel = f"{partition_of(int(time.time() * US))}/{name}"
            if isinstance(logs, Path):
                planned = f"{partition_of(at)}/{name}"
                write_file(logs / dc / kind / rel, data)
                if planned != rel:  # written in a later minute than planned: its first half stays behind
                    (logs / dc / kind / (planned + ".inprogress")).unlink(missing_ok=True)
            else:
                logs.put(f"{dc}/{kind}/{rel}", data)
            landed(dc, kind, rel, row, int(time.time() * US))
        now = time.time() * US
        for at, _, opened, dc, kind, name, data, _ in pending if isinstance(logs, Path) else ():
            if opened > now:
                break  # sorted by arrival, not opening; good enough to bound the scan
            partial = logs / dc / kind / f"{partition_of(at)}/{name}.inprogress"
            if not partial.exists():
                partial.parent.mkdir(parents=True, exist_ok=True)
                partial.write_bytes(data[: len(data) // 2])
        sleep(0.02)
    if until_us is not None:
        while time.time() * US < until_us:
            sleep(min(0.05, max(0.0, until_us / US - time.time())))


# Settings added after manifests were first written: a run that keeps their defaults leaves them out of its
# manifest and run id, so its manifest stays byte-identical to one written before they existed.
_LATER_SETTINGS = ("query_words_min", "query_words_max", "query_vocabulary")


def _jsonable(settings: GeneratorSettings) -> dict[str, Any]:
    d = asdict(settings)
    d["dcs"] = list(settings.dcs)
    d["outages"] = [asdict(o) for o in settings.outages]
    defaults = {f.name: f.default for f in fields(GeneratorSettings)}
    for name in _LATER_SETTINGS:
        if d[name] == defaults[name]:
            del d[name]
    return d
