"""`photon audit`: an independent check of every pipeline's output against the input.

It trusts nothing the joiner decided and shares none of its code: it reads files and counts. The ground truth is
the generator's manifest (what every click must become) or, without one, the input logs themselves (read with
Spark, with the auditor's own reading of the EVENTS.md rules). Everything runs column-wise in Arrow (hash joins,
group-bys, set membership), so tens of millions of clicks never become Python objects.

Failures (exit status 1): a click id in ``joined/`` more than once across all pipelines; a lost click (one that
must join and did not, or any click with no outcome at all); an unexpected row (output for a click that was never
input); a click joined to a query other than its own; a malformed line missing from (or a valid line found in)
quarantine. Reported but not failures: clicks joined although the manifest said the query came too late, clicks
joined by one pipeline and given up by another.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from photon.logs.layout import data_center_of
from photon.logs.schemas import JOINED, JOINED_SCHEMA, QUARANTINE, QUARANTINE_SCHEMA, UNJOINABLE, UNJOINABLE_SCHEMA

if TYPE_CHECKING:
    from rich.console import Console  # print_audit's caller brings its console

SAMPLE = 10


@dataclass
class AuditReport:
    source: str  # "manifest" or "logs"
    pipelines: list[str]
    input_clicks: int = 0
    joined_rows: int = 0
    duplicate_clicks: int = 0  # click ids in joined/ more than once
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
    quarantine: dict[str, Any] = field(default_factory=dict)
    shares: dict[str, dict[str, float]] = field(default_factory=dict)
    latency_s: dict[str, float] = field(default_factory=dict)
    samples: dict[str, list[str]] = field(default_factory=dict)

    def failures(self) -> list[str]:
        out = []
        if self.duplicate_clicks:
            out.append(f"{self.duplicate_clicks} click id(s) joined more than once")
        if self.lost:
            out.append(f"{self.lost} lost click(s)")
        if self.unexpected:
            out.append(f"{self.unexpected} unexpected click id(s) in the output")
        if self.wrong_query:
            out.append(f"{self.wrong_query} click(s) joined to another query")
        if self.quarantine.get("missing"):
            out.append(f"{self.quarantine['missing']} malformed line(s) missing from quarantine")
        if self.quarantine.get("extra"):
            out.append(f"{self.quarantine['extra']} quarantine record(s) more than malformed lines")
        return out

    @property
    def ok(self) -> bool:
        return not self.failures()

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "ok": self.ok, "failures": self.failures()}, indent=2, sort_keys=True)


def pipelines_in(out: Path) -> list[str]:
    if not out.is_dir():
        raise FileNotFoundError(f"output folder {out} does not exist")
    return sorted(p.name for p in out.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))


def read_output(out: Path, kind: str, columns: list[str], where: ds.Expression | None = None) -> pa.Table:
    """One output kind of every pipeline (rows matching ``where``), with a ``folder`` column naming the pipeline
    folder it came from. In-progress files (``_*``, ``.*``) are skipped by the dataset reader."""
    schema = {JOINED: JOINED_SCHEMA, UNJOINABLE: UNJOINABLE_SCHEMA, QUARANTINE: QUARANTINE_SCHEMA}[kind]
    tables = []
    for name in pipelines_in(out):
        folder = out / name / kind
        if not folder.is_dir():
            continue
        t = ds.dataset(folder, format="parquet", schema=schema).to_table(columns=columns, filter=where)
        tables.append(t.append_column("folder", pa.array([name] * t.num_rows, pa.string())))
    if not tables:
        empty = pa.schema([schema.field(c) for c in columns] + [pa.field("folder", pa.string())])
        return empty.empty_table()
    return pa.concat_tables(tables)


def _sample(arr: pa.Array | pa.ChunkedArray) -> list[str]:
    return [str(x) for x in arr.slice(0, SAMPLE).to_pylist()]


def _value_counts(arr: pa.Array | pa.ChunkedArray) -> dict[str, int]:
    if len(arr) == 0:
        return {}
    vc = pc.value_counts(arr)
    return {str(v["values"]): int(v["counts"]) for v in vc.to_pylist()}


def _unique(arr: pa.ChunkedArray | pa.Array) -> pa.Array:
    return pc.unique(arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr)


def audit(out: Path, *, manifest: Path | None = None, logs: Path | None = None, spark: Any = None) -> AuditReport:
    """Audit ``out`` against a manifest folder, or against the input logs under ``logs`` (needs Spark)."""
    pipelines = pipelines_in(out)
    if manifest is not None:
        clicks = pq.read_table(manifest / "clicks.parquet", columns=["click_id", "query_id", "expect"])
        files = pq.read_table(manifest / "files.parquet", columns=["dc", "kind", "name", "malformed"])
        source = "manifest"
    elif logs is not None:
        clicks, files = input_from_logs(logs, spark)
        source = "logs"
    else:
        raise ValueError("audit needs a manifest or the input logs")
    report = AuditReport(source, pipelines, input_clicks=clicks.num_rows)
    joined = read_output(out, JOINED, ["click_id", "query_id", "click_ts_us", "joined_at_us"])
    unjoinable = read_output(out, UNJOINABLE, ["click_id", "reason"])
    quarantined = read_output(out, QUARANTINE, ["kind", "file", "line"])
    report.joined_rows = joined.num_rows

    # Duplicates across every joined/ folder.
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


def input_from_logs(logs: Path, spark: Any) -> tuple[pa.Table, pa.Table]:
    """Valid clicks (deduplicated, every replica) and malformed lines per file, read with Spark."""
    if spark is None:
        raise ValueError("auditing from the logs needs a SparkSession")
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
        console.print(
            f"  ({report.unjoinable_records:,} records in the unjoinable/ folders: a click given up by two pipelines"
            " has one in each)"
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
