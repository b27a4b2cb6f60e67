"""`photon status`: how each pipeline is doing, from the registry's main server and the files it reads and writes.

Per pipeline: its state (running, idle between leases, finished, stalled), its last committed batch and when, the
lease holding it and its last heartbeat, its lag (the oldest closed log file of its data center it has not consumed
yet, and how long that file has waited; how far its listing is behind the newest log partition; for one created with a
start, the history before it that no pipeline has consumed), the clicks waiting in its retry set (and how many are
due), and over a recent window its click latency, clicks, joins and wasted share (clicks it joined but lost at
registration to the other pipeline, per click it read). Read-only everywhere.

A backfill joins one window of its data center's logs, which the registry does not record: the files outside it are
not its lag, so a backfill has none; its state says whether its run is over (``finished``: it released its lease,
which ``photon join --until-caught-up`` does once caught up).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

from photon.logs.layout import list_closed, part_of_name, partition_of, partition_start_us
from photon.pg import autocommit
from photon.settings import load_settings
from photon.storage import Store, as_store

US = 1_000_000
BACKFILL_PREFIX = "backfill-"
# A lease whose heartbeat is older than this is taken for dead, as a standby judges it (three heartbeat periods).
STALE_S = 15.0


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


def span(seconds: float) -> str:
    """A duration a person reads: seconds, minutes, hours or days."""
    return ago(seconds).removesuffix(" ago")


def lag_lines(record: dict[str, Any]) -> list[str]:
    """The lag as lines a person reads: how far behind the logs a live pipeline is (when a couple of partitions or
    more), how long its oldest unconsumed file has waited, and the history before its start that no pipeline has
    consumed (a backfill to run)."""
    lag = record["lag"]
    if lag is None:
        return ["? (no logs folder)"]
    waits = [(v["waiting_s"], k) for k, v in lag.items() if v is not None]
    lines = ["caught up" if not waits else f"{max(waits)[1]}: oldest waiting {max(waits)[0]:,.0f} s"]
    behind = record.get("behind_s")
    if behind is not None and behind >= 120:  # a caught-up pipeline is within a minute or two of the newest one
        lines.insert(0, f"{span(behind)} behind the logs")
    history = record.get("history")
    if history and history["files"]:
        hours = ", ".join(history["hours"][:4]) + (", ..." if len(history["hours"]) > 4 or history["unread"] else "")
        lines.append(f"history before its start: {history['files']:,} click files consumed by no pipeline ({hours})")
    return lines


def _dc_of(pipeline: str, out: Store | None) -> str | None:
    """The data center a pipeline reads: recorded by the joiner in ``<out>/<pipeline>/_pipeline.json``."""
    if out is not None:
        try:
            return str(json.loads(out.get(f"{pipeline}/_pipeline.json"))["dc"])
        except (OSError, ValueError, KeyError):
            pass
    if pipeline.startswith(BACKFILL_PREFIX):  # backfill-<dc>-<YYYYmmddHHMM>
        return pipeline[len(BACKFILL_PREFIX) :].rsplit("-", 1)[0]
    return pipeline


def state_of(kind: str, lease_holder: str | None, heartbeat_age_s: float | None) -> str:
    """``running`` (a lease holds the pipeline and beats), ``stalled`` (a lease holds it but its heartbeat stopped: it
    died, and the next lease or a standby takes over), else ``finished`` for a backfill (its run released the
    pipeline) and ``idle`` for a live pipeline (between leases, or its DAG paused)."""
    if lease_holder is None:
        return "finished" if kind == "backfill" else "idle"
    if heartbeat_age_s is None or heartbeat_age_s > STALE_S:
        return "stalled"
    return "running"


def _oldest_unconsumed(
    cur: Any, pipeline: str, folder: Store, kind: str, since: str | None, start_us: int | None = None
) -> tuple[tuple[str, float] | None, str | None, str | None]:
    """((name, mtime) of the oldest closed file in ``folder`` the pipeline has not consumed, the oldest partition
    holding such a file, the newest partition listed), listed as its joiner lists them: from the partition its last
    batch recorded on, without the history before a live pipeline's start (``start_us``: a backfill's)."""
    # Imported here: the joiner package loads pyarrow, which `photon --help` must not.
    from photon.joiner.discovery import first_event_us, is_after_start

    files = list(list_closed(folder, since))
    names = [f.rel for f in files]
    newest = max((f.part for f in files if f.part is not None), default=None)
    if not names:
        return None, None, newest
    cur.execute(
        "SELECT name FROM photon.consumed_files WHERE pipeline = %s AND kind = %s AND name = ANY(%s)",
        (pipeline, kind, names),
    )
    consumed = {r[0] for r in cur.fetchall()}
    oldest: tuple[str, float] | None = None
    oldest_part: str | None = None
    for f in files:
        if f.rel in consumed:
            continue
        try:
            entry = f.entry or folder.head(f.rel)  # an object store's come with the listing
            if entry is None:
                continue  # gone since the listing
            mtime = entry.modified_us / US
            if start_us is not None and not is_after_start(f.rel, start_us, partial(first_event_us, folder, f.rel)):
                continue
        except FileNotFoundError:
            continue
        if oldest is None or mtime < oldest[1]:
            oldest = (f.rel, mtime)
        if f.part is not None and (oldest_part is None or f.part < oldest_part):
            oldest_part = f.part
    return oldest, oldest_part, newest


def _history_scope(cur: Any, out: Store | None) -> tuple[str | None, dict[str, str | None]]:
    """For the history report: the oldest partition whose consumed-file records GC has kept (those behind the
    registry's horizon are forgotten, and their clicks with them; the GC threshold of this server's shards, moved
    in the same run; None if GC has not run here), and every pipeline's data center."""
    cur.execute("SELECT max(gc_threshold_us) FROM photon.shard_state")
    threshold = cur.fetchone()[0]
    cur.execute("SELECT pipeline FROM photon.pipelines")
    of_dc = {str(p): _dc_of(str(p), out) for (p,) in cur.fetchall()}
    return (partition_of(int(threshold)) if threshold else None), of_dc


def handover_gaps(
    cur: Any,
    pipeline: str,
    since_us: int,
    *,
    logs: Store | None = None,
    current: tuple[int, int | None] | None = None,
) -> list[float]:
    """Seconds input waited for a lease at each hand-over, for the leases that started since ``since_us``.

    Between one lease's last batch (ended at T1) and the first batch of the next lease that committed one (started at
    T2), input waited from the later of T1 and the arrival of the first file that batch read, to T2. Time between
    leases with nothing to read is not a gap: a quiet data center's idle leases (they commit no batch) left the first
    file after them waiting only from its arrival. And where the next lease is the one holding the pipeline now
    (``current``: its epoch and start) and it started before that file arrived, it was idle, not handing over: no gap.
    A file's arrival is its modification time under ``logs`` (the data center's folder), else the start of its arrival
    partition (the minute it arrived in: a gap may then read up to a minute long); a batch that read no file (only
    retries) waited from T1."""
    cur.execute(
        "SELECT m.epoch, min(m.batch_seq), min(m.started_at_us),"
        " max(m.started_at_us + (m.duration_s * 1e6)::bigint) FROM photon.batch_metrics m"
        " WHERE m.pipeline = %s AND m.epoch >= coalesce((SELECT max(epoch) FROM photon.batch_metrics"
        "  WHERE pipeline = %s AND started_at_us < %s), 0) GROUP BY m.epoch ORDER BY m.epoch",
        (pipeline, pipeline, since_us),
    )
    leases = cur.fetchall()
    gaps = []
    for (_, _, _, prev_end), (epoch, first_seq, first_start, _) in itertools.pairwise(leases):
        cur.execute(
            "SELECT kind, name FROM photon.consumed_files WHERE pipeline = %s AND batch_seq = %s", (pipeline, first_seq)
        )
        arrivals = [a for kind, name in cur.fetchall() if (a := _arrival_us(logs, kind, name)) is not None]
        waiting_from = max(int(prev_end), min(arrivals)) if arrivals else int(prev_end)
        if current is not None and current[0] == epoch and current[1] is not None and current[1] <= waiting_from:
            continue  # the lease running now was already there when its input came: idle, then joining
        if first_start > waiting_from:
            gaps.append(round((int(first_start) - waiting_from) / US, 3))
    return gaps


def _arrival_us(logs: Store | None, kind: str, name: str) -> int | None:
    """When a consumed file arrived: its modification time, else its arrival partition's start (None: unknown)."""
    if logs is not None:
        try:
            entry = logs.head(f"{kind}/{name}")
        except (OSError, ValueError):  # unreachable, or a name no key can have
            entry = None
        if entry is not None:
            return entry.modified_us
    part = part_of_name(name)
    try:
        return partition_start_us(part) if part is not None else None
    except ValueError:  # not a partition folder
        return None


def _retries(out: Store | None, pipeline: str, batch: int, epoch: int | None, now_us: int) -> dict[str, int] | None:
    """Clicks in the retry set the last committed batch left, and how many of them are due now (None: unknown,
    without the output folder)."""
    if batch == 0:
        return {"waiting": 0, "due": 0}  # no batch committed, so no retry set
    if out is None or epoch is None:
        return None
    import pyarrow as pa
    import pyarrow.parquet as pq

    from photon.joiner.common import batch_tag

    folder = f"{pipeline}/_state/retries/{batch_tag(batch, epoch)}"
    parts = [e.key for e in out.files(folder) if e.key.endswith(".parquet")]
    if not parts:
        return {"waiting": 0, "due": 0}
    due = [pq.read_table(pa.BufferReader(out.get(key)), columns=["due_us"])["due_us"].to_pylist() for key in parts]
    return {"waiting": sum(map(len, due)), "due": sum(1 for d in itertools.chain(*due) if d <= now_us)}


def _tables(out: Store | None, pipeline: str, now_us: int) -> dict[str, dict[str, Any]] | None:
    """Per output table of the pipeline: its Delta version, last published batch (its txn version), files and bytes
    in the current snapshot, data files on disk (those of replaced or never-committed batches too, until maintenance
    vacuums them) and when it was last committed, and how long ago. One open of each table: its snapshot answers all
    but the files on disk. None without the output folder."""
    from photon.logs import tables
    from photon.logs.schemas import OUTPUT_KINDS
    from photon.tools.maintenance import table_facts

    if out is None:
        return None
    found: dict[str, dict[str, Any]] = {}
    for kind in OUTPUT_KINDS:
        for t in tables.tables(out, kind, [pipeline]):
            dt = t.table()
            facts = table_facts(t, dt)
            last = dt.history(1)
            at_us = int(last[0]["timestamp"]) * 1000 if last else None
            found[kind] = {
                "version": facts.version,
                "published_batch": facts.published_batch,
                "files": facts.files,
                "bytes": facts.bytes,
                "files_on_disk": facts.files_on_disk,
                "last_commit_at_us": at_us,
                "last_commit_age_s": None if at_us is None else round(max(0, now_us - at_us) / US, 3),
            }
    return found


def pipeline_status(
    main_dsn: str,
    *,
    logs: Path | Store | str | None = None,
    out: Path | Store | str | None = None,
    pipelines: Iterable[str] = (),
    window_s: float = 300.0,
) -> list[dict[str, Any]]:
    """One record per pipeline (all, or those named), ordered live first, then backfills, by name. ``logs`` and
    ``out``: folders or object stores."""
    from photon.joiner.discovery import history_left, start_marks

    logs = None if logs is None else as_store(logs)
    out = None if out is None else as_store(out)

    wanted = list(pipelines)
    with autocommit(main_dsn, guard=False) as conn, conn.cursor() as cur:  # read-only: diagnoses a refused server too
        cur.execute("SELECT photon.clock_us()")
        now_us = int(cur.fetchone()[0])
        cur.execute(
            "SELECT p.pipeline, p.epoch, p.last_batch, p.lease_owner,"
            " (extract(epoch FROM p.lease_started_at) * 1e6)::bigint,"
            " (extract(epoch FROM p.heartbeat_at) * 1e6)::bigint,"
            " (extract(epoch FROM b.committed_at) * 1e6)::bigint, b.epoch, p.start_us, b.queries_from, b.clicks_from"
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
        seal_s = load_settings().seal_s
        history_since, of_dc = _history_scope(cur, out)
        records = []
        for pipeline, epoch, last_batch, holder, lease_at, beat_at, batch_at, batch_epoch, start_us, *marks in rows:
            cur.execute(
                "SELECT count(*), coalesce(sum(clicks), 0), coalesce(sum(joined), 0), coalesce(sum(wasted), 0),"
                " percentile_cont(0.5) WITHIN GROUP (ORDER BY latency_p50_s), max(latency_p90_s),"
                " max(latency_p99_s) FROM photon.batch_metrics WHERE pipeline = %s AND started_at_us >= %s",
                (pipeline, now_us - int(window_s * US)),
            )
            batches, clicks, joined, wasted, p50, p90, p99 = cur.fetchone()
            dc = _dc_of(pipeline, out)
            gaps = handover_gaps(
                cur,
                pipeline,
                now_us - int(window_s * US),
                logs=None if logs is None or dc is None else logs.child(dc),
                current=None if holder is None else (int(epoch), lease_at),
            )
            kind = "backfill" if pipeline.startswith(BACKFILL_PREFIX) else "live"
            live = kind == "live"
            beat_age = None if beat_at is None else round((now_us - beat_at) / US, 3)
            lag: dict[str, Any] | None = None
            behind_s: float | None = None
            history: dict[str, Any] | None = None
            if logs is not None and dc is not None and live:
                lag, parts = {}, []
                if batch_epoch is None and start_us is not None:  # no batch yet: where its first lease lists from
                    marks = list(start_marks(int(start_us), now_us, seal_s).values())
                for log_kind, since in zip(("queries", "clicks"), marks, strict=True):
                    start = int(start_us) if start_us is not None and log_kind == "clicks" else None
                    found, oldest_part, newest = _oldest_unconsumed(
                        cur, pipeline, logs.child(f"{dc}/{log_kind}"), log_kind, since, start
                    )
                    lag[log_kind] = (
                        None if found is None else {"file": found[0], "waiting_s": round(now_us / US - found[1], 3)}
                    )
                    parts.append((oldest_part, newest))
                # Lag: how far behind the newest log partition its listing is (a live pipeline joining old history
                # shows it here, not only in its latency); 0 when it has consumed every file it lists.
                newest_part = max((n for _, n in parts if n is not None), default=None)
                oldest_parts = [o for o, _ in parts if o is not None]
                if live:
                    behind_s = 0.0
                    if oldest_parts and newest_part is not None:
                        behind_s = (partition_start_us(newest_part) - partition_start_us(min(oldest_parts))) / US
                if live and start_us is not None:
                    pipelines_of_dc = [p for p, d in of_dc.items() if d == dc]
                    history = history_left(
                        cur, logs.child(f"{dc}/clicks"), int(start_us), pipelines_of_dc, seal_s, since=history_since
                    )
            records.append(
                {
                    "pipeline": pipeline,
                    "kind": kind,
                    "state": state_of(kind, holder, beat_age),
                    "dc": dc,
                    "start_us": start_us,  # where it started reading; None: the beginning of the logs
                    "behind_s": behind_s,
                    "history": history,
                    "epoch": int(epoch),
                    "last_batch": int(last_batch),
                    "last_batch_at_us": batch_at,
                    "last_batch_age_s": None if batch_at is None else round((now_us - batch_at) / US, 3),
                    "lease_holder": holder,
                    "lease_started_at_us": lease_at,
                    "heartbeat_at_us": beat_at,
                    "heartbeat_age_s": beat_age,
                    "lag": lag,
                    "retries": _retries(out, pipeline, int(last_batch), batch_epoch, now_us),
                    "tables": _tables(out, pipeline, now_us),
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
