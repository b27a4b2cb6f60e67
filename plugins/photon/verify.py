"""Verification and recovery (Photon's verifier): find clicks registered in the IdRegistry whose output never
landed, give them back to their pipeline, and clear the tokens of clicks whose output is committed.

Every registry row carries the token ``owner << 32 | batch`` of the batch that registered it, and the owner names
its pipeline (Percolator's primary: the fate of a stranded row is read from its owner's record). Per row:

- batch committed and published, click in the pipeline's ``joined/``: the output is final; the token is cleared
  (only if it still matches), so the registry keeps tokens only where recovery may need them;
- batch committed and published, click not in ``joined/``: lost (a batch re-run after a crash that took other
  files, say). Nothing can write it any more under that token, so its row is deleted (only if the token still
  matches) and the click is re-dispatched;
- batch not committed yet: in flight, left alone, unless the pipeline has shown no sign of life (commit or
  heartbeat) for ``grace_s``. Then the verifier first fences the pipeline (bumps its epoch, as a new lease would:
  a zombie's commit is refused from then on) and recovers the batch's rows as lost ones.

Re-dispatch writes the clicks' original lines, found in ``<logs>/<dc>/clicks``, to a new closed log file
``recovered-<time>-<pipeline>.jsonl`` there, which the pipeline's dispatcher picks up like any other file; the
registry decides again who joins each click.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
from psycopg2 import sql

from photon.audit import data_center_of, pipelines_in
from photon.ids import EventKeys, format_id
from photon.parse import parse_file
from photon.pg import autocommit, connect
from photon.registry import MAIN, read_layout
from photon.registry_sql import shard_table
from photon.schemas import JOINED, JOINED_SCHEMA

US = 1_000_000


@dataclass
class VerifyReport:
    dry_run: bool
    checked: int = 0  # registry rows holding a token
    committed: int = 0  # of those, output committed: token cleared (or, in a dry run, would be)
    in_flight: int = 0  # batch not committed yet, pipeline alive: left alone
    lost: int = 0  # registered, batch over, not in the output
    recovered: int = 0  # lost rows deleted and their clicks re-dispatched
    not_in_logs: int = 0  # lost clicks whose line was not found in the logs (their rows are kept)
    fenced: list[str] = field(default_factory=list)  # pipelines fenced because they were gone
    redispatched_files: list[str] = field(default_factory=list)
    per_pipeline: dict[str, dict[str, int]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Pipeline:
    name: str
    epoch: int
    last_batch: int
    idle_s: float
    published: set[int]


def _pipelines(main: str) -> tuple[dict[int, str], dict[str, _Pipeline]]:
    with autocommit(main) as conn, conn.cursor() as cur:
        cur.execute("SELECT owner_id, pipeline FROM photon.owners")
        owners = {int(o): str(p) for o, p in cur.fetchall()}
        cur.execute(
            "SELECT pipeline, epoch, last_batch, extract(epoch FROM now() - coalesce(heartbeat_at, updated_at))"
            " FROM photon.pipelines"
        )
        pipes = {str(p): _Pipeline(str(p), int(e), int(b), float(i or 0), set()) for p, e, b, i in cur.fetchall()}
        cur.execute("SELECT pipeline, batch_seq FROM photon.batches WHERE published")
        for p, b in cur.fetchall():
            if p in pipes:
                pipes[p].published.add(int(b))
    return owners, pipes


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
    return pa.concat_tables(parts)


def _output_keys(out: Path, pipeline: str) -> pa.Table:
    folder = out / pipeline / JOINED
    if not folder.is_dir():
        return pa.table({"ts_us": pa.array([], pa.int64()), "src": pa.array([], pa.int64())})
    ids = ds.dataset(folder, format="parquet", schema=JOINED_SCHEMA).to_table(columns=["click_id"])["click_id"]
    keys = EventKeys.from_ids(ids)
    return pa.table({"ts_us": keys.ts_us, "src": keys.src})


def verify_and_recover(
    servers: Mapping[str, str], out: Path, logs: Path, *, grace_s: float = 600.0, dry_run: bool = False
) -> VerifyReport:
    report = VerifyReport(dry_run=dry_run)
    owners, pipes = _pipelines(servers[MAIN])
    rows = _tokened_rows(servers)
    report.checked = rows.num_rows
    if rows.num_rows == 0:
        return report
    tokens = rows["token"].to_numpy()
    owner = tokens >> 32
    batch = tokens & 0xFFFFFFFF
    names = np.array([owners.get(int(o), "") for o in owner], dtype=object)
    rows = rows.append_column("pipeline", pa.array(names.tolist(), pa.string())).append_column("batch", pa.array(batch))
    known = set(pipelines_in(out)) if out.is_dir() else set()
    for name in sorted(set(names.tolist())):
        pipe = pipes.get(name)
        mine = rows.filter(pc.equal(rows["pipeline"], name))
        stats = report.per_pipeline.setdefault(name, {"checked": mine.num_rows, "committed": 0, "lost": 0})
        if pipe is None or (name not in known and not pipe.published):
            report.in_flight += mine.num_rows  # an owner without a pipeline (a test's, a tool's): not ours to judge
            continue
        b = mine["batch"].to_numpy()
        done = np.isin(b, np.fromiter(pipe.published, np.int64, len(pipe.published)))
        gone = pipe.idle_s > grace_s
        over = done | ((b > pipe.last_batch) & gone)
        report.in_flight += int(np.count_nonzero(~over))
        judged = mine.filter(pa.array(over))
        output = _output_keys(out, name)
        present = judged.join(output, ["ts_us", "src"], join_type="left semi")
        missing = judged.join(output, ["ts_us", "src"], join_type="left anti")
        committed_rows = present.filter(pc.is_in(present["batch"], pa.array(sorted(pipe.published), pa.int64())))
        report.committed += committed_rows.num_rows
        report.lost += missing.num_rows
        stats["committed"], stats["lost"] = committed_rows.num_rows, missing.num_rows
        if dry_run:
            continue
        if missing.num_rows and bool((missing["batch"].to_numpy() > pipe.last_batch).any()):
            _fence(servers[MAIN], pipe)
            report.fenced.append(name)
        _clear_tokens(servers, committed_rows)
        if missing.num_rows:
            found = _redispatch(missing, logs, data_center_of(out, name), name)
            if found is not None:
                path, recovered = found
                report.redispatched_files.append(str(path))
                _delete(servers, missing.filter(pa.array(recovered)))
                report.recovered += int(np.count_nonzero(recovered))
                report.not_in_logs += int(np.count_nonzero(~recovered))
            else:
                report.not_in_logs += missing.num_rows
    return report


def _fence(main: str, pipe: _Pipeline) -> None:
    """Bump the pipeline's epoch (if nobody else did): a zombie lease can no longer commit."""
    with autocommit(main) as conn, conn.cursor() as cur:
        cur.execute(
            "UPDATE photon.pipelines SET epoch = epoch + 1, lease_owner = 'verifier', updated_at = now()"
            " WHERE pipeline = %s AND epoch = %s",
            (pipe.name, pipe.epoch),
        )


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
    from psycopg2.extras import execute_values

    from photon.sharding import ShardRef

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


def _redispatch(missing: pa.Table, logs: Path, dc: str, pipeline: str) -> tuple[Path, np.ndarray] | None:
    """Find the lost clicks' lines in the data center's click logs and write them to a new closed log file.
    Returns the file and, per missing row, whether its line was found; None if none was."""
    wanted = {format_id(t, s) for t, s in zip(missing["ts_us"].to_pylist(), missing["src"].to_pylist(), strict=True)}
    folder = logs / dc / "clicks"
    lines: dict[str, bytes] = {}
    for name in sorted(os.listdir(folder)) if folder.is_dir() else []:
        if not name.endswith(".jsonl"):
            continue
        good, _ = parse_file(name, (folder / name).read_bytes(), "clicks")
        hit = good.filter(pc.is_in(good["click_id"], pa.array(sorted(wanted), pa.string())))
        for row in hit.to_pylist():
            lines.setdefault(row["click_id"], json.dumps(row, separators=(",", ":")).encode() + b"\n")
        if len(lines) == len(wanted):
            break
    if not lines:
        return None
    path = folder / f"recovered-{int(time.time() * US)}-{pipeline}.jsonl"
    tmp = path.with_name(path.name + ".inprogress")
    tmp.write_bytes(b"".join(lines[k] for k in sorted(lines)))
    os.replace(tmp, path)
    found = np.array(
        [
            format_id(t, s) in lines
            for t, s in zip(missing["ts_us"].to_pylist(), missing["src"].to_pylist(), strict=True)
        ]
    )
    return path, found
