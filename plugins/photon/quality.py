"""Data-quality checks over the output of every pipeline for one interval, as a Great Expectations (1.x) checkpoint.

Two batches are validated per interval (clicks whose own timestamp falls in ``[start, end)``):
- ``joined``: the joined rows of all pipelines together. Click ids unique across pipelines, required fields present,
  the click after its query (within the maximum clock skew), end-to-end latency within the SLO for most clicks.
- ``rates``: one row of rates. Unjoinable clicks per decided click, quarantined lines per decided click.

The GX project lives in ``<out>/_quality/gx`` and the Data Docs site (HTML) in ``<out>/_quality/data_docs``; both
folders start with ``_`` so no reader of the output takes them for a pipeline.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from photon.audit import read_output
from photon.schemas import JOINED, QUARANTINE, UNJOINABLE

US = 1_000_000
QUALITY_DIR = "_quality"
REQUIRED = ["click_id", "query_id", "ad_id", "click_ts_us", "query_ts_us", "joined_at_us", "pipeline"]


@dataclass(frozen=True)
class QualitySettings:
    max_clock_skew_s: float = 10.0  # a click may carry a timestamp up to this much before its query's
    latency_slo_s: float = 60.0  # end-to-end: joined_at minus the click's timestamp
    latency_mostly: float = 0.99  # share of clicks that must meet the SLO
    max_unjoinable_rate: float = 0.05  # unjoinable clicks per decided click
    max_quarantine_rate: float = 0.05  # quarantined lines (queries' and clicks') per decided click


@dataclass
class QualityResult:
    success: bool
    start_us: int
    end_us: int
    joined: int
    unjoinable: int
    quarantined: int
    failed: list[str] = field(default_factory=list)  # "batch: expectation(column)" of every failed expectation
    statistics: dict[str, Any] = field(default_factory=dict)
    docs_index: str = ""

    def summary(self) -> dict[str, Any]:
        """JSON-safe; what the DAG pushes to XCom."""
        return asdict(self)


def _interval(out: Path, start_us: int, end_us: int) -> tuple[pa.Table, int, int]:
    in_range = (ds.field("click_ts_us") >= start_us) & (ds.field("click_ts_us") < end_us)
    joined = read_output(out, JOINED, [*REQUIRED, "user_id", "country", "advertiser_id", "bid_micros"], in_range)
    unjoinable = read_output(out, UNJOINABLE, ["click_id"], in_range)
    decided = (ds.field("decided_at_us") >= start_us) & (ds.field("decided_at_us") < end_us)
    quarantined = read_output(out, QUARANTINE, ["line"], decided).num_rows
    # A click given up by one pipeline may be joined by the other: count clicks, not rows.
    gave_up = pc.unique(unjoinable.column("click_id"))
    gave_up = pc.filter(gave_up, pc.invert(pc.is_in(gave_up, value_set=pc.unique(joined.column("click_id")))))
    return joined, len(gave_up), quarantined


def _context(root: Path) -> Any:
    import great_expectations as gx

    context = gx.get_context(mode="file", project_root_dir=str(root))
    site = str(root / "data_docs")
    if "photon" not in (context.variables.data_docs_sites or {}):
        context.add_data_docs_site(
            site_name="photon",
            site_config={
                "class_name": "SiteBuilder",
                "store_backend": {"class_name": "TupleFilesystemStoreBackend", "base_directory": site},
                "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
            },
        )
    return context


def _suites(gx: Any, s: QualitySettings) -> dict[str, Any]:
    e = gx.expectations
    joined = gx.ExpectationSuite(name="photon_joined")
    joined.add_expectation(e.ExpectColumnValuesToBeUnique(column="click_id"))
    for column in REQUIRED:
        joined.add_expectation(e.ExpectColumnValuesToNotBeNull(column=column))
    joined.add_expectation(e.ExpectColumnValuesToBeBetween(column="click_after_query_s", min_value=-s.max_clock_skew_s))
    joined.add_expectation(
        e.ExpectColumnValuesToBeBetween(column="latency_s", max_value=s.latency_slo_s, mostly=s.latency_mostly)
    )
    rates = gx.ExpectationSuite(name="photon_rates")
    rates.add_expectation(
        e.ExpectColumnValuesToBeBetween(column="unjoinable_rate", min_value=0, max_value=s.max_unjoinable_rate)
    )
    rates.add_expectation(
        e.ExpectColumnValuesToBeBetween(column="quarantine_rate", min_value=0, max_value=s.max_quarantine_rate)
    )
    return {"joined": joined, "rates": rates}


def check_quality(out: Path, start_us: int, end_us: int, settings: QualitySettings | None = None) -> QualityResult:
    """Run the checkpoint for clicks stamped in ``[start_us, end_us)`` and update the Data Docs site."""
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")  # no network calls from a data-quality task
    import great_expectations as gx
    import pandas as pd

    s = settings or QualitySettings()
    joined, unjoinable, quarantined = _interval(out, start_us, end_us)
    frame = joined.to_pandas()
    frame["click_after_query_s"] = (frame["click_ts_us"] - frame["query_ts_us"]) / US
    frame["latency_s"] = (frame["joined_at_us"] - frame["click_ts_us"]) / US
    decided = joined.num_rows + unjoinable
    rates = pd.DataFrame(
        {
            "unjoinable_rate": [unjoinable / decided if decided else 0.0],
            "quarantine_rate": [quarantined / decided if decided else 0.0],
        }
    )
    root = out / QUALITY_DIR
    root.mkdir(parents=True, exist_ok=True)
    logging.getLogger("great_expectations").setLevel(logging.WARNING)
    context = _context(root)
    datasource = context.data_sources.add_or_update_pandas("photon_output")
    definitions = []
    for name, suite in _suites(gx, s).items():
        asset = next((a for a in datasource.assets if a.name == name), None) or datasource.add_dataframe_asset(name)
        batch = next((b for b in asset.batch_definitions if b.name == "interval"), None)
        batch = batch or asset.add_batch_definition_whole_dataframe("interval")
        suite = context.suites.add_or_update(suite)
        definitions.append(
            context.validation_definitions.add_or_update(gx.ValidationDefinition(name=name, data=batch, suite=suite))
        )
    failed: list[str] = []
    statistics: dict[str, Any] = {}
    success = True
    for definition, frame_ in zip(definitions, (frame, rates), strict=True):
        checkpoint = context.checkpoints.add_or_update(
            gx.Checkpoint(
                name=f"photon_{definition.name}",
                validation_definitions=[definition],
                actions=[gx.checkpoint.UpdateDataDocsAction(name="data_docs", site_names=["photon"])],
                result_format="SUMMARY",
            )
        )
        result = checkpoint.run(batch_parameters={"dataframe": frame_}, run_id=_run_id(gx, start_us, end_us))
        success &= bool(result.success)
        for vr in result.run_results.values():
            statistics[definition.name] = dict(vr.statistics)
            for r in vr.results:
                if not r.success:
                    cfg = r.expectation_config
                    failed.append(f"{definition.name}: {cfg.type}({cfg.kwargs.get('column', '')})")
    return QualityResult(
        success=success,
        start_us=start_us,
        end_us=end_us,
        joined=joined.num_rows,
        unjoinable=unjoinable,
        quarantined=quarantined,
        failed=failed,
        statistics=statistics,
        docs_index=str(root / "data_docs" / "index.html"),
    )


def _run_id(gx: Any, start_us: int, end_us: int) -> Any:
    from datetime import UTC, datetime

    from great_expectations.core.run_identifier import RunIdentifier

    start = datetime.fromtimestamp(start_us / US, UTC)
    return RunIdentifier(run_name=f"interval {start:%Y-%m-%dT%H:%M:%S}+{(end_us - start_us) // US}s", run_time=start)
