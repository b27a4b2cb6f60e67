"""Verification and recovery (Photon's verifier): find clicks registered in the IdRegistry whose output never
landed and hand them to whichever pipeline is alive, roll forward batches that committed but never published, and
clear the tokens of clicks whose output is committed.

Every registry row carries the token ``owner << 32 | batch`` of the batch that registered it; the owner record names
its pipeline (Percolator's primary: the fate of a stranded row is read from its owner's record). A pipeline has one
current owner. The verifier fences a pipeline that has shown no sign of life for the grace period: in one
transaction it bumps the epoch (a zombie's commit is refused from then on), gives the pipeline a new owner (a later
lease registers under new tokens) and retires the old owner at its last committed batch.

The invariant that makes every delete safe: a row is deleted only if its token can never be published, because
either (a) its batch is published and the click is not among the rows of that batch's own output files, whose
count matches the count the batch committed; or (b) its owner is retired and never committed that batch. Both facts
are final once true (a published batch's files never change; a retired owner never commits), and the verifier
establishes them before it reads the evidence they rest on. A delete names the token it judged, so a row that
changed in between is left alone. Missing evidence stops the verifier; it never deletes on a guess.

A pass (:func:`verify_and_recover`), in order:

1. Take the verifier lock: one verifier at a time.
2. Read pipelines and owners, idle times by the registry server's clock, and every registry row holding a token.
3. Check the evidence: the output folder of every pipeline whose rows are judged must be there.
4. Fence each pipeline idle past the grace period whose current owner holds rows beyond its last committed batch,
   conditionally on the epoch and last batch read in 2. A pipeline that moved in between is not fenced and its rows
   stay in flight.
5. Roll forward: publish batches committed more than the grace period ago and never published (a joiner that died
   between commit and publish), exactly as the joiner would; checked against the batch's committed row count.
6. Read the committed batches again (which owner committed each, whether published): after 4 and 5.
7. Judge every row: committed and published, click in the batch's files -> committed; not in them -> lost;
   owner retired and batch not committed by it -> lost; otherwise in flight.
8. Recover the lost rows: their clicks' original lines (found in any data center's click logs, in the files named
   after the process that logged them; a click found nowhere keeps its row and is reported) are written as an
   intent, ``recovered-<time>-<pipeline>.jsonl.inprogress``, into every data center's click folder and synced;
   then the rows are deleted where their token still matches; then the intents are renamed to closed log files,
   which every pipeline's dispatcher takes first. Intents a crashed pass left behind are published too. (A click
   made readable before its row is gone would be dropped by the pre-filter: hence the order.)
9. Clear the tokens of committed output (where the token still matches).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psycopg2
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
from psycopg2 import sql

from photon.joiner.common import RECOVERED_PREFIX
from photon.joiner.publish import publish_files, stage_key
from photon.logs import tables
from photon.logs.ids import EventKeys, format_id
from photon.logs.layout import INPROGRESS, data_center_of, list_closed, partition_of
from photon.logs.parse import parse_file
from photon.logs.schemas import JOINED, OUTPUT_KINDS
from photon.pg import across_failover, autocommit, connect, is_server_lost, sync_barrier
from photon.registry.admin import server_clock_us
from photon.registry.client import MAIN, read_layout
from photon.registry.sql import shard_table
from photon.settings import load_settings
from photon.storage import Store, as_store

log = logging.getLogger(__name__)
US = 1_000_000
# One advisory lock id for "a verifier pass is running" on the main server.
_LOCK_ID = 0x50484F544F56  # "PHOTOV"


class VerifyError(RuntimeError):
    """The verifier stopped before changing anything it could not justify."""


class VerifierBusyError(VerifyError):
    """Another verifier pass holds the lock."""


class EvidenceMissingError(VerifyError):
    """Output the registry says exists is not where the verifier looks (a wrong ``--out``, an unmounted volume, a
    deleted file). Deleting on such a view would duplicate clicks, so the verifier stops instead."""


@dataclass
class VerifyReport:
    dry_run: bool
    checked: int = 0  # registry rows holding a token
    committed: int = 0  # of those, output committed: token cleared (or, in a dry run, would be)
    in_flight: int = 0  # batch not decided yet (pipeline alive, or not a pipeline's owner): left alone
    lost: int = 0  # registered, batch published without them or owner retired without committing them
    recovered: int = 0  # lost rows deleted and their clicks re-dispatched
    not_in_logs: int = 0  # lost clicks whose line was not found in the logs (their rows are kept)
    fenced: list[str] = field(default_factory=list)  # pipelines fenced because they were gone
    not_fenced: list[str] = field(default_factory=list)  # looked gone but moved before the fence: left alone
    rolled_forward: list[str] = field(default_factory=list)  # "<pipeline>/<batch>" published by the verifier
    redispatched_files: list[str] = field(default_factory=list)
    per_pipeline: dict[str, dict[str, int]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Pipeline:
    name: str
    epoch: int
    last_batch: int
    owner_id: int
    idle_s: float


@dataclass(frozen=True)
class _Batch:
    owner_id: int
    epoch: int
    published: bool
    joined: int | None  # rows the batch wrote to joined/, from its committed metrics
    rows: dict[str, int] = field(default_factory=dict)  # rows per output kind, from its committed metrics
    queries: int | None = None  # queries it indexed, from its committed metrics


@dataclass
class _State:
    owners: dict[int, str]  # owner -> pipeline
    retired: set[int]
    pipes: dict[str, _Pipeline]
    batches: dict[tuple[str, int], _Batch]


def _read_state(cur: Any) -> _State:
    cur.execute("SELECT owner_id, pipeline, retired_at IS NOT NULL FROM photon.owners")
    owners, retired = {}, set()
    for o, p, r in cur.fetchall():
        owners[int(o)] = str(p)
        if r:
            retired.add(int(o))
    cur.execute(
        "SELECT pipeline, epoch, last_batch, owner_id,"
        " extract(epoch FROM now() - coalesce(heartbeat_at, updated_at)) FROM photon.pipelines"
    )
    pipes = {str(p): _Pipeline(str(p), int(e), int(b), int(o), float(i or 0)) for p, e, b, o, i in cur.fetchall()}
    cur.execute(
        "SELECT b.pipeline, b.batch_seq, b.owner_id, b.epoch, b.published, m.queries, m.joined, m.unjoinable,"
        " m.quarantined"
        " FROM photon.batches b"
        " LEFT JOIN photon.batch_metrics m ON m.pipeline = b.pipeline AND m.batch_seq = b.batch_seq"
    )
    batches = {
        (str(p), int(s)): _Batch(
            int(o), int(e), bool(pub), None if rows[0] is None else int(rows[0]),
            {k: int(n) for k, n in zip(OUTPUT_KINDS, rows, strict=True) if n is not None},  # zeros too
            None if q is None else int(q),
        )
        for p, s, o, e, pub, q, *rows in cur.fetchall()
    }  # fmt: skip
    return _State(owners, retired, pipes, batches)


def _tokened_rows(servers: Mapping[str, str]) -> pa.Table:
    """(shard server, version, shard, ts_us, src, token) of every registry row that still holds a token."""
    layout, _ = read_layout(servers[MAIN])
    parts = []
    for ref in layout.shards():
        server = layout.server_of(ref)
        with autocommit(servers[server]) as conn, conn.cursor() as cur:
            cur.execute(sql.SQL("SELECT ts_us, src, token FROM {} WHERE token IS NOT NULL").format(shard_table(ref)))
            rows = np.array(cur.fetchall(), dtype=np.int64).reshape(-1, 3)
        n = len(rows)
        parts.append(
            pa.table(
                {
                    "server": pa.array([server] * n, pa.string()),
                    "version": pa.array(np.full(n, ref.version, np.int64)),
                    "shard": pa.array(np.full(n, ref.shard_no, np.int64)),
                    "ts_us": rows[:, 0],
                    "src": rows[:, 1],
                    "token": rows[:, 2],
                }
            )
        )
    rows = pa.concat_tables(parts)
    tokens = rows["token"].to_numpy()
    return rows.append_column("owner", pa.array(tokens >> 32)).append_column("batch", pa.array(tokens & 0xFFFFFFFF))


def _pipeline_folder(out: Store, pipeline: str) -> Store:
    folder = out.child(pipeline)
    if folder.head("_pipeline.json") is None:
        raise EvidenceMissingError(
            f"pipeline {pipeline!r} has registry rows or a batch to judge, but {folder.url} is not its output folder "
            "(no _pipeline.json there): check --out (every pipeline's folder must be under it, mounted); nothing was "
            "changed"
        )
    return folder


def _batch_files(folder: Store, pipeline: str, batch: int, b: _Batch, *, changed: bool = False) -> pa.Array:
    """The click ids batch ``batch`` published to the pipeline's joined table (its rows carry the batch's number,
    through any compaction), checked to be the rows the batch committed. ``changed``: the pass already fenced or
    rolled forward, so the error says what it did not do rather than "nothing"."""
    table = folder.location(JOINED)
    ids = pa.array([], pa.string())
    if tables.published_batch(folder, JOINED) is not None:
        where = ds.field(tables.BATCH) == batch
        try:
            rows = tables.OutputTable.at(folder, JOINED).dataset().to_table(columns=["click_id"], filter=where)
        except (OSError, pa.ArrowException) as exc:  # a committed data file gone or damaged
            raise EvidenceMissingError(
                f"batch {batch} of pipeline {pipeline!r}: the table {table} cannot be read ({exc}); "
                + ("no registry row was deleted or cleared" if changed else "nothing was changed")
            ) from exc
        ids = rows.column("click_id").combine_chunks()
    if b.joined is None or len(ids) != b.joined:
        raise EvidenceMissingError(
            f"batch {batch} of pipeline {pipeline!r} committed {b.joined} joined rows, but the table {table} holds "
            f"{len(ids)} rows of batch {batch}: its output is missing or altered; "
            + ("no registry row was deleted or cleared" if changed else "nothing was changed")
        )
    return ids


def _keys(ids: pa.Array) -> pa.Table:
    """(ts_us, src) of the clicks ``ids``."""
    if not len(ids):
        return pa.table({"ts_us": pa.array([], pa.int64()), "src": pa.array([], pa.int64())})
    keys = EventKeys.from_ids(ids)
    return pa.table({"ts_us": keys.ts_us, "src": keys.src})


def verify_and_recover(
    servers: Mapping[str, str],
    out: Path | Store,
    logs: Path | Store,
    *,
    grace_s: float = 600.0,
    dry_run: bool = False,
) -> VerifyReport:
    """One verification pass (the numbered steps of the module's doc), run again from step 1 if a registry server
    is lost on the way (a failover): the lock is the old primary's session's and goes with it, so no step may go on
    without it; a pass cut short anywhere is what a crashed pass leaves, which the next pass completes."""
    return across_failover(lambda: _verify_pass(servers, as_store(out), as_store(logs), grace_s, dry_run))


def _verify_pass(servers: Mapping[str, str], out: Store, logs: Store, grace_s: float, dry_run: bool) -> VerifyReport:
    report = VerifyReport(dry_run=dry_run)
    dcs = _data_centers(logs)
    # 1. The lock, held by this connection's session for the whole pass; intents earlier passes left.
    with _pass_lock(servers[MAIN]) as lcur:
        if not dry_run:
            _publish_leftover_intents(servers, logs, dcs)
        # 2. State and registry rows.
        state = _read_state(lcur)
        rows = _tokened_rows(servers)
        report.checked = rows.num_rows
        names = [state.owners.get(o, "") for o in rows["owner"].to_pylist()]
        rows = rows.append_column("pipeline", pa.array(names, pa.string()))
        judged_names = sorted({n for n in names if n in state.pipes})
        # 3. Evidence, before anything changes: every judged pipeline's folder, the files of every published batch
        # with rows to judge, the staged files of every batch to roll forward.
        folders = {name: _pipeline_folder(out, name) for name in judged_names}
        for name, batch in sorted(set(zip(names, rows["batch"].to_pylist(), strict=True))):
            b = state.batches.get((name, batch))
            if name in folders and b is not None and b.published:
                _batch_files(folders[name], name, batch, b)
        lcur.execute(
            "SELECT pipeline, batch_seq FROM photon.batches WHERE NOT published"
            " AND committed_at < now() - make_interval(secs => %s) ORDER BY 1, 2",
            (grace_s,),
        )
        to_roll = [(str(n), int(b)) for n, b in lcur.fetchall()]
        # The state read here (a fence, a batch commit to roll forward) is acted on only once a standby holds it: a
        # commit whose wait was cancelled is visible on the primary and forgotten by a failover.
        sync_barrier(lcur)
        for name, batch in to_roll:
            folders.setdefault(name, _pipeline_folder(out, name))
            _check_staged(folders[name], name, batch, state.batches[(name, batch)])
        # 4. Fence the gone pipelines that hold rows in flight.
        for name in judged_names:
            pipe = state.pipes[name]
            mine = rows.filter(pc.equal(rows["owner"], pipe.owner_id))
            batches = set(mine["batch"].to_pylist())
            if pipe.idle_s <= grace_s or all(
                state.batches.get((name, b), _NONE).owner_id == pipe.owner_id for b in batches
            ):
                continue
            if dry_run:
                report.fenced.append(name)
                continue
            (report.fenced if _fence(lcur, pipe, grace_s) else report.not_fenced).append(name)
        # 5. Roll forward committed, unpublished batches older than the grace period.
        for name, batch in to_roll:
            rolled = state.batches[(name, batch)]
            if not dry_run:
                # Never fewer rows than its tasks staged, nor fewer index files than they named
                publish_files(folders[name], name, batch, rolled.epoch, expect=rolled.rows, indexed=rolled.queries)
                _batch_files(folders[name], name, batch, rolled, changed=True)  # all of it is in place now
                lcur.execute(
                    "UPDATE photon.batches SET published = true WHERE pipeline = %s AND batch_seq = %s", (name, batch)
                )
            report.rolled_forward.append(f"{name}/{batch}")
        # 6. Committed batches again, after the fences and the roll-forward (and, as above, replicated).
        state = _read_state(lcur)
        sync_barrier(lcur)
        # 7. Judge.
        committed_parts, lost_parts = [], []
        for name in judged_names:
            mine = rows.filter(pc.equal(rows["pipeline"], name))
            done, gone = [], []
            for (owner, batch), group in _groups(mine):
                b = state.batches.get((name, batch))
                if b is not None and b.owner_id == owner:
                    if not b.published:
                        continue  # committed, being published by its lease (or rolled forward after the grace)
                    keys = _keys(_batch_files(folders[name], name, batch, b, changed=True))
                    done.append(group.join(keys, ["ts_us", "src"], join_type="left semi"))
                    gone.append(group.join(keys, ["ts_us", "src"], join_type="left anti"))
                elif owner in state.retired:
                    gone.append(group)  # a retired owner never committed this batch: it never will
            n_done, n_gone = sum(t.num_rows for t in done), sum(t.num_rows for t in gone)
            report.per_pipeline[name] = {"checked": mine.num_rows, "committed": n_done, "lost": n_gone}
            committed_parts += done
            lost_parts += gone
        committed = _concat(committed_parts, rows.schema)
        lost = _concat(lost_parts, rows.schema)
        report.committed, report.lost = committed.num_rows, lost.num_rows
        report.in_flight = report.checked - report.committed - report.lost
        if dry_run:
            return report
        # 8. Recover: intents (the clicks, and their queries) in every data center; the deletes; then this pass's
        # intents published, queries first.
        if lost.num_rows:
            order = [data_center_of(out, n) for n in judged_names] + dcs
            lines = _find_lines(lost, logs, order)
            found = np.array([format_id(t, s) in lines for t, s in zip(*_ts_src(lost), strict=True)], dtype=bool)
            report.not_in_logs = int(np.count_nonzero(~found))
            if report.not_in_logs:
                missing = [format_id(t, s) for t, s, f in zip(*_ts_src(lost), found, strict=True) if not f]
                log.warning(
                    "%d lost click(s) not found in the logs, their registry rows kept (e.g. %s): a click's line is "
                    "looked for only in the click files named after the process that logged it (EVENTS.md, File "
                    "names); put the file holding it back under that name and run the verifier again",
                    report.not_in_logs,
                    ", ".join(missing[:5]),
                )
            if found.any():
                queries = _find_query_lines(lines.values(), logs, order)
                stamp = f"{RECOVERED_PREFIX}{server_clock_us(servers[MAIN])}.jsonl"
                intents = _write_intents(logs, dcs, "queries", stamp, b"".join(queries[k] for k in sorted(queries)))
                intents += _write_intents(logs, dcs, "clicks", stamp, b"".join(lines[k] for k in sorted(lines)))
                lcur.execute("SELECT 1")  # the session, and so the lock, is still ours
                _delete(servers, lost.filter(pa.array(found)))
                report.recovered = int(np.count_nonzero(found))
                for key in intents:  # queries' intents come first: a recovered click finds its query
                    published = _publish_intent(logs, key, servers[MAIN])
                    if published is not None and key.split("/")[1] == "clicks":
                        report.redispatched_files.append(logs.location(published))
        # 9. Clear tokens of committed output.
        _clear_tokens(servers, committed)
    return report


@contextlib.contextmanager
def _pass_lock(dsn: str) -> Iterator[Any]:
    """A cursor on the session holding the verifier's lock, refused with VerifierBusyError if another pass holds it.

    The lock is let go on this session, not by closing it: the server frees a closed session's locks only once its
    backend notices the close, and a pass started at once after (a retry) was refused as busy. A pass that ends well
    must still hold its session to let go: if it was lost, the pass ran partly without the lock, and the connection
    error makes across_failover run it again. A pass leaving on an error lets go only if the registry did not fail:
    a round trip to a server that has stopped answering would block with no timeout, and its lock goes with it."""
    with autocommit(dsn, application_name="photon-verify") as lock, lock.cursor() as lcur:
        lcur.execute("SELECT pg_try_advisory_lock(%s)", (_LOCK_ID,))
        if not lcur.fetchone()[0]:
            raise VerifierBusyError("another verifier pass is running (advisory lock held); nothing was changed")
        try:
            yield lcur
        except Exception as exc:
            if not is_server_lost(exc):
                with contextlib.suppress(psycopg2.Error):  # never in place of the pass's own error
                    lcur.execute("SELECT pg_advisory_unlock(%s)", (_LOCK_ID,))
            raise
        lcur.execute("SELECT pg_advisory_unlock(%s)", (_LOCK_ID,))


def _check_staged(folder: Store, name: str, batch: int, b: _Batch) -> None:
    """A committed, unpublished batch about to be rolled forward: its joined rows, staged or already in the table
    (a joiner that died while publishing), must be the rows it committed."""

    def in_table() -> int | None:
        have = tables.published_batch(folder, JOINED)
        if have is None or have < batch:
            return None
        where = ds.field(tables.BATCH) == batch
        return int(tables.OutputTable.at(folder, JOINED).dataset().count_rows(filter=where))

    found = in_table()
    if found is None:
        found = tables.staged_rows(folder, stage_key(batch, b.epoch), JOINED, at_least=b.joined or 0)
        if found != b.joined:  # a lease start may have published it meanwhile, and removed its stage
            found = in_table() or found
    if b.joined is None or found != b.joined:
        why = (
            f"stages {found}, more (a task's try other than the one Spark accepted left its records): not rolled "
            "forward"
            if b.joined is not None and found > b.joined
            else f"holds {found} of them (staged or published): its output is missing"
        )
        raise EvidenceMissingError(
            f"batch {batch} of pipeline {name!r} committed {b.joined} joined rows but never published them, and "
            f"{folder.url} {why}; nothing was changed"
        )


_NONE = _Batch(0, 0, False, None)


def _fence(cur: Any, pipe: _Pipeline, grace_s: float) -> bool:
    """Fence the pipeline if it still holds the epoch and last batch seen and is still idle past the grace period
    (by the server's clock); True if it was fenced. A pipeline that moved is alive: not fenced, nothing judged gone."""
    cur.execute(
        "SELECT new_epoch FROM photon.fence_pipeline(%s, %s, %s, %s)", (pipe.name, pipe.epoch, pipe.last_batch, grace_s)
    )
    return cur.fetchone() is not None


def _groups(t: pa.Table) -> list[tuple[tuple[int, int], pa.Table]]:
    pairs = sorted(set(zip(t["owner"].to_pylist(), t["batch"].to_pylist(), strict=True)))
    return [((o, b), t.filter(pc.and_(pc.equal(t["owner"], o), pc.equal(t["batch"], b)))) for o, b in pairs]


def _concat(parts: list[pa.Table], schema: pa.Schema) -> pa.Table:
    parts = [p.select(schema.names) for p in parts if p.num_rows]
    return pa.concat_tables(parts) if parts else schema.empty_table()


def _ts_src(t: pa.Table) -> tuple[list[int], list[int]]:
    return t["ts_us"].to_pylist(), t["src"].to_pylist()


def _data_centers(logs: Store) -> list[str]:
    return [d for d in logs.folders() if not d.startswith(("_", ".")) and "clicks" in logs.folders(d)]


def _find_lines(lost: pa.Table, logs: Store, dcs: list[str]) -> dict[str, bytes]:
    """The lost clicks' lines, searched in the given data centers' click logs in order."""
    return _scan(logs, dcs, "clicks", "click_id", {format_id(t, s) for t, s in zip(*_ts_src(lost), strict=True)})


def _scan(logs: Store, dcs: list[str], kind: str, key: str, wanted: set[str]) -> dict[str, bytes]:
    """Lines of ``kind`` whose ``key`` is wanted, from the data centers' logs in order. An id names the server
    process that logged it, and so does a log file's name (``<ipv4>-<pid>-<seq>.jsonl``, ``EVENTS.md``): only that
    process's files, and earlier recoveries, are read."""
    prefixes = (*{w.rsplit("-", 1)[0] + "-" for w in wanted}, RECOVERED_PREFIX)
    # An event's file arrived after the event (give or take the clock skew): older partitions are not read.
    seal = int(load_settings().seal_s * US)
    since = partition_of(min((int(w.rsplit("-", 1)[1]) for w in wanted), default=0) - seal)
    lines: dict[str, bytes] = {}
    for dc in dict.fromkeys(dcs):
        folder = logs.child(f"{dc}/{kind}")
        if not wanted:
            continue
        for f in sorted(list_closed(folder, since), key=lambda f: f.rel):
            name = f.rel
            if not f.name.startswith(prefixes):
                continue
            try:
                content = folder.get(name)
            except FileNotFoundError:
                continue
            good, _ = parse_file(name, content, kind)
            hit = good.filter(pc.is_in(good[key], pa.array(sorted(wanted - lines.keys()), pa.string())))
            for row in hit.to_pylist():
                lines.setdefault(row[key], json.dumps(row, separators=(",", ":")).encode() + b"\n")
            if len(lines) == len(wanted):
                return lines
    return lines


def _write_intents(logs: Store, dcs: list[str], kind: str, name: str, content: bytes) -> list[str]:
    """Write ``<dc>/<kind>/<name>.inprogress`` for each data center, durably (a folder's synced with it, an object
    store's acknowledged); readers skip it until it is published. Every data center's logs must take it, or the pass
    stops before deleting anything. Returns the keys written."""
    if not content:
        return []
    written = []
    for dc in dcs:
        key = f"{dc}/{kind}/{name}{INPROGRESS}"
        try:
            logs.put(key, content)
        except OSError as exc:
            raise VerifyError(
                f"cannot write recovered {kind} into {logs.location(f'{dc}/{kind}')} ({exc}); no registry row was "
                "deleted"
            ) from exc
        written.append(key)
    return written


def _publish_leftover_intents(servers: Mapping[str, str], logs: Store, dcs: list[str]) -> None:
    """Rename the intents a pass that died (or lost its lock) left behind, where that is safe: a query intent
    always; a click intent once none of its clicks is held by a token (a click made readable while a row that may
    still be deleted holds it would be dropped by the pre-filter and then lost). The rest wait for a later pass."""
    from photon.registry.client import IdRegistry

    for kind in ("queries", "clicks"):
        for dc in dcs:
            for e in logs.files(f"{dc}/{kind}"):
                n = e.key.rpartition("/")[2]
                if not (n.startswith(RECOVERED_PREFIX) and n.endswith(f".jsonl{INPROGRESS}")):
                    continue
                if kind == "clicks":
                    try:
                        good, _ = parse_file(n, logs.get(e.key), "clicks")
                    except FileNotFoundError:
                        continue  # published by another pass meanwhile
                    with IdRegistry(servers) as reg:
                        if good.num_rows and bool((reg.lookup(good["click_id"]).tokens != 0).any()):
                            continue
                _publish_intent(logs, e.key, servers[MAIN], leftover_since_us=e.modified_us)


def _publish_intent(logs: Store, key: str, main_dsn: str, leftover_since_us: int | None = None) -> str | None:
    """Move an intent (``<dc>/<kind>/<name>.inprogress``) to a closed log file in the partition of this moment by
    the registry main server's clock, as any log file arriving now (EVENTS.md), durably; returns its key, or None if
    the intent is gone (published by another pass). Not this host's clock: the joiners seal partitions by the
    server's, and a verifier host behind it would put the file in a partition they may have moved past for good.

    An object store moves by copying, then deleting: a pass that died between the two leaves an intent whose file
    is published already. A leftover intent (``leftover_since_us``: when it was written) is first looked for among
    the closed files since then, and only deleted if it is there, never published twice."""
    folder, _, name = key.rpartition("/")
    closed = name.removesuffix(INPROGRESS)
    if leftover_since_us is not None and logs.atomic:
        since = partition_of(leftover_since_us - int((load_settings().seal_s + load_settings().max_clock_skew_s) * US))
        for f in list_closed(logs.child(folder), since):
            if f.name == closed:
                logs.delete(key)
                return None
    target = f"{folder}/{partition_of(server_clock_us(main_dsn))}/{closed}"
    return target if logs.move(key, target) else None


def _find_query_lines(click_lines: Any, logs: Store, dcs: list[str]) -> dict[str, bytes]:
    """The query lines of the recovered clicks, from any data center's query logs (the process that logged a query
    names its files, as for clicks): re-dispatched with them, so a surviving replica that lags behind the lost one
    still joins them."""
    wanted: set[str] = set()
    for line in click_lines:
        qid = json.loads(line).get("query_id")
        if isinstance(qid, str):
            wanted.add(qid)
    return _scan(logs, dcs, "queries", "query_id", wanted)


def _by_shard(t: pa.Table) -> dict[tuple[str, int, int], pa.Table]:
    groups: dict[tuple[str, int, int], pa.Table] = {}
    for key in {
        (s, int(v), int(n))
        for s, v, n in zip(*(t[c].to_pylist() for c in ("server", "version", "shard")), strict=False)
    }:
        mask = pc.and_(
            pc.and_(pc.equal(t["server"], key[0]), pc.equal(t["version"], key[1])), pc.equal(t["shard"], key[2])
        )
        groups[key] = t.filter(mask)
    return groups


def _apply(servers: Mapping[str, str], t: pa.Table, statement: str) -> None:
    """Run ``statement`` (with {t} for the shard table) for every (ts_us, src, token) row, one transaction per
    shard; the statement only touches a row whose token still matches."""
    # Not retried here: a server lost on the way ends the pass, which runs again from step 1 (verify_and_recover).
    # Retried alone, a step could go on after the lock went with the old primary's session.
    from psycopg2.extras import execute_values

    from photon.registry.sharding import ShardRef

    for (server, version, shard), part in _by_shard(t).items():
        conn = connect(servers[server])
        try:
            with conn.cursor() as cur:
                values = list(zip(*(part[c].to_pylist() for c in ("ts_us", "src", "token")), strict=True))
                query = sql.SQL(statement).format(t=shard_table(ShardRef(version, shard))).as_string(conn)
                execute_values(cur, query, values, page_size=5_000)
            conn.commit()
        finally:
            conn.close()


def _clear_tokens(servers: Mapping[str, str], t: pa.Table) -> None:
    _apply(
        servers,
        t,
        "UPDATE {t} AS x SET token = NULL FROM (VALUES %s) AS v(ts_us, src, token)"
        " WHERE x.ts_us = v.ts_us AND x.src = v.src AND x.token = v.token",
    )


def _delete(servers: Mapping[str, str], t: pa.Table) -> None:
    _apply(
        servers,
        t,
        "DELETE FROM {t} AS x USING (VALUES %s) AS v(ts_us, src, token)"
        " WHERE x.ts_us = v.ts_us AND x.src = v.src AND x.token = v.token",
    )
