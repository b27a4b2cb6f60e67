"""The nemesis's checker. It reads files only (the pipelines' Delta tables, the logs, the generator's manifest) and
shares no code with what it checks: no ``photon`` import, its own reading of every format, from ``EVENTS.md``. The
output and the logs are a folder or an ``s3://bucket/prefix`` (read with deltalake and obstore directly, the
standard AWS variables for the endpoint and the keys).

- :func:`duplicates`: click ids that appear more than once across every ``joined`` table's snapshot (must be none,
  at every moment).
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
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pyarrow.parquet as pq
from deltalake import DeltaTable

if TYPE_CHECKING:
    from obstore.store import RetryConfig, S3Config

US = 1_000_000


Where = Path | str  # a folder, or an s3:// URL


def _s3_options() -> dict[str, str]:
    """The standard AWS variables, as deltalake and obstore take them."""
    names = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION")
    options = {n.lower(): os.environ[n] for n in names if os.environ.get(n)}
    if options.get("aws_endpoint_url", "").startswith("http://"):
        options["aws_allow_http"] = "true"
    return options


def _bucket(url: str) -> tuple[Any, str]:
    """An obstore client of ``url``'s bucket and the prefix (no trailing slash)."""
    from obstore.store import S3Store

    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    # Retried for a minute (the chaos run restarts the store under it), pausing up to 2 s between tries.
    backoff = {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=2)}
    retry = {"max_retries": 1000, "retry_timeout": timedelta(seconds=60), "backoff": backoff}
    store = S3Store(bucket, config=cast("S3Config", _s3_options()), retry_config=cast("RetryConfig", retry))
    return store, prefix.strip("/")


def _folders(where: Where) -> list[str]:
    """The names of the folders directly in ``where``."""
    if isinstance(where, Path):
        return sorted(p for p in os.listdir(where) if (where / p).is_dir()) if where.is_dir() else []
    import obstore

    store, prefix = _bucket(where)
    found = obstore.list_with_delimiter(store, f"{prefix}/" if prefix else None)["common_prefixes"]
    return sorted(str(f).rstrip("/").rpartition("/")[2] for f in found)


def _read(where: Where, key: str) -> bytes:
    if isinstance(where, Path):
        return (where / key).read_bytes()
    import obstore

    store, prefix = _bucket(where)
    return bytes(obstore.get(store, f"{prefix}/{key}" if prefix else key).bytes())


def _keys(where: Where, under: str) -> list[str]:
    """Every file's key under ``where/under``, relative to ``under``."""
    if isinstance(where, Path):
        folder = where / under
        return [os.path.relpath(os.path.join(d, n), folder) for d, _, ns in os.walk(folder) for n in ns]
    import obstore

    store, prefix = _bucket(where)
    base = "/".join(p for p in (prefix, under.strip("/")) if p) + "/"
    return [str(m["path"]).removeprefix(base) for batch in obstore.list(store, base) for m in batch]


def _tables(out: Where, kind: str) -> list[tuple[str, str]]:
    """Every pipeline's ``kind`` table, (pipeline, table URI): a Delta table in each pipeline folder (``_*`` and
    ``.*`` folders are not pipelines; a table not created yet holds nothing)."""
    found = []
    for p in _folders(out):
        if p.startswith(("_", ".")):
            continue
        uri = str(out / p / kind) if isinstance(out, Path) else f"{out.rstrip('/')}/{p}/{kind}"
        if DeltaTable.is_deltatable(uri, storage_options=_options_for(out)):
            found.append((p, uri))
    return found


def _options_for(where: Where) -> dict[str, str] | None:
    """deltalake's options: the bucket's, retried as the obstore client is."""
    retry = {"max_retries": "1000", "retry_timeout": "60s", "backoff_config.max_backoff": "2s"}
    return None if isinstance(where, Path) else _s3_options() | retry


def _snapshots(out: Where, kind: str, *columns: str) -> list[tuple[str, int | None, list[tuple]]]:
    """Per pipeline: its name, the last batch its ``kind`` table holds (the table's transaction version for
    ``photon/<pipeline>``, EVENTS.md) and ``columns`` of every row of that same snapshot, read through the Delta log
    (never the folder's files: a crashed batch's data files are there too, named by no commit). A row that is in a
    snapshot twice is here twice."""
    found = []
    for pipeline, uri in _tables(out, kind):
        table = DeltaTable(uri, storage_options=_options_for(out))
        t = table.to_pyarrow_dataset().to_table(columns=list(columns))
        rows = list(zip(*(t[c].to_pylist() for c in columns), strict=True))
        found.append((pipeline, table.transaction_version(f"photon/{pipeline}"), rows))
    return found


def _rows(out: Where, kind: str, *columns: str) -> list[tuple]:
    """``columns`` of every pipeline's ``kind`` rows, each table as of its current snapshot."""
    return [r for _, _, rows in _snapshots(out, kind, *columns) for r in rows]


def _hour(ts_us: int) -> str:
    """The ``hour`` partition a time belongs in (EVENTS.md): ``YYYYmmddHH``, UTC."""
    return time.strftime("%Y%m%d%H", time.gmtime(ts_us // US))


def wrong_hours(rows: list[tuple]) -> list[str]:
    """Of joined rows (click id, click time, hour), the clicks whose ``hour`` is not the UTC hour of their click."""
    return sorted(c for c, ts, h in rows if _hour(ts) != h)


def wrong_batches(snapshots: list[tuple[str, int | None, list[tuple]]]) -> list[str]:
    """Of rows (click id, batch) per table snapshot, the clicks whose ``batch`` is not one the snapshot holds: none,
    below 1, or past the table's last published batch of the pipeline."""
    return sorted(c for _, last, rows in snapshots for c, b in rows if b is None or not 1 <= b <= (last or 0))


def duplicates(out: Where) -> list[str]:
    """Click ids in more than one joined row, across every pipeline's table."""
    counts = Counter(cid for (cid,) in _rows(out, "joined", "click_id"))
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


def _query_arrivals(logs: Where, dc: str, arrival: dict[tuple[str, str, str], int]) -> dict[str, int]:
    """query id -> when its file reached ``dc``'s replica (the earliest, if it was logged twice)."""
    out: dict[str, int] = {}
    # Files sit in arrival partitions (<YYYYmmdd>/<HHMM>/) and are named by their path under the folder.
    names = sorted(n for n in _keys(logs, f"{dc}/queries") if n.endswith(".jsonl"))
    for name in names:
        if (dc, "queries", name) not in arrival:
            continue
        at = arrival[(dc, "queries", name)]
        for line in _read(logs, f"{dc}/queries/{name}").split(b"\n"):
            try:
                qid = json.loads(line)["query_id"]
            except (ValueError, TypeError, KeyError, UnicodeDecodeError):
                continue
            if isinstance(qid, str):
                out[qid] = min(at, out.get(qid, at))
    return out


def final(
    logs: Where,
    out: Where,
    *,
    lost: list[str],
    max_join_delay_s: float,
    margin_s: float,
    manifest_dir: Path | None = None,
) -> Verdict:
    """The verdict once the input stopped (the module's doc); the manifest in ``logs/_manifest`` unless the logs
    are in a bucket (``manifest_dir``: the generator's ``--manifest``)."""
    v = Verdict()
    if manifest_dir is None:
        assert isinstance(logs, Path), "logs in a bucket: name the manifest's folder"
        manifest_dir = logs / "_manifest"
    manifest = pq.read_table(manifest_dir / "clicks.parquet").to_pylist()
    files = pq.read_table(manifest_dir / "files.parquet").to_pylist()
    v.clicks = len(manifest)
    snapshots = _snapshots(out, "joined", "click_id", "query_id", "click_ts_us", "hour", "batch")
    joined = [r for _, _, rows in snapshots for r in rows]
    unjoinable = {cid for (cid,) in _rows(out, "unjoinable", "click_id")}
    times = Counter(cid for cid, *_ in joined)
    query_of = {cid: q for cid, q, *_ in joined}
    v.joined, v.unjoinable = len(times), len(unjoinable - times.keys())
    v.add("duplicate", [c for c, n in times.items() if n > 1])
    v.add("wrong_hour", wrong_hours([(cid, ts, h) for cid, _, ts, h, _ in joined]))
    v.add("wrong_batch", wrong_batches([(p, last, [(r[0], r[4]) for r in rows]) for p, last, rows in snapshots]))
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
    quarantined = {(k, f, line) for k, f, line in _rows(out, "quarantine", "kind", "file", "line")}
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
