"""`photon status`: how each pipeline is doing, from the registry's main server and the files it reads and writes.

Per pipeline: its last committed batch and when, the lease holding it and its last heartbeat, its lag (the oldest
closed log file of its data center it has not consumed yet, and how long that file has waited), the clicks waiting
in its retry set (and how many are due), and over a recent window its click latency, clicks, joins and wasted share
(clicks it joined but lost at registration to the other pipeline, per click it read). Read-only everywhere.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from photon.logs.layout import list_closed
from photon.pg import autocommit

US = 1_000_000
BACKFILL_PREFIX = "backfill-"


def when(us: int | None) -> str:
    """A time a person reads: UTC, to the second."""
    if us is None:
        return "never"
    return datetime.fromtimestamp(us / US, tz=UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def ago(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7_200:
        return f"{seconds / 60:.0f} min ago"
    if seconds < 172_800:
        return f"{seconds / 3_600:.1f} h ago"
    return f"{seconds / 86_400:.1f} days ago"


def _dc_of(pipeline: str, out: Path | None) -> str | None:
    """The data center a pipeline reads: recorded by the joiner in ``<out>/<pipeline>/_pipeline.json``."""
    if out is not None:
        meta = out / pipeline / "_pipeline.json"
        try:
            return str(json.loads(meta.read_text())["dc"])
        except (OSError, ValueError, KeyError):
            pass
    if pipeline.startswith(BACKFILL_PREFIX):  # backfill-<dc>-<YYYYmmddHHMM>
        return pipeline[len(BACKFILL_PREFIX) :].rsplit("-", 1)[0]
    return pipeline


def _oldest_unconsumed(cur: Any, pipeline: str, folder: Path, kind: str, since: str | None) -> tuple[str, float] | None:
    """(name, mtime) of the oldest closed file in ``folder`` the pipeline has not consumed, listed as its joiner
    lists them: from the partition its last batch recorded on."""
    names = [f.rel for f in list_closed(folder, since)]
    if not names:
        return None
    cur.execute(
        "SELECT name FROM photon.consumed_files WHERE pipeline = %s AND kind = %s AND name = ANY(%s)",
        (pipeline, kind, names),
    )
    consumed = {r[0] for r in cur.fetchall()}
    oldest: tuple[str, float] | None = None
    for n in names:
        if n in consumed:
            continue
        try:
            mtime = os.stat(folder / n).st_mtime
        except FileNotFoundError:
            continue
        if oldest is None or mtime < oldest[1]:
            oldest = (n, mtime)
    return oldest


def handover_gaps(cur: Any, pipeline: str, since_us: int) -> list[float]:
    """Seconds between the last batch of one lease and the first batch of the next (the time a hand-over joined
    nothing), for the leases that started since ``since_us``."""
    cur.execute(
        "SELECT min(m.started_at_us), max(m.started_at_us + (m.duration_s * 1e6)::bigint) FROM photon.batch_metrics m"
        " WHERE m.pipeline = %s AND m.epoch >= coalesce((SELECT max(epoch) FROM photon.batch_metrics"
        "  WHERE pipeline = %s AND started_at_us < %s), 0) GROUP BY m.epoch ORDER BY m.epoch",
        (pipeline, pipeline, since_us),
    )
    leases = cur.fetchall()
    return [round((nxt[0] - prev[1]) / US, 3) for prev, nxt in itertools.pairwise(leases)]


def _retries(out: Path | None, pipeline: str, batch: int, epoch: int | None, now_us: int) -> dict[str, int] | None:
    """Clicks in the retry set the last committed batch left, and how many of them are due now."""
    if out is None or epoch is None:
        return None
    import pyarrow.parquet as pq

    from photon.joiner.common import batch_tag

    folder = out / pipeline / "_state" / "retries" / batch_tag(batch, epoch)
    parts = sorted(folder.glob("*.parquet")) if folder.is_dir() else []
    if not parts:
        return {"waiting": 0, "due": 0}
    due = pq.read_table(folder, columns=["due_us"])["due_us"].to_pylist()
    return {"waiting": len(due), "due": sum(1 for d in due if d <= now_us)}


def pipeline_status(
    main_dsn: str,
    *,
    logs: Path | None = None,
    out: Path | None = None,
    pipelines: Iterable[str] = (),
    window_s: float = 300.0,
) -> list[dict[str, Any]]:
    """One record per pipeline (all, or those named), ordered live first, then backfills, by name."""
    wanted = list(pipelines)
    with autocommit(main_dsn, guard=False) as conn, conn.cursor() as cur:  # read-only: diagnoses a refused server too
        cur.execute("SELECT photon.clock_us()")
        now_us = int(cur.fetchone()[0])
        cur.execute(
            "SELECT p.pipeline, p.epoch, p.last_batch, p.lease_owner,"
            " (extract(epoch FROM p.lease_started_at) * 1e6)::bigint,"
            " (extract(epoch FROM p.heartbeat_at) * 1e6)::bigint,"
            " (extract(epoch FROM b.committed_at) * 1e6)::bigint, b.epoch, b.queries_from, b.clicks_from"
            " FROM photon.pipelines p LEFT JOIN photon.batches b"
            " ON b.pipeline = p.pipeline AND b.batch_seq = p.last_batch"
            " WHERE cardinality(%s::text[]) = 0 OR p.pipeline = ANY(%s::text[])"
            " ORDER BY p.pipeline LIKE 'backfill-%%', p.pipeline",
            (wanted, wanted),
        )
        rows = cur.fetchall()
        unknown = sorted(set(wanted) - {r[0] for r in rows})
        if unknown:
            raise ValueError(f"no pipeline named {', '.join(unknown)} in the registry")
        records = []
        for pipeline, epoch, last_batch, holder, lease_at, beat_at, batch_at, batch_epoch, *marks in rows:
            cur.execute(
                "SELECT count(*), coalesce(sum(clicks), 0), coalesce(sum(joined), 0), coalesce(sum(wasted), 0),"
                " percentile_cont(0.5) WITHIN GROUP (ORDER BY latency_p50_s), max(latency_p90_s),"
                " max(latency_p99_s) FROM photon.batch_metrics WHERE pipeline = %s AND started_at_us >= %s",
                (pipeline, now_us - int(window_s * US)),
            )
            batches, clicks, joined, wasted, p50, p90, p99 = cur.fetchone()
            gaps = handover_gaps(cur, pipeline, now_us - int(window_s * US))
            dc = _dc_of(pipeline, out)
            lag: dict[str, Any] | None = None
            if logs is not None and dc is not None:
                lag = {}
                for kind, since in zip(("queries", "clicks"), marks, strict=True):
                    found = _oldest_unconsumed(cur, pipeline, logs / dc / kind, kind, since)
                    lag[kind] = (
                        None if found is None else {"file": found[0], "waiting_s": round(now_us / US - found[1], 3)}
                    )
            records.append(
                {
                    "pipeline": pipeline,
                    "kind": "backfill" if pipeline.startswith(BACKFILL_PREFIX) else "live",
                    "dc": dc,
                    "epoch": int(epoch),
                    "last_batch": int(last_batch),
                    "last_batch_at_us": batch_at,
                    "last_batch_age_s": None if batch_at is None else round((now_us - batch_at) / US, 3),
                    "lease_holder": holder,
                    "lease_started_at_us": lease_at,
                    "heartbeat_at_us": beat_at,
                    "heartbeat_age_s": None if beat_at is None else round((now_us - beat_at) / US, 3),
                    "lag": lag,
                    "retries": _retries(out, pipeline, int(last_batch), batch_epoch, now_us),
                    "recent": {
                        "window_s": window_s,
                        "batches": int(batches),
                        "clicks": int(clicks),
                        "joined": int(joined),
                        "wasted": int(wasted),
                        "wasted_share": round(int(wasted) / int(clicks), 4) if clicks else None,
                        "latency_p50_s": p50,
                        "latency_p90_s": p90,
                        "latency_p99_s": p99,
                        "handover_gaps_s": gaps,
                    },
                }
            )
    return records
