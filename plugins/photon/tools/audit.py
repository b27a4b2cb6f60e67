"""`photon audit`: an independent check of every pipeline's output against the input.

It trusts nothing the joiner decided and shares none of its code: it reads files and counts. It reads the output
through each table's Delta log (``photon.logs.tables``): the rows of committed batches, never a data file no commit
names (a crashed batch's). The ground truth is the generator's manifest (what every click must become) or, without
one, the input logs themselves (read with Spark, with the auditor's own reading of the EVENTS.md rules). Everything
runs column-wise in Arrow (hash joins, group-bys, set membership), so tens of millions of clicks never become Python
objects.

Failures (exit status 1): a click id in the ``joined`` tables more than once across all pipelines; a lost click (one
that must join and did not, or any click with no outcome at all); an unexpected row (output for a click that was
never input); a click joined to a query other than its own; a malformed line missing from (or a valid line found in)
quarantine. Reported but not failures: clicks joined although the manifest said the query came too late, clicks
joined by one pipeline and given up by another (their ``unjoinable/`` records are counted apart: a click's outcome
is joined if any pipeline joined it).

A data center of the input with no pipeline output (its pipeline not run yet) may still join clicks the others
could not: a click whose query reached its replica in time and the others' late. Among the lost clicks the audit
names those (from the manifest's arrival times and the query files themselves). They stay lost, and the audit fails,
unless the caller says which data centers ran (``ran``, ``photon audit --dcs``): then they are pending in the data
centers that did not, not lost. Billing cannot bill a click that is in no output, so without that word the audit
cannot call the output whole.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from photon.logs import tables
from photon.logs.layout import data_center_of
from photon.logs.schemas import JOINED, QUARANTINE, UNJOINABLE
from photon.storage import LocalStore, Store, as_store

if TYPE_CHECKING:
    from rich.console import Console  # print_audit's caller brings its console

SAMPLE = 10


@dataclass
class AuditReport:
    source: str  # "manifest" or "logs"
    pipelines: list[str]
    input_clicks: int = 0
    joined_rows: int = 0
    duplicate_clicks: int = 0  # click ids in the joined tables more than once
    duplicate_extra_rows: int = 0  # rows beyond the first for those ids
    lost: int = 0
    lost_by_expectation: dict[str, int] = field(default_factory=dict)
    unexpected: int = 0
    wrong_query: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    # The clicks whose outcome is unjoinable, by reason, each once: they add up to outcomes["unjoinable"].
    unjoinable_by_reason: dict[str, int] = field(default_factory=dict)
    unjoinable_records: int = 0  # rows in every unjoinable/ folder: a click given up by two pipelines has two
    joined_although_unjoinable: int = 0
    joined_and_unjoinable: int = 0
    # unjoinable/ records of clicks some pipeline joined (dc-a gave up, dc-b's replica had the query in time): the
    # click's outcome is joined; the record only says that pipeline could not join it.
    unjoinable_records_joined_elsewhere: int = 0
    # The input's data centers, those with pipeline output (or named as run), and whether the caller named them.
    data_centers: list[str] = field(default_factory=list)
    data_centers_run: list[str] = field(default_factory=list)
    run_declared: bool = False
    # Lost clicks (must join) that a data center without output could still join, per such data center (a click
    # may count under several), and each once. With ``run_declared`` they are not in ``lost``: they are pending.
    joinable_by: dict[str, int] = field(default_factory=dict)
    still_joinable: int = 0
    quarantine: dict[str, Any] = field(default_factory=dict)
    shares: dict[str, dict[str, float]] = field(default_factory=dict)
    latency_s: dict[str, float] = field(default_factory=dict)
    samples: dict[str, list[str]] = field(default_factory=dict)

    def failures(self) -> list[str]:
        out = []
        if self.duplicate_clicks:
            out.append(f"{self.duplicate_clicks} click id(s) joined more than once")
        if self.lost:
            out.append(f"{self.lost} lost click(s)" + ("" if self.run_declared else self.joinable_text()))
        if self.unexpected:
            out.append(f"{self.unexpected} unexpected click id(s) in the output")
        if self.wrong_query:
            out.append(f"{self.wrong_query} click(s) joined to another query")
        if self.quarantine.get("missing"):
            out.append(f"{self.quarantine['missing']} malformed line(s) missing from quarantine")
        if self.quarantine.get("extra"):
            out.append(f"{self.quarantine['extra']} quarantine record(s) more than malformed lines")
        return out

    def joinable_text(self) -> str:
        """': 430 could still be joined by dc-b (its replica had the query in time; no dc-b pipeline output yet)'."""
        if not self.still_joinable:
            return ""
        dcs = sorted(self.joinable_by)
        names = " or ".join(dcs)
        return (
            f": {self.still_joinable} could still be joined by {names} (its replica had the query in time; no "
            f"{names} pipeline output yet)"
        )

    @property
    def ok(self) -> bool:
        return not self.failures()

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "ok": self.ok, "failures": self.failures()}, indent=2, sort_keys=True)


def pipelines_in(out: Path | Store) -> list[str]:
    """The pipeline folders of the output ``out`` (a folder or a store)."""
    store = as_store(out)
    if isinstance(store, LocalStore) and not store.root.is_dir():
        raise FileNotFoundError(f"output folder {out} does not exist")
    return [name for name in store.folders() if not name.startswith(("_", "."))]


def read_output(out: Path | Store, kind: str, columns: list[str], where: ds.Expression | None = None) -> pa.Table:
    """One output kind of every pipeline (rows matching ``where``), with a ``folder`` column naming the pipeline
    folder it came from: the rows of each table's current snapshot (committed batches only). A folder that is not a
    table but holds Parquet files (an older version's layout) is refused: read as empty, its clicks would be lost."""
    store = as_store(out)
    names = pipelines_in(store)
    for name in names:
        key = f"{name}/{kind}"
        if not tables.is_table(store, key) and any(e.key.endswith(".parquet") for e in store.files(key)):
            raise tables.OutputTableError(
                f"{store.location(key)} holds Parquet files but is not a Delta table (an output folder of an older "
                "version of this project?): the audit reads the output tables only"
            )
    return tables.read(store, kind, columns, where, only=names, with_pipeline_folder=True)


def _sample(arr: pa.Array | pa.ChunkedArray) -> list[str]:
    return [str(x) for x in arr.slice(0, SAMPLE).to_pylist()]


def _value_counts(arr: pa.Array | pa.ChunkedArray) -> dict[str, int]:
    if len(arr) == 0:
        return {}
    vc = pc.value_counts(arr)
    return {str(v["values"]): int(v["counts"]) for v in vc.to_pylist()}


def _unique(arr: pa.ChunkedArray | pa.Array) -> pa.Array:
    return pc.unique(arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr)


def audit(
    out: Path | Store,
    *,
    manifest: Path | None = None,
    logs: Path | Store | str | None = None,
    spark: Any = None,
    ran: Sequence[str] | None = None,
) -> AuditReport:
    """Audit ``out`` against a manifest folder, or against the input logs under ``logs`` (a folder or a store; needs
    Spark). With a manifest, ``logs`` is where its query files are read when a lost click's replicas must be told
    apart (default: the manifest's parent folder, where the generator puts it beside the logs). ``ran``: the
    data centers whose pipelines ran, all of them (default: those with a pipeline folder under ``out``); a lost click
    only another data center could still join is then pending there, not lost."""
    pipelines = pipelines_in(out)
    with_output = sorted({data_center_of(out, p) for p in pipelines})
    if ran is not None:
        extra = sorted(set(with_output) - set(ran))
        if extra:
            raise ValueError(
                f"--dcs {','.join(ran)}: {out} also holds output of {', '.join(extra)}: name every data center that ran"
            )
    if manifest is not None:
        clicks = pq.read_table(manifest / "clicks.parquet", columns=["click_id", "query_id", "expect", "click_ts_us"])
        files = pq.read_table(manifest / "files.parquet", columns=["dc", "kind", "name", "malformed"])
        source = "manifest"
    elif logs is not None:
        clicks, files = input_from_logs(as_store(logs), spark)
        source = "logs"
    else:
        raise ValueError("audit needs a manifest or the input logs")
    report = AuditReport(source, pipelines, input_clicks=clicks.num_rows)
    report.data_centers = sorted(set(files["dc"].to_pylist()) | set(with_output))
    report.data_centers_run = sorted(ran) if ran is not None else with_output
    report.run_declared = ran is not None
    joined = read_output(out, JOINED, ["click_id", "query_id", "click_ts_us", "joined_at_us"])
    unjoinable = read_output(out, UNJOINABLE, ["click_id", "reason"])
    quarantined = read_output(out, QUARANTINE, ["kind", "file", "line"])
    report.joined_rows = joined.num_rows

    # Duplicates across every joined table.
    counts = joined.group_by("click_id").aggregate([("click_id", "count")])
    dup = counts.filter(pc.greater(counts["click_id_count"], 1))
    report.duplicate_clicks = dup.num_rows
    report.duplicate_extra_rows = int(pc.sum(dup["click_id_count"]).as_py() or 0) - dup.num_rows
    report.samples["duplicates"] = _sample(dup["click_id"])

    # Output for clicks that were never input.
    input_ids = clicks["click_id"].combine_chunks()
    joined_ids, unjoinable_ids = counts["click_id"].combine_chunks(), _unique(unjoinable["click_id"])
    unexpected = pa.concat_arrays(
        [
            joined_ids.filter(pc.invert(pc.is_in(joined_ids, value_set=input_ids))),
            unjoinable_ids.filter(pc.invert(pc.is_in(unjoinable_ids, value_set=input_ids))),
        ]
    )
    report.unexpected = len(_unique(unexpected))
    report.samples["unexpected"] = _sample(unexpected)

    # Joined to the right query?
    pairs = joined.select(["click_id", "query_id"]).join(
        clicks.select(["click_id", "query_id"]).rename_columns(["click_id", "true_query_id"]), "click_id"
    )
    wrong = pairs.filter(pc.not_equal(pairs["query_id"], pairs["true_query_id"]))
    report.wrong_query = len(_unique(wrong["click_id"]))
    report.samples["wrong_query"] = _sample(wrong["click_id"])

    # Outcomes of every input click.
    in_joined = pc.is_in(input_ids, value_set=joined_ids).to_numpy(zero_copy_only=False)
    in_unjoinable = pc.is_in(input_ids, value_set=unjoinable_ids).to_numpy(zero_copy_only=False)
    expect = clicks["expect"].to_numpy().astype(str)
    must_join = expect == "join"
    lost = (must_join & ~in_joined) | (~must_join & ~in_joined & ~in_unjoinable)
    not_run = [dc for dc in report.data_centers if dc not in report.data_centers_run]
    if manifest is not None and not_run and (lost & must_join).any():
        candidates = np.flatnonzero(lost & must_join)
        in_time = _in_time_by_replica(
            manifest, clicks.take(pa.array(candidates)), report.data_centers, as_store(logs or manifest.parent)
        )
        # Only a click no data center that ran could join (its replica had the query late): one that ran had it in
        # time and lost it, which is that pipeline's loss whoever else might still join it (EVENTS.md).
        none_ran = np.ones(len(candidates), dtype=bool)
        for dc in report.data_centers_run:
            none_ran &= ~in_time.get(dc, np.zeros(len(candidates), dtype=bool))
        joinable = {dc: in_time[dc] & none_ran for dc in not_run}
        report.joinable_by = {dc: int(v.sum()) for dc, v in joinable.items() if v.any()}
        pending = np.zeros(len(candidates), dtype=bool)
        for v in joinable.values():
            pending |= v
        report.still_joinable = int(pending.sum())
        report.samples["still_joinable"] = _sample(input_ids.take(pa.array(candidates[pending])))
        if report.run_declared:  # pending in the data centers that did not run, not lost
            lost[candidates[pending]] = False
    report.lost = int(lost.sum())
    report.lost_by_expectation = {
        str(k): int(v) for k, v in zip(*np.unique(expect[lost], return_counts=True), strict=True)
    }
    report.samples["lost"] = _sample(input_ids.filter(pa.array(lost)))
    report.outcomes = {
        "joined": int(in_joined.sum()),
        "unjoinable": int((~in_joined & in_unjoinable).sum()),
        "none": int((~in_joined & ~in_unjoinable).sum()),
    }
    report.joined_although_unjoinable = int((in_joined & (expect == "unjoinable")).sum())
    report.joined_and_unjoinable = int((in_joined & in_unjoinable).sum())
    report.unjoinable_records = unjoinable.num_rows
    report.unjoinable_records_joined_elsewhere = int(
        pc.sum(pc.is_in(unjoinable["click_id"], value_set=joined_ids)).as_py() or 0
    )
    # Each input click given up and joined nowhere, once, under one reason (the least by text, when its pipelines
    # gave different ones): the table then counts the clicks the outcome counts, not every pipeline's record of them.
    given_up = unjoinable.filter(
        pc.and_(
            pc.is_in(unjoinable["click_id"], value_set=input_ids),
            pc.invert(pc.is_in(unjoinable["click_id"], value_set=joined_ids)),
        )
    )
    per_click = given_up.group_by("click_id").aggregate([("reason", "min")])
    report.unjoinable_by_reason = _value_counts(per_click["reason_min"])

    report.quarantine = _quarantine(files, quarantined, {p: data_center_of(out, p) for p in pipelines})
    report.shares = _shares(joined, pipelines)
    report.latency_s = _latency(joined)
    return report


def _manifest_settings(manifest: Path) -> dict[str, float]:
    """The generator settings the arrival rule needs. Runs with different settings: the widest clock skew and
    rotation (to find a query's file), the shortest join delay and the widest margin (to call a replica in time
    only when it surely was)."""
    top = json.loads((manifest / "manifest.json").read_text())
    runs = [top["settings"]] if "settings" in top else []
    runs += [json.loads(p.read_text())["settings"] for p in sorted((manifest / "runs").glob("*.json"))]
    defaults = {"max_clock_skew_s": 10.0, "rotate_s": 1.0, "max_join_delay_s": 120.0, "boundary_margin_s": 5.0}
    if not runs:
        return defaults

    def values(key: str) -> list[float]:
        return [float(r.get(key, defaults[key])) for r in runs]

    return {
        "max_clock_skew_s": max(values("max_clock_skew_s")),
        "rotate_s": max(values("rotate_s")),
        "max_join_delay_s": min(values("max_join_delay_s")),
        "boundary_margin_s": max(values("boundary_margin_s")),
    }


def _in_time_by_replica(manifest: Path, clicks: pa.Table, dcs: list[str], logs: Store) -> dict[str, np.ndarray]:
    """For each data center in ``dcs``: which of ``clicks`` its replica had the query of in time, its file having
    arrived there at least the boundary margin before the click's deadline (the manifest's rule for ``join``, per
    replica).

    The manifest keeps each click's first arrival over all replicas, not each replica's: the query's file is found
    by reading the query files themselves. A file holds one process's events (EVENTS.md, "File names"), and it
    closes within a rotation of its events' true time, which is within the clock skew of their stamp: the files of
    the query id's process closing in that window, or a rotation later (a duplicated line may be in the next file),
    are read (from any replica: they hold the same files), and a replica had the query at the earliest arrival
    there of any file holding it (``files.parquet``)."""
    st = _manifest_settings(manifest)
    us = 1_000_000
    files = pq.read_table(manifest / "files.parquet", columns=["dc", "kind", "name", "close_us", "arrival_us"])
    files = files.filter(pc.equal(files["kind"], "queries")).to_pylist()
    # basename -> {dc: (name under the kind's folder, arrival)}; process -> [(close_us, basename)]
    where: dict[str, dict[str, tuple[str, int]]] = {}
    by_process: dict[str, list[tuple[int, str]]] = {}
    for f in files:
        base = f["name"].rsplit("/", 1)[-1]
        if base not in where:
            by_process.setdefault(base.rsplit("-", 1)[0], []).append((int(f["close_us"]), base))
        where.setdefault(base, {})[f["dc"]] = (f["name"], int(f["arrival_us"]))
    for entries in by_process.values():
        entries.sort()
    skew, rot = int(st["max_clock_skew_s"] * us), int(st["rotate_s"] * us)
    query_ids = clicks["query_id"].to_pylist()
    wanted: dict[str, list[str]] = {}  # candidate file -> the query ids it may hold
    for qid in set(query_ids):
        process, _, stamp = qid.rpartition("-")
        ts = int(stamp)
        for close, base in by_process.get(process, []):
            # + a rotation: a duplicated line may be sent again in the process's next file (the generator's rule)
            if ts - skew < close <= ts + skew + 2 * rot:
                wanted.setdefault(base, []).append(qid)
    # Every file holding the query: a replica had it in time if any of them reached it in time.
    files_of: dict[str, list[str]] = {}
    for base, qids in wanted.items():
        for dc, (name, _) in where[base].items():
            try:
                body = logs.get(f"{dc}/queries/{name}")
            except FileNotFoundError:
                continue
            for q in _query_ids_in(body, set(qids)):
                files_of.setdefault(q, []).append(base)
            break
    deadline = clicks["click_ts_us"].to_numpy() + int((st["max_join_delay_s"] - st["boundary_margin_s"]) * us)
    out = {}
    for dc in dcs:
        never = np.iinfo(np.int64).max
        arrival = np.array(
            [min((where[b].get(dc, ("", never))[1] for b in files_of.get(q, [])), default=never) for q in query_ids],
            dtype=np.int64,
        )
        out[dc] = arrival <= deadline
    return out


def _query_ids_in(body: bytes, ids: set[str]) -> set[str]:
    """Which of ``ids`` have a well-formed line (a JSON object with that ``query_id``) in the query file ``body``."""
    found = set()
    for line in body.split(b"\n"):
        m = _QUERY_ID.search(line)
        if m is None or m.group(1).decode("utf-8", "replace") not in ids:
            continue  # a quick look first: only a line naming a wanted id is parsed
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and obj.get("query_id") in ids:
            found.add(obj["query_id"])
    return found


_QUERY_ID = re.compile(rb'"query_id"\s*:\s*"([^"]*)"')


def _quarantine(files: pa.Table, quarantined: pa.Table, dc_of: dict[str, str]) -> dict[str, Any]:
    """Per data center and input file: distinct lines quarantined (by any of its pipelines) against malformed lines
    expected. A line quarantined by two pipelines of one data center (a live joiner and a backfill) counts once."""
    dcs = sorted(set(dc_of.values()))
    expected = files.filter(pc.is_in(files["dc"], value_set=pa.array(dcs, pa.string())))
    expected = expected.filter(pc.greater(expected["malformed"], 0)).rename_columns(
        ["folder", "kind", "file", "expected"]
    )
    folders = quarantined["folder"].to_pylist()
    lines = quarantined.drop_columns(["folder"]).append_column(
        "folder", pa.array([dc_of[f] for f in folders], pa.string())
    )
    lines = lines.group_by(["folder", "kind", "file", "line"]).aggregate([])
    found = lines.group_by(["folder", "kind", "file"]).aggregate([("line", "count")])
    found = found.rename_columns(["folder", "kind", "file", "found"])
    both = expected.join(found, ["folder", "kind", "file"], join_type="full outer")
    exp = pc.fill_null(both["expected"], 0).to_numpy()
    got = pc.fill_null(both["found"], 0).to_numpy()
    bad = exp != got
    mismatched = both.filter(pa.array(bad))
    return {
        "expected": int(exp.sum()),
        "found": int(got.sum()),
        "missing": int(np.maximum(exp - got, 0).sum()),
        "extra": int(np.maximum(got - exp, 0).sum()),
        "files_mismatched": [
            f"{r['folder']}/{r['kind']}/{r['file']}: expected {r['expected'] or 0}, found {r['found'] or 0}"
            for r in mismatched.slice(0, SAMPLE).to_pylist()
        ],
    }


def _shares(joined: pa.Table, pipelines: list[str]) -> dict[str, dict[str, float]]:
    counts = _value_counts(joined["folder"])
    total = max(1, joined.num_rows)
    return {p: {"joined": counts.get(p, 0), "share": round(counts.get(p, 0) / total, 4)} for p in pipelines}


def _latency(joined: pa.Table) -> dict[str, float]:
    if joined.num_rows == 0:
        return {}
    lat = (pc.subtract(joined["joined_at_us"], joined["click_ts_us"]).to_numpy() / 1e6).astype(np.float64)
    p50, p90, p99 = np.percentile(lat, [50, 90, 99])
    return {
        "p50": round(float(p50), 3),
        "p90": round(float(p90), 3),
        "p99": round(float(p99), 3),
        "max": round(float(lat.max()), 3),
    }


# -- input from the logs themselves (no manifest) -------------------------------------------------------------

# The auditor's own reading of EVENTS.md, deliberately not the joiner's code.
_OCTET = r"(0|[1-9][0-9]{0,2})"
_ID = rf"^{_OCTET}\.{_OCTET}\.{_OCTET}\.{_OCTET}-(0|[1-9][0-9]{{0,9}})-(0|[1-9][0-9]{{0,17}})$"
_AD = r"^[A-Za-z0-9_.:-]{1,64}$"
_MAX_LINE = 1 << 20


def input_from_logs(logs: Path | Store, spark: Any) -> tuple[pa.Table, pa.Table]:
    """Valid clicks (deduplicated, every replica) and malformed lines per file, read with Spark. Logs in an object
    store are copied into a temporary folder first (their closed files, at the same paths), so that Spark's text
    reader reads them as it reads a folder: the reading, line splits included, is the same."""
    if spark is None:
        raise ValueError("auditing from the logs needs a SparkSession")
    store = as_store(logs)
    if isinstance(store, LocalStore):
        return _input_from_folder(store.root, spark)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="photon-audit-") as tmp:
        for e in store.listing():
            if e.key.endswith(".jsonl") and e.key.split("/")[0][:1] not in "_." and len(e.key.split("/")) >= 3:
                path = Path(tmp) / e.key
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(store.get(e.key))
        return _input_from_folder(Path(tmp), spark)


def _input_from_folder(logs: Path, spark: Any) -> tuple[pa.Table, pa.Table]:
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    dcs = sorted(p.name for p in logs.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))
    click_schema = T.StructType(
        [
            T.StructField("click_id", T.StringType()),
            T.StructField("ts_us", T.LongType()),
            T.StructField("query_id", T.StringType()),
            T.StructField("ad_id", T.StringType()),
        ]
    )
    query_schema = T.StructType(
        [
            T.StructField("query_id", T.StringType()),
            T.StructField("ts_us", T.LongType()),
            T.StructField("ads", T.ArrayType(T.StructType([T.StructField("ad_id", T.StringType())]))),
        ]
    )
    valid_clicks = None
    file_counts = []
    for dc in dcs:
        for kind, schema in (("clicks", click_schema), ("queries", query_schema)):
            folder = logs / dc / kind
            if not any(folder.rglob("*.jsonl")):
                continue
            # Closed files, directly in the folder or in its arrival partitions; a file is named by its path
            # relative to the folder, as quarantine records name it.
            lines = (
                spark.read.option("pathGlobFilter", "*.jsonl")
                .option("recursiveFileLookup", "true")
                .text(str(folder))
                .select(F.regexp_extract(F.input_file_name(), f"/{kind}/(.*)$", 1).alias("file"), "value")
            )
            j = F.from_json("value", schema, {"mode": "PERMISSIVE"})
            parsed = lines.select("file", "value", j.alias("j"))
            ok = (
                F.col("j").isNotNull()
                & (F.length("value") <= _MAX_LINE)
                & F.expr("is_valid_utf8(value)")  # the text reader keeps the raw bytes of each line
                & F.col("j.ts_us").isNotNull()
            )
            if kind == "clicks":
                ok = ok & F.col("j.click_id").rlike(_ID) & F.col("j.query_id").rlike(_ID) & F.col("j.ad_id").rlike(_AD)
                clicks = parsed.where(F.coalesce(ok, F.lit(False))).select(
                    F.col("j.click_id").alias("click_id"), F.col("j.query_id").alias("query_id")
                )
                valid_clicks = clicks if valid_clicks is None else valid_clicks.unionByName(clicks)
            else:
                ok = ok & F.col("j.query_id").rlike(_ID) & F.col("j.ads").isNotNull()
            ok = F.coalesce(ok, F.lit(False))  # a NULL (missing field) is not valid: count it as malformed
            bad = parsed.where(~ok).groupBy("file").count().collect()
            file_counts += [(dc, kind, r["file"], int(r["count"])) for r in bad]
    if valid_clicks is None:
        clicks_tbl = pa.table({"click_id": pa.array([], pa.string()), "query_id": pa.array([], pa.string())})
    else:
        rows = valid_clicks.dropDuplicates(["click_id"]).toArrow()
        clicks_tbl = pa.table({"click_id": rows["click_id"], "query_id": rows["query_id"]})
    # Without the manifest nothing says when a query arrived: every click just needs one outcome.
    clicks_tbl = clicks_tbl.append_column("expect", pa.array(["either"] * clicks_tbl.num_rows, pa.string()))
    files = pa.table(
        {
            "dc": [f[0] for f in file_counts],
            "kind": [f[1] for f in file_counts],
            "name": [f[2] for f in file_counts],
            "malformed": pa.array([f[3] for f in file_counts], pa.int64()),
        }
    )
    return clicks_tbl, files


def _by_expectation(counts: dict[str, int]) -> str:
    """' (must join 19,387, unjoinable 190)': what the manifest said the lost clicks must become."""
    words = {"join": "must join"}
    return f" ({', '.join(f'{words.get(k, k)} {n:,}' for k, n in sorted(counts.items()))})" if counts else ""


def print_audit(report: AuditReport, console: Console) -> None:
    """The report for a person: the verdict, then one line per measure (``photon audit``, the demo)."""
    from rich.markup import escape

    verdict = "[bold green]PASS[/]" if report.ok else "[bold red]FAIL[/]: " + "; ".join(report.failures())
    console.print(f"audit against the {report.source}: {verdict}")
    console.print(
        f"  input clicks {report.input_clicks:,}; joined rows {report.joined_rows:,}; duplicates "
        f"{report.duplicate_clicks}; lost {report.lost:,}{_by_expectation(report.lost_by_expectation)}; unexpected "
        f"{report.unexpected}; joined to another query {report.wrong_query}"
    )
    if report.still_joinable:
        names = " or ".join(sorted(report.joinable_by))
        by = ", ".join(f"{dc} {n:,}" for dc, n in sorted(report.joinable_by.items()))
        if report.run_declared:
            console.print(
                f"  pending: {report.still_joinable:,} clicks only {names} could join ({by}: its replica had the query"
                f" in time; not run): not lost, not in any output yet"
            )
        else:
            ran = ",".join(report.data_centers_run) or "..."
            console.print(
                f"  of the lost, {report.still_joinable:,} could still be joined by {names} ({by}: its replica had the"
                f" query in time; no {names} pipeline output yet); `--dcs {ran}` if only those ran: then pending"
            )
    o = report.outcomes
    unjoinable = o.get("unjoinable", 0)
    console.print(
        f"  outcomes (clicks, each once): joined {o.get('joined', 0):,}, unjoinable {unjoinable:,}, "
        f"none {o.get('none', 0):,}"
    )
    if report.unjoinable_records:
        by_reason = sorted(report.unjoinable_by_reason.items(), key=lambda x: -x[1])
        reasons = "; ".join(f"{n:,} {escape(why)}" for why, n in by_reason) or "none (all joined elsewhere)"
        console.print(f"  the {unjoinable:,} unjoinable clicks by reason: {reasons}")
        elsewhere = report.unjoinable_records_joined_elsewhere
        console.print(
            f"  ({report.unjoinable_records:,} records in the unjoinable/ folders: a click given up by two pipelines"
            f" has one in each; {elsewhere:,} of them of clicks another pipeline joined: their outcome is joined)"
        )
    q = report.quarantine
    console.print(
        f"  quarantine: expected {q['expected']:,}, found {q['found']:,}, missing {q['missing']}, extra {q['extra']}"
    )
    for line in q["files_mismatched"]:
        console.print(f"    {line}")
    shares = ", ".join(f"{p} {v['joined']:,} ({v['share']:.1%})" for p, v in report.shares.items())
    console.print(f"  pipelines' shares of the joins: {shares}")
    if report.latency_s:
        lat = report.latency_s
        console.print(
            f"  end-to-end latency: p50 {lat['p50']}s, p90 {lat['p90']}s, p99 {lat['p99']}s, max {lat['max']}s"
        )
    if report.joined_although_unjoinable or report.joined_and_unjoinable:
        console.print(
            f"  note: {report.joined_although_unjoinable} joined although their query came too late; "
            f"{report.joined_and_unjoinable} joined by one pipeline and given up by another"
        )
    for name, ids in report.samples.items():
        if ids:
            console.print(f"  {name}: {', '.join(ids)}")
