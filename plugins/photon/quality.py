"""Data-quality checks over the output of every pipeline for one interval, as a Great Expectations (1.x) checkpoint.

Two batches are validated per interval ``[start, end)``:
- ``joined``: the joined rows, of all pipelines together, whose click is stamped in the interval. Click ids unique
  across pipelines, required fields present, the click after its query (within the maximum clock skew), and the
  live pipelines' end-to-end latency within the SLO for most clicks.
- ``rates``: one row. Unjoinable clicks per decided click of the interval; quarantined lines of the interval's input
  per decided click.

Each check means the same on a live hour and on one backfilled a week later:

- **Latency is the live pipelines' own.** End-to-end latency is ``joined_at_us - click_ts_us`` (docs/EVENTS.md). The
  output records no arrival time, and none would help: a backfill joins, on purpose, files that arrived hours or days
  before it ran, so any latency of its rows measures the age of the history it was asked to join. Rows of backfill
  pipelines (``backfill-...``, as ``photon_backfill`` names them) therefore get no latency (null, which GX leaves out
  of ``mostly``) and are judged by every other expectation; rows of every other pipeline are held to the SLO. A live
  pipeline that fell behind (its replica stalled, its joiner was down) fails the hours it joined late, as it should:
  that output reached its readers late.
- **Quarantine by the interval's input.** A quarantine record names its log file and line, not a time, and neither
  its decision time (when some pipeline read the line: a backfill reads history today) nor the line's own timestamp
  (the line is malformed) says which hour it belongs to. So a quarantined line belongs to the interval of its log
  file, by the rule ``photon_backfill`` uses to pick an interval's click files: the timestamp of the file's first
  well-formed event (``first_event_us``, read from ``<logs>/<dc>/<kind>/<file>``; the data center is the pipeline's,
  from its ``_pipeline.json``). A line counts once however many pipelines and replicas quarantined it; the verifier's
  ``recovered-*`` files are copies and never count. Only records decided after the interval began (less twice the
  clock skew) can belong to it, so the check reads the first bytes of a few files, not the history. A file no longer
  in the logs is reported (``quarantine_unattributed``), not counted. With no decided click, any quarantined line
  fails the rate (the rate is per ``max(decided, 1)``).

The GX project lives in ``<out>/_quality/gx`` and the Data Docs site (HTML) in ``<out>/_quality/data_docs``; both
folders start with ``_`` so no reader of the output takes them for a pipeline. GX's logging is kept to warnings and
its progress bars are off; the check logs one line per failed expectation (``photon.quality``).

**Data Docs offline.** GX's pages load Bootstrap, bootstrap-table (which draws every list, the validation results
included), jQuery and the rest from CDNs, so without internet they render blank. ``make setup`` installs the npm
packages those CDN links serve, at the versions the pages name (``plugins/photon/data_docs/package-lock.json``), beside
the venv; after each run the check copies the few files a page loads into ``<site>/static/vendor/`` and points the
pages there (the two files GX pins by SRI hash are byte-identical: a test checks the hashes). The Vega scripts are
dropped: only distribution expectations (KL divergence) draw charts, and this checkpoint has none. Without the
assets installed the pages keep their CDN links and a warning says so.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from photon.audit import data_center_of, read_output
from photon.joiner import RECOVERED_PREFIX, first_event_us
from photon.schemas import JOINED, QUARANTINE, UNJOINABLE

log = logging.getLogger(__name__)

US = 1_000_000
QUALITY_DIR = "_quality"
REQUIRED = ["click_id", "query_id", "ad_id", "click_ts_us", "query_ts_us", "joined_at_us", "pipeline"]
BACKFILL_PREFIX = "backfill-"  # photon_backfill's pipelines: backfill-<dc>-<interval start>


@dataclass(frozen=True)
class QualitySettings:
    max_clock_skew_s: float = 10.0  # a click may carry a timestamp up to this much before its query's
    latency_slo_s: float = 60.0  # live pipelines, end-to-end: joined_at minus the click's timestamp
    latency_mostly: float = 0.99  # share of live pipelines' clicks that must meet the SLO
    max_unjoinable_rate: float = 0.05  # unjoinable clicks per decided click
    max_quarantine_rate: float = 0.05  # quarantined lines (queries' and clicks') of the interval per decided click


@dataclass
class QualityResult:
    success: bool
    start_us: int
    end_us: int
    joined: int
    unjoinable: int
    quarantined: int  # distinct lines of the interval's input files
    backfilled: int = 0  # joined rows of backfill pipelines: no latency judged
    quarantine_unattributed: int = 0  # quarantine records whose log file is gone: not counted
    failed: list[str] = field(default_factory=list)  # "batch: expectation(column)" of every failed expectation
    details: list[str] = field(default_factory=list)  # the same, with what was observed
    statistics: dict[str, Any] = field(default_factory=dict)
    docs_index: str = ""

    def summary(self) -> dict[str, Any]:
        """JSON-safe; what the DAG pushes to XCom."""
        return asdict(self)


def _joined(out: Path, start_us: int, end_us: int) -> tuple[pa.Table, int]:
    """The joined rows of the interval, and the clicks of the interval given up by every pipeline that decided them.
    A joined row without its click time is placed by the time its click id carries (EVENTS.md: ``<ip>-<pid>-<ts>``),
    else by when it was joined: so that a missing ``click_ts_us`` fails the interval it belongs to."""
    in_range = (ds.field("click_ts_us") >= start_us) & (ds.field("click_ts_us") < end_us)
    columns = [*REQUIRED, "user_id", "country", "advertiser_id", "bid_micros"]
    joined = read_output(out, JOINED, columns, in_range | ds.field("click_ts_us").is_null())
    id_ts = pc.struct_field(pc.extract_regex(joined["click_id"], r"-(?P<ts>\d{1,18})$"), "ts")
    when = pc.coalesce(joined["click_ts_us"], pc.cast(id_ts, pa.int64()), joined["joined_at_us"])
    joined = joined.filter(pc.fill_null(pc.and_(pc.greater_equal(when, start_us), pc.less(when, end_us)), False))
    unjoinable = read_output(out, UNJOINABLE, ["click_id"], in_range)
    # A click given up by one pipeline may be joined by the other: count clicks, not rows.
    gave_up = pc.unique(unjoinable.column("click_id"))
    gave_up = pc.filter(gave_up, pc.invert(pc.is_in(gave_up, value_set=pc.unique(joined.column("click_id")))))
    return joined, len(gave_up)


def _quarantined(out: Path, logs: Path, start_us: int, end_us: int, skew_us: int) -> tuple[int, int]:
    """(distinct quarantined lines whose log file belongs to ``[start_us, end_us)``, records whose file is gone)."""
    # A file whose first event is stamped at or after start closed after start - skew; no pipeline decided its lines
    # before that (2x: the deciding machine's clock may be skewed too).
    since = ds.field("decided_at_us") >= start_us - 2 * skew_us
    q = read_output(out, QUARANTINE, ["kind", "file", "line"], since)
    q = q.filter(pc.invert(pc.starts_with(q["file"], RECOVERED_PREFIX)))
    if q.num_rows == 0:
        return 0, 0
    first: dict[tuple[str, str], int | None] = {}
    dcs = {p: data_center_of(out, p) for p in pc.unique(q["folder"]).to_pylist()}
    for row in q.group_by(["folder", "kind", "file"]).aggregate([]).to_pylist():
        key = (row["kind"], row["file"])
        if first.get(key) is None:  # replicas hold the same file: one readable copy is enough
            try:
                first[key] = first_event_us(logs / dcs[row["folder"]] / row["kind"] / row["file"])
            except OSError:
                first[key] = None
    key_col = pc.binary_join_element_wise(q["kind"], q["file"], "/")
    mine = [f"{k}/{f}" for (k, f), t in first.items() if t is not None and start_us <= t < end_us]
    gone = [f"{k}/{f}" for (k, f), t in first.items() if t is None]
    lines = q.filter(pc.is_in(key_col, value_set=pa.array(mine, pa.string())))
    unattributed = int(pc.sum(pc.is_in(key_col, value_set=pa.array(gone, pa.string())).cast(pa.int64())).as_py() or 0)
    if unattributed:
        log.warning("%d quarantine record(s) name log files no longer under %s: not counted", unattributed, logs)
    return lines.group_by(["kind", "file", "line"]).aggregate([]).num_rows, unattributed


def _quiet_gx() -> None:
    """GX logs INFO at import (its docs decorators) and per metric; keep its warnings only. Analytics off: a
    data-quality task makes no network call."""
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    logging.getLogger("great_expectations").setLevel(logging.WARNING)
    # Its own code's deprecations (sre_parse at import, ...): nothing a reader of the task log can act on.
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"great_expectations(\.|$)")


def _context(root: Path) -> Any:
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="file", project_root_dir=str(root))
    bars = context.variables.progress_bars  # None, or as loaded from great_expectations.yml: a dict
    if not bars or any(dict(bars.items() if isinstance(bars, dict) else vars(bars).items()).values()):
        context.variables.progress_bars = ProgressBarsConfig(globally=False, metric_calculations=False)
        context.variables.save()
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
        e.ExpectColumnValuesToBeBetween(column="live_latency_s", max_value=s.latency_slo_s, mostly=s.latency_mostly)
    )
    rates = gx.ExpectationSuite(name="photon_rates")
    rates.add_expectation(
        e.ExpectColumnValuesToBeBetween(column="unjoinable_rate", min_value=0, max_value=s.max_unjoinable_rate)
    )
    rates.add_expectation(
        e.ExpectColumnValuesToBeBetween(column="quarantine_rate", min_value=0, max_value=s.max_quarantine_rate)
    )
    return {"joined": joined, "rates": rates}


def check_quality(
    out: Path, logs: Path, start_us: int, end_us: int, settings: QualitySettings | None = None
) -> QualityResult:
    """Run the checkpoint for the interval ``[start_us, end_us)`` and update the Data Docs site. ``logs`` is the logs
    root the pipelines read (``<logs>/<dc>/{queries,clicks}``): quarantined lines are attributed by their file."""
    _quiet_gx()
    import great_expectations as gx
    import pandas as pd

    s = settings or QualitySettings()
    joined, unjoinable = _joined(out, start_us, end_us)
    quarantined, unattributed = _quarantined(out, logs, start_us, end_us, int(s.max_clock_skew_s * US))
    frame = joined.to_pandas()
    frame["click_after_query_s"] = (frame["click_ts_us"] - frame["query_ts_us"]) / US
    live = ~frame["pipeline"].fillna("").str.startswith(BACKFILL_PREFIX)
    frame["live_latency_s"] = ((frame["joined_at_us"] - frame["click_ts_us"]) / US).where(live)
    decided = max(joined.num_rows + unjoinable, 1)
    rates = pd.DataFrame({"unjoinable_rate": [unjoinable / decided], "quarantine_rate": [quarantined / decided]})
    root = out / QUALITY_DIR
    root.mkdir(parents=True, exist_ok=True)
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
    details: list[str] = []
    statistics: dict[str, Any] = {}
    success = True
    site = root / "data_docs"
    for definition, frame_ in zip(definitions, (frame, rates), strict=True):
        checkpoint = context.checkpoints.add_or_update(
            gx.Checkpoint(
                name=f"photon_{definition.name}",
                validation_definitions=[definition],
                actions=[gx.checkpoint.UpdateDataDocsAction(name="data_docs", site_names=["photon"])],
                result_format="SUMMARY",
            )
        )
        result = checkpoint.run(batch_parameters={"dataframe": frame_}, run_id=_run_id(start_us, end_us))
        success &= bool(result.success)
        for vr in result.run_results.values():
            statistics[definition.name] = dict(vr.statistics)
            for r in vr.results:
                if not r.success:
                    cfg = r.expectation_config
                    failed.append(f"{definition.name}: {cfg.type}({cfg.kwargs.get('column', '')})")
                    details.append(f"{failed[-1]}: {_observed(r.result)}")
    localize_data_docs(site)
    window = f"[{_iso(start_us)}, {_iso(end_us)})"
    counts = f"{joined.num_rows} joined, {unjoinable} unjoinable, {quarantined} quarantined lines"
    log.info("data quality %s: %s (%s)", window, "PASS" if success else f"FAIL, {len(failed)} expectation(s)", counts)
    for line in details:
        log.warning("data quality %s: %s", window, line)
    return QualityResult(
        success=success,
        start_us=start_us,
        end_us=end_us,
        joined=joined.num_rows,
        unjoinable=unjoinable,
        quarantined=quarantined,
        backfilled=int((~live).sum()),
        quarantine_unattributed=unattributed,
        failed=failed,
        details=details,
        statistics=statistics,
        docs_index=str(site / "index.html"),
    )


def _observed(result: dict[str, Any]) -> str:
    """What a failed expectation saw, in a few words: 'unexpected 12 of 4,000 (0.3%), e.g. [75.1, 80.2]'."""
    n = result.get("element_count")
    bad = result.get("unexpected_count")
    sample = [round(v, 4) if isinstance(v, float) else v for v in (result.get("partial_unexpected_list") or [])[:3]]
    if n == 1 and sample:
        return f"observed {sample[0]}"
    if bad is None:
        return "failed"
    pct = result.get("unexpected_percent") or 0.0
    return f"unexpected {bad:,} of {n or 0:,} ({pct:.2f}%)" + (f", e.g. {sample}" if sample else "")


def _iso(ts_us: int) -> str:
    from datetime import UTC, datetime

    return f"{datetime.fromtimestamp(ts_us / US, UTC):%Y-%m-%d %H:%M:%S}"


def _run_id(start_us: int, end_us: int) -> Any:
    from datetime import UTC, datetime

    from great_expectations.core.run_identifier import RunIdentifier

    start = datetime.fromtimestamp(start_us / US, UTC)
    return RunIdentifier(run_name=f"interval {start:%Y-%m-%dT%H:%M:%S}+{(end_us - start_us) // US}s", run_time=start)


# -- Data Docs offline ------------------------------------------------------------------------------------------

# Each CDN prefix in GX 1.24's page templates, and where the same file sits in the npm package (of the same name and
# version) that the CDN serves: plugins/photon/data_docs/package.json pins exactly these.
CDN_TO_PACKAGE = (
    ("https://unpkg.com/bootstrap-table@1.19.1/", "bootstrap-table/"),
    ("https://unpkg.com/bootstrap-table@1.19.0/", "bootstrap-table/"),  # one 0.4 kB stylesheet; 1.19.1's copy
    ("https://maxcdn.bootstrapcdn.com/bootstrap/4.3.1/", "bootstrap/dist/"),
    ("https://stackpath.bootstrapcdn.com/bootstrap/4.3.1/", "bootstrap/dist/"),
    ("https://code.jquery.com/jquery-3.7.1.min.js", "jquery/dist/jquery.min.js"),
    ("https://cdnjs.cloudflare.com/ajax/libs/popper.js/1.12.9/", "popper.js/dist/"),
    ("https://cdnjs.cloudflare.com/ajax/libs/bootstrap-datepicker/1.9.0/", "bootstrap-datepicker/dist/"),
    ("https://cdnjs.cloudflare.com/ajax/libs/font-awesome/6.6.0/", "@fortawesome/fontawesome-free/"),
    ("https://cdn.jsdelivr.net/npm/@forevolve/bootstrap-dark@1.1.0/", "@forevolve/bootstrap-dark/"),
)
# Loaded by a stylesheet above (all.min.css: ../webfonts/*), so copied whole.
ASSET_DIRS = ("@fortawesome/fontawesome-free/webfonts/",)
# GX's logo (and a tracking query string) from its own web assets: its package ships the logo in static/images.
GX_WEB_ASSETS = "https://great-expectations-web-assets.s3.us-east-2.amazonaws.com/"
_VEGA = re.compile(r'<script src="https://cdn\.jsdelivr\.net/npm/vega[-a-z]*@\d+"></script>\s*')
_URL = re.compile(r"""(?P<q>["'])(?P<url>https://[^"'\s]+)(?P=q)""")
_SRI = re.compile(r"""\s+(?:integrity|crossorigin)=(["'])[^"']*\1""")  # file:// pages can't load CORS-mode scripts
_REMOTE_LOAD = re.compile(
    r"""<(?:script|link|img)\b[^>]*?\b(?:src|href)=["'](https?://[^"']+)|url\(["']?(https?://[^"')]+)"""
)
_STATIC = re.compile(r"""(["'(])(?:\./|(?:\.\./)+)?static/""")
_MARKER = ".localized"


def data_docs_assets_path() -> Path:
    """Where the npm packages (``node_modules``) are: ``PHOTON_DATA_DOCS_ASSETS``, else where ``make setup`` puts
    them, beside the venv."""
    configured = os.environ.get("PHOTON_DATA_DOCS_ASSETS")
    return Path(configured) if configured else Path(sys.prefix) / "share" / "photon-data-docs" / "node_modules"


def data_docs_assets() -> Path | None:
    """The installed npm packages, or None."""
    path = data_docs_assets_path()
    return path if (path / "bootstrap-table").is_dir() else None


def remote_loads(html: str) -> list[str]:
    """Every URL a page would fetch from the network (scripts, stylesheets, images, CSS url()); links don't count."""
    return [a or b for a, b in _REMOTE_LOAD.findall(html)]


def localize_data_docs(site: Path) -> list[str]:
    """Serve every asset of the site's pages from ``<site>/static/vendor``: copy the files from the installed npm
    packages, rewrite the pages GX wrote since the last call (all of them the first time; rewriting is idempotent).
    Returns the remote URLs still loaded by some page (logged as a warning: a GX upgrade that names new assets)."""
    assets = data_docs_assets()
    if assets is None:
        log.warning(
            "Data Docs assets are not installed in %s (`make setup` installs them with npm): the pages load their"
            " CSS and JavaScript from CDNs and render blank offline",
            data_docs_assets_path(),
        )
        return []
    vendor = site / "static" / "vendor"
    vendor.mkdir(parents=True, exist_ok=True)
    marker = vendor / _MARKER
    since = marker.stat().st_mtime_ns if marker.exists() else 0
    scanned = time.time_ns()  # a page written from now on (a concurrent run) is taken next time
    pages = [p for p in site.rglob("*.html") if p.stat().st_mtime_ns >= since]
    needed: set[str] = set()
    left: set[str] = set()
    for page in pages:
        html = page.read_text(encoding="utf-8")
        new = _localize_page(html, os.path.relpath(site / "static", page.parent), needed)
        left.update(remote_loads(new))
        if new != html:
            tmp = page.with_name(f".{page.name}.{os.getpid()}")
            tmp.write_text(new, encoding="utf-8")
            os.replace(tmp, page)
    for rel in sorted(needed) + [d + f.name for d in ASSET_DIRS for f in sorted((assets / d).glob("*"))]:
        src, dst = assets / rel, vendor / rel
        if not src.is_file():
            left.add(rel)
        elif not dst.is_file() or dst.stat().st_size != src.stat().st_size:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
    marker.touch()
    os.utime(marker, ns=(scanned, scanned))
    if left:
        log.warning("Data Docs still load these from the network or miss them: %s", ", ".join(sorted(left)))
    return sorted(left)


def _localize_page(html: str, static: str, needed: set[str]) -> str:
    html = _VEGA.sub("", html)

    def local(m: re.Match[str]) -> str:
        url = m["url"]
        if url.startswith(GX_WEB_ASSETS):
            return f"{m['q']}{static}/images/logo-long.png{m['q']}"
        for prefix, package in CDN_TO_PACKAGE:
            if url.startswith(prefix):
                rel = package + url[len(prefix) :]
                needed.add(rel)
                return f"{m['q']}{static}/vendor/{rel}{m['q']}"
        return m.group(0)

    html = _URL.sub(local, html)
    # GX's own relative links into static/ are one level short on validation pages (their favicon): point every one
    # at the site's static folder from this page.
    html = _STATIC.sub(lambda m: f"{m[1]}{static}/", html)
    return re.sub(r"<(?:script|link)\b[^>]*>", lambda m: _SRI.sub("", m.group(0)), html)
