"""`make bench-parse`: `photon.logs.parse.parse_file` against bare `pyarrow.json.read_json` on the same lines.

Generator output of several shapes, in memory (nothing is written), cut into files of --lines-per-file lines:

- `default`: the generator's defaults (mostly ASCII texts of 1-4 words, 1-8 ads a query, 0.5% duplicate and 0.1%
  malformed lines): query files;
- `long_non_ascii`: query texts of 20-60 words, every one non-ASCII: query files;
- `nested_ads`: 1-4 ads a query (mostly; a Poisson of mean 2), 3% duplicate and 0.1% malformed lines: query files;
- `clicks`: click files of the same duplicate and malformed rates.

Per file, `parse_file` gets the file's bytes; bare Arrow gets the same bytes without the lines the reference
quarantines (Arrow would refuse the file otherwise), with the block size and parse options the project uses. Both run
in this process, one after the other, alternating which goes first, --runs times; time is this process's CPU time
(the parser is single-threaded, so events/s per core), wall time beside it. Prints medians and spreads (min-max) and
ends with one JSON line: events/s per core of each side and `ratio_to_pyarrow_<shape>` (parse_file's time over
Arrow's, the median of the per-run ratios).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.json as pj

from photon.logs import parse
from photon.tools.generator import GeneratorSettings, World

START_US = 1_763_700_000_000_000


def shapes() -> dict[str, tuple[str, GeneratorSettings]]:
    """Shape name -> (kind of file, generator settings). Clicks come at one per query where click files are wanted."""
    base: dict[str, Any] = {"dcs": ("dc-a",), "rotate_s": 10.0, "chunk_s": 10.0, "events_per_s": 20_000.0}
    nested: dict[str, Any] = {**base, "ads_per_query": 2.0, "duplicate_fraction": 0.03, "malformed_fraction": 0.001}
    return {
        "default": ("queries", GeneratorSettings(**base)),
        "long_non_ascii": (
            "queries",
            GeneratorSettings(**base, query_vocabulary="non_ascii", query_words_min=20, query_words_max=60),
        ),
        "nested_ads": ("queries", GeneratorSettings(**nested)),
        "clicks": ("clicks", GeneratorSettings(**{**nested, "clicks_per_query": 1.0})),
    }


def files_of(kind: str, settings: GeneratorSettings, n_files: int, lines_per_file: int) -> list[bytes]:
    """``n_files`` files of ``lines_per_file`` lines of ``kind``, in the generator's order."""
    want = n_files * lines_per_file
    got: list[pa.Array] = []
    have = 0
    world = World(settings)
    step = int(settings.chunk_s * 1e6)
    t = START_US
    while have < want:
        for chunk in world.chunks(t, t + step):
            for k, _, a, b, *_ in chunk.files:
                if k == kind:
                    got.append(chunk.lines.slice(a, b - a))
                    have += b - a
        t += step
    lines = pa.concat_arrays(got)
    return [b"".join(lines.slice(i * lines_per_file, lines_per_file).to_pylist()) for i in range(n_files)]


def good_lines_only(name: str, content: bytes, kind: str) -> bytes:
    """The file without the lines the reference quarantines: what bare Arrow can read."""
    _, bad = parse.parse_file_by_line(name, content, kind)
    drop = set(bad.column("line").to_pylist())
    return b"".join(line for i, line in enumerate(content.splitlines(keepends=True), 1) if i not in drop)


def timed(fn: Callable[[], int]) -> tuple[float, float, int]:
    c0, w0 = time.process_time(), time.perf_counter()
    n = fn()
    return time.process_time() - c0, time.perf_counter() - w0, n


def spread(xs: list[float], fmt: str) -> str:
    return f"{format(statistics.median(xs), fmt)} ({format(min(xs), fmt)}-{format(max(xs), fmt)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--files", type=int, default=4, help="files per shape")
    ap.add_argument("--lines-per-file", type=int, default=20_000)
    ap.add_argument("--shapes", nargs="+", choices=sorted(shapes()), default=list(shapes()))
    args = ap.parse_args()
    summary: dict[str, Any] = {"runs": args.runs, "lines_per_file": args.lines_per_file, "files": args.files}
    for shape in args.shapes:
        kind, settings = shapes()[shape]
        files = files_of(kind, settings, args.files, args.lines_per_file)
        names = [f"{shape}-{i}.jsonl" for i in range(len(files))]
        clean = [good_lines_only(n, f, kind) for n, f in zip(names, files, strict=True)]
        quarantined = sum(f.count(b"\n") - c.count(b"\n") for f, c in zip(files, clean, strict=True))
        mb = sum(map(len, files)) / 1e6

        def ours(files: list[bytes] = files, names: list[str] = names, kind: str = kind) -> int:
            return sum(parse.parse_file(n, f, kind)[0].num_rows for n, f in zip(names, files, strict=True))

        def bare(clean: list[bytes] = clean, kind: str = kind) -> int:
            rows = 0
            for c in clean:
                t = pj.read_json(pa.BufferReader(c), read_options=parse._READ, parse_options=parse._PARSE[kind])
                rows += t.num_rows
            return rows

        ours()  # warm: imports, regex compilation, allocator
        bare()
        cpu: dict[str, list[float]] = {"parse_file": [], "pyarrow": []}
        wall: dict[str, list[float]] = {"parse_file": [], "pyarrow": []}
        events = {"parse_file": 0, "pyarrow": 0}
        for run in range(args.runs):
            order = [("parse_file", ours), ("pyarrow", bare)]
            for side, fn in order if run % 2 == 0 else order[::-1]:
                c, w, n = timed(fn)
                cpu[side].append(c)
                wall[side].append(w)
                events[side] = n
        ratios = [o / b for o, b in zip(cpu["parse_file"], cpu["pyarrow"], strict=True)]
        rate = {side: [events[side] / c for c in cpu[side]] for side in cpu}
        print(
            f"{shape}: {len(files)} {kind} files of {args.lines_per_file:,} lines, {mb:,.1f} MB, "
            f"{events['parse_file']:,} events, {quarantined} lines quarantined; {args.runs} alternating runs"
        )
        for side in ("parse_file", "pyarrow"):
            print(
                f"  {side:10s} cpu {spread(cpu[side], '.3f')} s, wall {spread(wall[side], '.3f')} s, "
                f"{spread(rate[side], ',.0f')} events/s per core"
            )
        print(f"  ratio parse_file / pyarrow (cpu, per run): {spread(ratios, '.2f')}")
        summary[f"parse_file_events_per_s_{shape}"] = round(statistics.median(rate["parse_file"]))
        summary[f"pyarrow_events_per_s_{shape}"] = round(statistics.median(rate["pyarrow"]))
        summary[f"ratio_to_pyarrow_{shape}"] = round(statistics.median(ratios), 3)
        summary[f"ratio_spread_{shape}"] = [round(min(ratios), 3), round(max(ratios), 3)]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
