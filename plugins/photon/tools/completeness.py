"""Is interval ``[start, end)`` final? Every click of its input has been decided, so its output will not change:
what a billing consumer waits for before it reads an hour (DESIGN.md, "Completeness").

The interval's input is what data quality checks: the closed click files of the arrival partitions that start in it,
in every data center's replica, and the flat files directly in ``clicks/`` whose first event is stamped in it
(``photon.tools.quality.interval_click_files``; the verifier's ``recovered-*`` copies excluded). A replica holds the
same files under the same names, each in the partition of its own arrival, so a file is known by its name wherever
it lies, and a pipeline that consumed its copy in one replica decided its clicks for every replica.

:func:`decide_final` only reads, as the verifier's role (of the components' roles, the one that may read the consumed
files, the pipelines' state and the shards without writing the consumed files, which the joiner inserts and GC
deletes), by the registry main server's clock:

1. Time: the server's clock is past ``end + max(seal_s, max_join_delay_s + max_clock_skew_s)``: the interval's
   partitions are sealed, so no click file can still land in it (EVENTS.md), and an honestly stamped click has had its
   whole join delay. Clicks whose delay runs from later (stamped ahead, recovered, or read late) are found in 6.
2. Pipelines: each one's data center (``_pipeline.json``), whether it is live (a heartbeat within ``lost_after_s``, the
   verifier's grace), its last committed batch and that batch's retry set size.
3. Publication: no committed batch is unpublished. A live joiner publishes right after its commit; a dead one's batch
   is rolled forward by the verifier after its grace. Until then its outcomes are not in the output.
4. Consumption: every file of the interval was consumed (``photon.consumed_files``, by name in any replica) by a
   pipeline that decided it or is still deciding it: a live pipeline, or a dead one that left no click waiting in its
   retry set (a dead pipeline's waiting clicks never get its outcome).
5. Lost data centers: a file no such pipeline consumed holds the interval back while a copy of it lies in the replica
   of a data center that has a live pipeline (which will take it). A data center whose every pipeline has been silent
   for ``lost_after_s`` is taken as lost: files only its replica holds do not hold the interval back for ever; they
   are counted in the decision (``unconsumed_in_lost``), and data quality reports their clicks if no other replica
   had them. With no live pipeline anywhere, an unconsumed file holds the interval back (nothing is deciding).
6. Then, the interval's clicks (its files parsed, once 1-5 hold): none waits in a live pipeline's retry set (the
   set its last committed batch left: a click there gets its outcome at a later batch, joined or, past its deadline,
   unjoinable); none is registered by a batch that is not published (in flight: its pipeline re-runs the batch, or
   the verifier recovers it); no verifier pass is re-dispatching clicks (``recovered-*.jsonl.inprogress``), and no
   click the verifier re-dispatched (``recovered-*.jsonl`` in a live data center's logs) waits for a pipeline to
   take it. The order matters: the registry is read before the re-dispatched files, so a click the verifier takes
   out of the registry in between is found in its re-dispatched file.

A data center that is taken as lost and then comes back can still change a final interval: its pipeline decides the
clicks it had waiting, and a click another pipeline gave up on may then be joined (once, the registry sees to it).
``lost_after_s`` is the trade between waiting for a data center and declaring without it.

:func:`write_marker` records a final decision as ``<out>/_final/<YYYYmmddHH>.json`` (an hour; other intervals
``<YYYYmmddHHMM>-<YYYYmmddHHMM>.json``), the contract non-Airflow readers poll (docs/EVENTS.md); the DAG
``photon_finality`` writes it and emits the Airflow asset event ``photon://final/hourly``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from photon.joiner.common import RECOVERED_PREFIX, batch_tag
from photon.logs.layout import MINUTE_US, data_center_of, list_closed, partition_of
from photon.logs.parse import parse_file
from photon.pg import autocommit
from photon.registry.client import MAIN, IdRegistry
from photon.registry.clock import CLOCK_SQL
from photon.settings import MAX_CLOCK_SKEW_S, time_bound_s
from photon.storage import LocalStore, NotFoundError, Store, as_store
from photon.tools.quality import interval_click_files, interval_clicks

log = logging.getLogger(__name__)

US = 1_000_000
HOUR_US = 3_600 * US
FINAL_DIR = "_final"  # <out>/_final/: starts with "_", so no reader takes it for a pipeline
FINAL_ASSET_URI = "photon://final/hourly"  # the Airflow asset photon_finality emits, once per final hour
MARKER_FORMAT = 1
BACKFILL_PREFIX = "backfill-"
SAMPLES = 3  # names or ids quoted in a reason


@dataclass(frozen=True)
class FinalitySettings:
    max_join_delay_s: float = 120.0  # the joiners' JoinSettings.max_join_delay_s
    max_clock_skew_s: float = MAX_CLOCK_SKEW_S  # as the joiners', whose seal follows it
    # A data center none of whose pipelines has heartbeated for this long is lost (the verifier's grace, 600 s by
    # default, after which it fences such a pipeline and recovers its registrations).
    lost_after_s: float = 600.0
    # Expected input (as data quality's min_click_files): an interval with fewer click files than this, every
    # replica's copy counted, is not final (log shipping stopped, or the wrong logs folder), unless ``allow_empty``
    # accepts it; the marker then says so (``empty_accepted``).
    min_click_files: int = 1
    allow_empty: bool = False

    @property
    def seal_s(self) -> float:
        return time_bound_s(self.max_clock_skew_s)

    def not_before_us(self, end_us: int) -> int:
        """The earliest server time at which the interval ending at ``end_us`` can be final (step 1)."""
        return end_us + int(max(self.seal_s, self.max_join_delay_s + self.max_clock_skew_s) * US)


@dataclass
class Finality:
    """A decision on one interval; ``reasons`` says why it is not final (empty when it is)."""

    start_us: int
    end_us: int
    final: bool
    decided_at_us: int  # the registry server's clock when decided
    not_before_us: int
    reasons: list[str] = field(default_factory=list)
    click_files: int = 0  # of every replica
    input_clicks: int | None = None  # distinct well-formed clicks of those files (None: not read, 1-5 failed)
    # Per data center: live (bool), click_files, consumed (its own pipelines), consumed_elsewhere (only by another
    # data center's pipeline), unconsumed.
    data_centers: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Per pipeline: dc, live, heartbeat_age_s, last_batch, interval_files (names of the interval's files it
    # consumed), waiting (its retry set's clicks of the interval; None: not read).
    pipelines: dict[str, dict[str, Any]] = field(default_factory=dict)
    lost_data_centers: list[str] = field(default_factory=list)  # no live pipeline (step 5)
    unconsumed_in_lost: int = 0  # files only lost data centers hold, consumed by no pipeline: not waited for
    in_flight: int | None = None  # clicks registered by batches not published
    redispatched_waiting: int | None = None  # clicks the verifier re-dispatched that no pipeline has taken yet
    empty_accepted: bool = False  # fewer click files than expected, declared all the same (allow_empty)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d |= {"start": iso(self.start_us), "end": iso(self.end_us), "decided_at": iso(self.decided_at_us)}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Finality:
        """The decision ``to_dict`` gave (passed between tasks as JSON)."""
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


def iso(ts_us: int) -> str:
    return datetime.fromtimestamp(ts_us / US, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def hour_interval(text: str) -> tuple[int, int]:
    """``[start, end)`` of the UTC hour ``2026-11-24T13`` (also ``2026-11-24T13:00``, ``...:00Z``, ``+00:00``)."""
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{text!r} is not an hour such as 2026-11-24T13 (UTC)") from None
    dt = dt.replace(tzinfo=UTC) if dt.tzinfo is None else dt.astimezone(UTC)
    if (dt.minute, dt.second, dt.microsecond) != (0, 0, 0):
        raise ValueError(f"{text!r} is not the start of an hour")
    start = int(dt.timestamp()) * US
    return start, start + HOUR_US


# -- the decision -------------------------------------------------------------------------------------------------


@dataclass
class _Pipeline:
    name: str
    dc: str
    live: bool
    heartbeat_age_s: float
    last_batch: int
    last_epoch: int | None
    retried: int | None  # the last batch's retry set size, from its metrics
    clicks_mark: str | None  # the oldest click partition it still lists

    @property
    def leaves_nothing_waiting(self) -> bool:
        return self.last_batch == 0 or self.retried == 0


def decide_final(
    servers: Mapping[str, str],
    logs: Path | Store | str,
    out: Path | Store | str,
    start_us: int,
    end_us: int,
    settings: FinalitySettings | None = None,
) -> Finality:
    """Whether ``[start_us, end_us)`` is final, and if not, why (the steps of the module's docstring)."""
    s = settings or FinalitySettings()
    logs, out = as_store(logs), as_store(out)
    # A wrong path would read as an hour without input: final, and billed as empty.
    if isinstance(logs, LocalStore) and not logs.root.is_dir():
        raise ValueError(f"logs folder {logs.root} does not exist: no interval can be judged without its input")
    main = servers[MAIN]
    with autocommit(main, application_name="photon-final") as conn, conn.cursor() as cur:
        # 1. Time, by the server's clock.
        cur.execute(CLOCK_SQL)
        now = int(cur.fetchone()[0])
        d = Finality(start_us, end_us, False, now, s.not_before_us(end_us))
        if now < d.not_before_us:
            d.reasons.append(
                f"the registry server's clock reads {iso(now)}; the interval can be final at {iso(d.not_before_us)}"
                f" at the earliest (its partitions seal {s.seal_s:g} s after its end, and its last clicks have"
                f" {s.max_join_delay_s:g} s to join, plus {s.max_clock_skew_s:g} s of clock skew)"
            )
        # 2. Pipelines.
        pipes = _pipelines(cur, out, s.lost_after_s)
        # 3. Publication.
        cur.execute("SELECT pipeline, batch_seq FROM photon.batches WHERE NOT published ORDER BY 1, 2")
        unpublished = [f"{p}/{b}" for p, b in cur.fetchall()]
        if unpublished:
            d.reasons.append(
                f"{len(unpublished)} committed batch(es) not published yet (their outcomes are not in the output):"
                f" {', '.join(unpublished[:SAMPLES])}"
            )
        # 4. Consumption, and 5. lost data centers.
        files = interval_click_files(logs, start_us, end_us)
        d.click_files = len(files)
        if len(files) < s.min_click_files:
            if s.allow_empty:
                d.empty_accepted = True
            else:
                d.reasons.append(
                    f"{len(files)} click file(s) in any replica under {logs.url}, where at least {s.min_click_files}"
                    " are expected: log shipping stopped, or the wrong logs folder (--allow-empty, photon_finality's"
                    " allow_empty, declares an interval without input final)"
                )
        by_dc: dict[str, list[str]] = {}
        for f in files:
            dc, _, rel = f.key.partition("/clicks/")
            by_dc.setdefault(dc, []).append(rel)
        consumed = _consumed_by_name(cur, by_dc, start_us, end_us, pipes)
        _judge_consumption(d, by_dc, consumed, pipes)
        if d.reasons:
            return d
    # 6. The interval's clicks.
    clicks = interval_clicks(files)
    d.input_clicks = clicks.num_rows
    ids = clicks["click_id"].combine_chunks() if clicks.num_rows else pa.array([], pa.string())
    _judge_retries(d, out, ids, pipes)
    _judge_registrations(d, servers, ids)
    _judge_redispatched(d, main, logs, start_us, ids, pipes)
    d.final = not d.reasons
    return d


def _pipeline_dc(out: Store, name: str) -> str:
    """The data center a pipeline reads: its ``_pipeline.json``, else a backfill's name (``backfill-<dc>-<start>``),
    else its own name."""
    try:
        return data_center_of(out, name)
    except (OSError, ValueError, KeyError):
        pass
    if name.startswith(BACKFILL_PREFIX):
        return name[len(BACKFILL_PREFIX) :].rsplit("-", 1)[0]
    return name


def _pipelines(cur: Any, out: Store, lost_after_s: float) -> dict[str, _Pipeline]:
    cur.execute(
        "SELECT p.pipeline, p.last_batch,"
        " extract(epoch FROM clock_timestamp() - coalesce(p.heartbeat_at, p.updated_at)), b.epoch, b.clicks_from,"
        " m.retried FROM photon.pipelines p"
        " LEFT JOIN photon.batches b ON b.pipeline = p.pipeline AND b.batch_seq = p.last_batch"
        " LEFT JOIN photon.batch_metrics m ON m.pipeline = p.pipeline AND m.batch_seq = p.last_batch ORDER BY 1"
    )
    pipes = {}
    for name, last, age, epoch, mark, retried in cur.fetchall():
        age_s = float(age or 0.0)
        pipes[name] = _Pipeline(
            name=name,
            dc=_pipeline_dc(out, name),
            live=age_s <= lost_after_s,
            heartbeat_age_s=round(age_s, 3),
            last_batch=int(last),
            last_epoch=None if epoch is None else int(epoch),
            retried=None if retried is None else int(retried),
            clicks_mark=mark,
        )
    return pipes


def _base(rel: str) -> str:
    return rel.rpartition("/")[2]


def _consumed_by_name(
    cur: Any, by_dc: Mapping[str, list[str]], start_us: int, end_us: int, pipes: Mapping[str, _Pipeline]
) -> dict[str, set[str]]:
    """File name -> the pipelines that consumed a click file of that name, in any replica and partition, by a batch
    they had committed when ``pipes`` was read: the retry set judged later is that batch's or a later one's (a file
    taken by a newer batch counts from the next decision on, once that batch's retry set is the one read)."""
    wanted = {_base(rel) for rels in by_dc.values() for rel in rels}
    found: dict[str, set[str]] = {}
    if not wanted or not pipes:
        return found

    def add(pipeline: str, name: str, batch: int) -> None:
        p = pipes.get(pipeline)
        if p is not None and batch <= p.last_batch:
            found.setdefault(_base(name), set()).add(pipeline)

    # The interval's own partitions first, by the index on (pipeline, kind, part); the flat files by name.
    first = partition_of(-(-start_us // MINUTE_US) * MINUTE_US)
    last = partition_of(end_us)  # exclusive: the partition starting at the end
    flat = sorted({rel for rels in by_dc.values() for rel in rels if "/" not in rel})
    cur.execute(
        "SELECT pipeline, name, batch_seq FROM photon.consumed_files WHERE pipeline = ANY(%s) AND kind = 'clicks'"
        " AND ((part >= %s AND part < %s) OR (part IS NULL AND name = ANY(%s)))",
        (sorted(pipes), first, last, flat),
    )
    for pipeline, name, batch in cur.fetchall():
        add(pipeline, name, int(batch))
    # A copy another replica received in another partition (earlier, or later than the interval): by its name
    # alone, which no index serves. Asked only for names not found so far that no live data center holds (a live
    # one's pipeline takes its own copy, in the interval, in time): a lost replica's, at the boundary of the hour.
    live_dcs = {p.dc for p in pipes.values() if p.live}
    held_live = {_base(rel) for dc, rels in by_dc.items() if dc in live_dcs for rel in rels}
    missing = sorted(wanted - set(found) - held_live)
    if missing:
        cur.execute(
            "SELECT pipeline, name, batch_seq FROM photon.consumed_files"
            " WHERE kind = 'clicks' AND regexp_replace(name, '^.*/', '') = ANY(%s)",
            (missing,),
        )
        for pipeline, name, batch in cur.fetchall():
            add(pipeline, name, int(batch))
    return found


def _judge_consumption(
    d: Finality, by_dc: Mapping[str, list[str]], consumed: Mapping[str, set[str]], pipes: Mapping[str, _Pipeline]
) -> None:
    """Steps 4 and 5: per data center, the files consumed by a pipeline that decides them, and what holds the
    interval back."""
    live_dcs = {p.dc for p in pipes.values() if p.live}
    for p in pipes.values():
        d.pipelines[p.name] = {
            "dc": p.dc,
            "live": p.live,
            "heartbeat_age_s": p.heartbeat_age_s,
            "last_batch": p.last_batch,
            "interval_files": 0,
            "waiting": None,
        }
    deciders = {n for n, p in pipes.items() if p.live or p.leaves_nothing_waiting}
    copies: dict[str, set[str]] = {}  # name -> data centers whose replica holds it in the interval
    for dc, rels in by_dc.items():
        for rel in rels:
            copies.setdefault(_base(rel), set()).add(dc)
    for by in consumed.values():
        for pipeline in by:
            if pipeline in d.pipelines:  # one created since step 2 is not judged
                d.pipelines[pipeline]["interval_files"] += 1
    waiting_for: dict[str, list[str]] = {}  # live data center -> its files no decider consumed
    for dc in sorted(set(by_dc) | live_dcs):
        rels = by_dc.get(dc, [])
        own = elsewhere = 0
        unconsumed = []
        for rel in rels:
            by = consumed.get(_base(rel), set()) & deciders
            if any(pipes[p].dc == dc for p in by):
                own += 1
            elif by:
                elsewhere += 1
            else:
                unconsumed.append(rel)
        d.data_centers[dc] = {
            "live": dc in live_dcs,
            "click_files": len(rels),
            "consumed": own,
            "consumed_elsewhere": elsewhere,
            "unconsumed": len(unconsumed),
        }
        if dc not in live_dcs:
            d.lost_data_centers.append(dc)
        elif unconsumed:
            waiting_for[dc] = unconsumed
    for dc, rels in waiting_for.items():
        d.reasons.append(
            f"{dc}: {len(rels):,} of {len(by_dc.get(dc, [])):,} click files not consumed yet by a pipeline that decides"
            f" them (e.g. {', '.join(sorted(rels)[:SAMPLES])})"
        )
    lost_only = {
        _base(rel)
        for dc in d.lost_data_centers
        for rel in by_dc[dc]
        if not consumed.get(_base(rel), set()) & deciders and not copies[_base(rel)] & set(waiting_for)
    }
    d.unconsumed_in_lost = len(lost_only)
    if lost_only and not live_dcs:
        d.reasons.append(
            f"{len(lost_only):,} click files are consumed by no pipeline that decides them, and no data center has a"
            " live pipeline (a heartbeat within the last lost_after_s) to take them"
        )
    elif lost_only:
        log.warning(
            "interval [%s, %s): %d click file(s) only in lost data center(s) %s, consumed by no pipeline: not waited"
            " for (their clicks have no outcome unless another replica had them)",
            iso(d.start_us), iso(d.end_us), len(lost_only), ", ".join(d.lost_data_centers),
        )  # fmt: skip


def _retry_ids(out: Store, p: _Pipeline) -> pa.Array | None:
    """The click ids waiting in the retry set of the pipeline's last committed batch; None if it cannot be read."""
    if p.leaves_nothing_waiting:
        return pa.array([], pa.string())
    if p.last_epoch is None:
        return None
    folder = f"{p.name}/_state/retries/{batch_tag(p.last_batch, p.last_epoch)}"
    try:
        parts = [e.key for e in out.files(folder) if e.key.endswith(".parquet")]
        if not parts:
            return None  # the metrics say it holds clicks: replaced by a newer batch's set since, or gone
        ids = [pq.read_table(pa.BufferReader(out.get(key)), columns=["click_id"])["click_id"] for key in parts]
        return pa.chunked_array([c for column in ids for c in column.chunks], pa.string()).combine_chunks()
    except (OSError, pa.ArrowInvalid):
        return None


def _judge_retries(d: Finality, out: Store, ids: pa.Array, pipes: Mapping[str, _Pipeline]) -> None:
    """A click of the interval waiting in a live pipeline's retry set has no outcome yet."""
    for p in pipes.values():
        if not p.live:
            continue  # a dead pipeline's files were judged in step 4 by its retry set's size
        waiting = _retry_ids(out, p)
        if waiting is None:
            d.reasons.append(
                f"{p.name}: the retry set of its batch {p.last_batch} cannot be read under"
                f" {out.location(p.name)}/_state (a newer batch may have replaced it: asked again later)"
            )
            continue
        mine = waiting.filter(pc.is_in(waiting, value_set=ids)) if len(waiting) else waiting
        d.pipelines[p.name]["waiting"] = len(mine)
        if len(mine):
            d.reasons.append(
                f"{p.name}: {len(mine):,} click(s) of the interval wait in its retry queue for their query (batch"
                f" {p.last_batch}; e.g. {', '.join(sorted(mine.to_pylist())[:SAMPLES])})"
            )


def _judge_registrations(d: Finality, servers: Mapping[str, str], ids: pa.Array) -> None:
    """A click registered under a batch's token whose batch is not published has no outcome yet (its pipeline re-runs
    the batch, or the verifier recovers it). A token is cleared once the verifier found the output committed."""
    d.in_flight = 0
    if not len(ids):
        return
    with IdRegistry(servers) as reg:
        found = reg.lookup(ids)
    tokens = found.tokens[found.registered & (found.tokens != 0)]
    if not len(tokens):
        return
    pairs = sorted({(int(t) >> 32, int(t) & 0xFFFFFFFF) for t in tokens})
    with autocommit(servers[MAIN], application_name="photon-final") as conn, conn.cursor() as cur:
        cur.execute(
            "SELECT o.owner_id, b.batch_seq FROM photon.owners o JOIN photon.batches b"
            " ON b.pipeline = o.pipeline AND b.owner_id = o.owner_id"
            " WHERE o.owner_id = ANY(%s) AND b.batch_seq = ANY(%s) AND b.published",
            ([o for o, _ in pairs], [b for _, b in pairs]),
        )
        published = {(int(o), int(b)) for o, b in cur.fetchall()}
        cur.execute("SELECT owner_id, pipeline FROM photon.owners WHERE owner_id = ANY(%s)", ([o for o, _ in pairs],))
        owners = {int(o): str(p) for o, p in cur.fetchall()}
    open_pairs = [pair for pair in pairs if pair not in published]
    if not open_pairs:
        return
    n = sum(1 for t in tokens if (int(t) >> 32, int(t) & 0xFFFFFFFF) in set(open_pairs))
    d.in_flight = n
    named = [f"{owners.get(o, f'owner {o}')}/{b}" for o, b in open_pairs[:SAMPLES]]
    d.reasons.append(
        f"{n:,} click(s) of the interval are registered by batches not published ({', '.join(named)}): their pipeline"
        " re-runs the batch, or the verifier recovers them"
    )


def _judge_redispatched(
    d: Finality, main: str, logs: Store, start_us: int, ids: pa.Array, pipes: Mapping[str, _Pipeline]
) -> None:
    """Clicks the verifier took out of the registry are decided again once a pipeline reads their re-dispatched
    copy: a pass under way (its intents), or a re-dispatched file no pipeline that decides it has consumed, holding
    a click of the interval, holds the interval back."""
    d.redispatched_waiting = 0
    intents = [
        e.key
        for dc in logs.folders()
        if not dc.startswith(("_", "."))
        for e in logs.files(f"{dc}/clicks")
        if e.key.rpartition("/")[2].startswith(RECOVERED_PREFIX) and e.key.endswith(".inprogress")
    ]
    if intents:
        d.reasons.append(f"a verifier pass is re-dispatching clicks ({', '.join(sorted(intents)[:SAMPLES])})")
        return
    # A re-dispatched file lands in the partition of its moment, after the interval began; a live pipeline has
    # consumed everything behind its listing mark, so only partitions from the lowest such mark on are listed.
    first = partition_of(start_us)
    found: dict[str, list[str]] = {}
    rels: set[str] = set()  # as the pipelines of those data centers record them
    for dc in sorted({p.dc for p in pipes.values() if p.live}):
        marks = [p.clicks_mark for p in pipes.values() if p.live and p.dc == dc]
        since = first if any(m is None for m in marks) else max(first, min(m for m in marks if m is not None))
        folder = f"{dc}/clicks"
        for f in list_closed(logs.child(folder), since):
            if f.name.startswith(RECOVERED_PREFIX):
                found.setdefault(f.name, []).append(f"{folder}/{f.rel}")
                rels.add(f.rel)
    if not found:
        return
    deciders = sorted(n for n, p in pipes.items() if p.live or p.leaves_nothing_waiting)
    with autocommit(main, application_name="photon-final") as conn, conn.cursor() as cur:
        # A live data center's pipeline records its own copy under the name listed here: the primary key finds it.
        cur.execute(
            "SELECT pipeline, name, batch_seq FROM photon.consumed_files WHERE pipeline = ANY(%s)"
            " AND kind = 'clicks' AND name = ANY(%s)",
            (deciders, sorted(rels)),
        )
        # By a batch whose retry set (or an older one's) was judged: see _consumed_by_name.
        taken = {_base(n) for p, n, b in cur.fetchall() if int(b) <= pipes[p].last_batch}
    waiting: set[str] = set()
    for name in sorted(set(found) - taken):
        key = found[name][0]  # the same clicks in every replica
        good = parse_file(name, logs.get(key), "clicks")[0]["click_id"]
        waiting.update(good.filter(pc.is_in(good, value_set=ids)).to_pylist())
    d.redispatched_waiting = len(waiting)
    if waiting:
        d.reasons.append(
            f"{len(waiting):,} click(s) of the interval were re-dispatched by the verifier and no pipeline has taken"
            f" them yet ({', '.join(sorted(set(found) - taken)[:SAMPLES])})"
        )


# -- a backfill's window ------------------------------------------------------------------------------------------


class EmptyWindowError(ValueError):
    """A backfill's window has no logs in its data center's replica, or ends before the registry's horizon: it would
    "succeed" joining nothing. One line (the CLI's operator errors are ValueErrors)."""


def check_backfill_window(
    servers: Mapping[str, str],
    logs: Path | Store | str,
    dc: str,
    start_us: int,
    end_us: int,
    *,
    allow_empty: bool = False,
    max_clock_skew_s: float = MAX_CLOCK_SKEW_S,
) -> str | None:
    """Before a backfill of ``[start_us, end_us)`` from ``<logs>/<dc>`` starts: the window's click files in that
    replica (as data quality reads an interval's input: the arrival partitions that start in it, and flat files by
    their first event) and the registry's horizon (``joiner.query_index.registry_horizon_us``: ids older are
    forgotten, and their queries are pruned from every EventStore, so nothing of such a window can be joined). Raises
    ``EmptyWindowError`` naming the window and the horizon when the replica holds no click file of it or the window
    ends at or before the horizon, unless ``allow_empty``; then returns the same words (the caller logs them), else
    None. Reads what the joiner's login may read."""
    from photon.joiner.query_index import registry_horizon_us

    horizon, _ = registry_horizon_us(servers, max_clock_skew_s=max_clock_skew_s)
    store = as_store(logs)
    files = interval_click_files(store, start_us, end_us, dcs=[dc])
    problems = []
    if not files:
        problems.append(f"no click file in {store.location(f'{dc}/clicks')} for the window")
    if end_us <= horizon:
        problems.append(
            "the window ends before the registry's horizon (ids older than it are forgotten: nothing of it can be"
            " joined exactly once)"
        )
    if not problems:
        return None
    what = (
        f"backfill of {dc} [{iso(start_us)}, {iso(end_us)}): {'; and '.join(problems)}; the registry's horizon is"
        f" {iso(horizon)}"
    )
    if not allow_empty:
        raise EmptyWindowError(f"{what}. --allow-empty (photon_backfill's allow_empty) runs it all the same")
    return f"{what}: run all the same (allow_empty)"


# -- the marker -----------------------------------------------------------------------------------------------------


def marker_key(start_us: int, end_us: int) -> str:
    """``_final/<YYYYmmddHH>.json`` for a UTC hour, ``_final/<YYYYmmddHHMM>-<YYYYmmddHHMM>.json`` otherwise."""
    start = datetime.fromtimestamp(start_us / US, UTC)
    if start_us % HOUR_US == 0 and end_us - start_us == HOUR_US:
        name = f"{start:%Y%m%d%H}"
    else:
        name = f"{start:%Y%m%d%H%M}-{datetime.fromtimestamp(end_us / US, UTC):%Y%m%d%H%M}"
    return f"{FINAL_DIR}/{name}.json"


def marker_path(out: Path | Store | str, start_us: int, end_us: int) -> str:
    """Where the marker of an interval is: a path under the output folder, or a URL under an ``s3://`` one."""
    key = marker_key(start_us, end_us)
    if not isinstance(out, (Path, str)):
        return out.location(key)
    text = str(out)
    return f"{text.rstrip('/')}/{key}" if text.startswith("s3://") else str(Path(text.removeprefix("file://")) / key)


def write_marker(out: Path | Store | str, decision: Finality) -> tuple[str, dict[str, Any]]:
    """Record a final decision where readers poll for it; (where it is, the marker as it stands). Written whole or
    not at all and durably, and only once (put-if-absent, on a folder as on an object store): the first declaration
    stands (a re-run of the task, or a second decision racing it, leaves it as it is and returns it)."""
    if not decision.final:
        raise ValueError(f"interval [{iso(decision.start_us)}, {iso(decision.end_us)}) is not final")
    store, key = as_store(out), marker_key(decision.start_us, decision.end_us)
    where = marker_path(out, decision.start_us, decision.end_us)
    existing = read_marker(out, decision.start_us, decision.end_us)
    if existing is not None:
        return where, existing
    marker = {"format": MARKER_FORMAT, **decision.to_dict()}
    if store.put(key, (json.dumps(marker, indent=2, sort_keys=True) + "\n").encode(), if_absent=True):
        return where, marker
    return where, json.loads(store.get(key))  # another writer's, first


def read_marker(out: Path | Store | str, start_us: int, end_us: int) -> dict[str, Any] | None:
    try:
        data = as_store(out).get(marker_key(start_us, end_us))
    except NotFoundError:
        return None
    return cast(dict[str, Any], json.loads(data))


def summary(d: Finality | Mapping[str, Any]) -> str:
    """One line: final or not, and the counts or the first reason."""
    x = d.to_dict() if isinstance(d, Finality) else dict(d)
    window = f"[{x['start']}, {x['end']})"
    if x["final"]:
        lost = f"; lost data centers {', '.join(x['lost_data_centers'])}" if x["lost_data_centers"] else ""
        empty = "; accepted without input (allow_empty)" if x.get("empty_accepted") else ""
        return (
            f"{window} is final (decided at {x['decided_at']}): {x['click_files']:,} click files,"
            f" {x['input_clicks']:,} clicks{lost}{empty}"
        )
    return f"{window} is not final: {x['reasons'][0]}" + (
        f" (and {len(x['reasons']) - 1} more)" if len(x["reasons"]) > 1 else ""
    )
