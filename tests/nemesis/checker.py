"""The nemesis's checker. It reads files only (the pipelines' Parquet output, the logs, the generator's manifest) and
shares no code with what it checks: no ``photon`` import, its own reading of every format, from ``EVENTS.md``.

- :func:`duplicates`: click ids that appear more than once across every ``joined/`` folder (must be none, at every
  moment).
- :func:`final`: once the input stopped and the verifier ran, every click has exactly one outcome; every click that
  must be joined is joined, to its own query; every malformed line is quarantined. A click joined although its
  query came after its deadline is allowed (a lease that was down looks late) and counted as a note.
  "Must be joined" is the manifest's ``join``; when a data center was lost for good, a click must be joined only if
  its query reached a surviving replica at least the margin before the click's deadline (only the lost replica may
  have had it in time).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

US = 1_000_000


def _parquet_files(out: Path, kind: str) -> list[Path]:
    files = []
    if not out.is_dir():
        return files
    for pipeline in sorted(os.listdir(out)):
        folder = out / pipeline / kind
        if pipeline.startswith(("_", ".")) or not folder.is_dir():
            continue
        files += [folder / n for n in sorted(os.listdir(folder)) if n.endswith(".parquet") and n[0] not in "._"]
    return files


def _column(files: list[Path], *columns: str) -> list[tuple]:
    rows: list[tuple] = []
    for f in files:
        t = pq.read_table(f, columns=list(columns))
        rows += list(zip(*(t[c].to_pylist() for c in columns), strict=True))
    return rows


def duplicates(out: Path) -> list[str]:
    counts = Counter(cid for (cid,) in _column(_parquet_files(out, "joined"), "click_id"))
    return sorted(cid for cid, n in counts.items() if n > 1)


@dataclass
class Verdict:
    clicks: int = 0
    joined: int = 0
    unjoinable: int = 0
    must_join: int = 0
    violations: dict[str, list[str]] = field(default_factory=dict)
    notes: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, ids: list[str]) -> None:
        if ids:
            self.violations[kind] = sorted(ids)

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "clicks": self.clicks,
            "joined": self.joined,
            "unjoinable": self.unjoinable,
            "must_join": self.must_join,
            "violations": {k: {"count": len(v), "first": v[:5]} for k, v in self.violations.items()},
            "notes": self.notes,
        }


def _query_arrivals(logs: Path, dc: str, arrival: dict[tuple[str, str, str], int]) -> dict[str, int]:
    """query id -> when its file reached ``dc``'s replica (the earliest, if it was logged twice)."""
    out: dict[str, int] = {}
    folder = logs / dc / "queries"
    # Files sit in arrival partitions (<YYYYmmdd>/<HHMM>/) and are named by their path under the folder.
    names = sorted(
        os.path.relpath(os.path.join(d, n), folder) for d, _, ns in os.walk(folder) for n in ns if n.endswith(".jsonl")
    )
    for name in names:
        if (dc, "queries", name) not in arrival:
            continue
        at = arrival[(dc, "queries", name)]
        for line in (folder / name).read_bytes().split(b"\n"):
            try:
                qid = json.loads(line)["query_id"]
            except (ValueError, TypeError, KeyError, UnicodeDecodeError):
                continue
            if isinstance(qid, str):
                out[qid] = min(at, out.get(qid, at))
    return out


def final(logs: Path, out: Path, *, lost: list[str], max_join_delay_s: float, margin_s: float) -> Verdict:
    v = Verdict()
    manifest = pq.read_table(logs / "_manifest" / "clicks.parquet").to_pylist()
    files = pq.read_table(logs / "_manifest" / "files.parquet").to_pylist()
    v.clicks = len(manifest)
    joined = _column(_parquet_files(out, "joined"), "click_id", "query_id")
    unjoinable = {cid for (cid,) in _column(_parquet_files(out, "unjoinable"), "click_id")}
    times = Counter(cid for cid, _ in joined)
    query_of = dict(joined)
    v.joined, v.unjoinable = len(times), len(unjoinable - times.keys())
    v.add("duplicate", [c for c, n in times.items() if n > 1])
    truth = {r["click_id"]: r for r in manifest}
    v.add("invented", [c for c in times if c not in truth])
    v.add("wrong_query", [c for c, q in query_of.items() if c in truth and truth[c]["query_id"] != q])
    v.add("no_outcome", [c for c in truth if c not in times and c not in unjoinable])
    # Joined although its query reached every replica after the deadline: allowed (the contract bounds how long a
    # click must wait, and a lease that was down looks late, when both are there); counted, not a violation.
    v.notes["joined_late"] = sum(1 for c in times if c in truth and truth[c]["expect"] == "unjoinable")
    survivors = sorted({f["dc"] for f in files} - set(lost))
    arrival = {(f["dc"], f["kind"], f["name"]): int(f["arrival_us"]) for f in files}
    reached = [_query_arrivals(logs, dc, arrival) for dc in survivors] if lost else []
    must = []
    for c, r in truth.items():
        if r["expect"] != "join":
            continue
        if lost:
            deadline = r["click_ts_us"] + int((max_join_delay_s - margin_s) * US)
            if not any(q.get(r["query_id"], deadline + 1) <= deadline for q in reached):
                continue  # only a lost replica had its query in time
        must.append(c)
    v.must_join = len(must)
    v.add("must_join_not_joined", [c for c in must if c not in times])
    quarantined = {(k, f, line) for k, f, line in _column(_parquet_files(out, "quarantine"), "kind", "file", "line")}
    # A file is named by its arrival partition and name, so each replica's copy is counted by its own name.
    per_file = Counter((k, n) for k, n, _ in quarantined)
    missing = []
    for f in files:
        if f["dc"] in survivors and f["malformed"]:
            found = per_file[(f["kind"], f["name"])]
            if found < f["malformed"]:
                missing.append(f"{f['dc']}/{f['kind']}/{f['name']}: {found} of {f['malformed']}")
    v.add("malformed_not_quarantined", missing)
    return v
