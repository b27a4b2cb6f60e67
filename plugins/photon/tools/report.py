"""`photon report`: PNG charts from the metrics tables, like the Photon paper's figures.

- ``latency.png``: click latency p50/p90/p99 per batch over time, per pipeline (``photon.batch_metrics``); on a
  log axis when a few batches are so late (a live pipeline joining days-old history, say) that a linear one would
  flatten every other batch against zero;
- ``shares.png``: each pipeline's share of the joins over time, in 10-second bins: when one pipeline is down, the
  other takes over;
- ``registry_batching.png``: registry rows per transaction per batch (the server-side batching Photon relies on);
- ``shard_sizes.png``: rows per shard over time (``photon.shard_history``, recorded by GC runs and samples).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from photon.pg import autocommit
from photon.tools.status import handover_gaps

US = 1_000_000
BIN_S = 10
# The latency axis turns logarithmic when some value is more than this many times the median of the values drawn, and
# beyond FAR_S: a linear axis would then press most batches into its bottom twentieth. Ten minutes is past any live
# batch's latency (the maximum join delay is two), so an ordinary chart stays linear.
LOG_AXIS_RATIO = 20.0
FAR_S = 600.0


@dataclass
class ReportResult:
    written: list[Path] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # chart -> why it was not drawn (no data)
    pipelines: list[str] = field(default_factory=list)
    # pipeline -> batches, clicks, joined, wasted_share (of clicks read) and the lease hand-over gaps in the range
    per_pipeline: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)  # chart -> what a reader should know (its axis's scale)


def _metrics(main: str, pipelines: Sequence[str] | None, since_us: int | None) -> dict[str, dict[str, np.ndarray]]:
    with autocommit(main, guard=False) as conn, conn.cursor() as cur:  # read-only
        cur.execute(
            "SELECT pipeline, started_at_us, duration_s, joined, registry_rows, registry_txns,"
            " coalesce(latency_p50_s, 'NaN'), coalesce(latency_p90_s, 'NaN'), coalesce(latency_p99_s, 'NaN')"
            " FROM photon.batch_metrics WHERE (%s::text[] IS NULL OR pipeline = ANY(%s::text[]))"
            " AND started_at_us >= %s ORDER BY started_at_us",
            (list(pipelines) if pipelines is not None else None,) * 2 + (since_us or 0,),
        )
        rows = cur.fetchall()
    out: dict[str, dict[str, np.ndarray]] = {}
    for p in sorted({r[0] for r in rows}):
        mine = np.array([r[1:] for r in rows if r[0] == p], dtype=np.float64)
        out[p] = {
            "t": mine[:, 0] / US,
            "duration": mine[:, 1],
            "joined": mine[:, 2],
            "rows": mine[:, 3],
            "txns": mine[:, 4],
            "p50": mine[:, 5],
            "p90": mine[:, 6],
            "p99": mine[:, 7],
        }
    return out


def live_pipelines(main: str) -> list[str]:
    """Every pipeline but the backfills (whose latency is hours by nature and would flatten the chart)."""
    with autocommit(main, guard=False) as conn, conn.cursor() as cur:  # read-only
        cur.execute("SELECT pipeline FROM photon.pipelines WHERE pipeline NOT LIKE 'backfill-%' ORDER BY 1")
        return [r[0] for r in cur.fetchall()]


def render_report(
    main: str, to: Path, *, pipelines: Sequence[str] | None = None, since_us: int | None = None
) -> ReportResult:
    """Draw the charts of ``pipelines`` (default: all) since ``since_us`` (default: all time) from the registry's
    main server into ``to``. A chart without data is not drawn; ``skipped`` says why."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    to.mkdir(parents=True, exist_ok=True)
    m = _metrics(main, pipelines, since_us)
    result = ReportResult(pipelines=sorted(m))
    with autocommit(main, guard=False) as conn, conn.cursor() as cur:  # read-only
        for p in result.pipelines:
            cur.execute(
                "SELECT count(*), sum(clicks), sum(joined), sum(wasted) FROM photon.batch_metrics"
                " WHERE pipeline = %s AND started_at_us >= %s",
                (p, since_us or 0),
            )
            n, clicks, joined, wasted = (int(v or 0) for v in cur.fetchone())
            result.per_pipeline[p] = {
                "batches": n,
                "clicks": clicks,
                "joined": joined,
                "wasted_share": wasted / clicks if clicks else 0.0,
                "handover_gaps_s": handover_gaps(cur, p, since_us or 0),
            }
    t0 = min((float(v["t"].min()) for v in m.values() if len(v["t"])), default=0.0)
    written = result.written

    def skip(name: str, why: str) -> None:
        result.skipped[name] = why
        (to / name).unlink(missing_ok=True)  # never leave an older run's chart beside this run's

    if not any((~np.isnan(v["p90"])).any() for v in m.values()):
        skip("latency.png", "no batch with joined clicks in the range")
    else:
        result.notes["latency.png"] = _latency(plt, m, t0, to, written)
    if not any(v["joined"].sum() > 0 for v in m.values()):
        skip("shares.png", "no joins in the range")
    else:
        _shares(plt, m, t0, to, written)
    if not any((v["txns"] > 0).any() for v in m.values()):
        skip("registry_batching.png", "no registry transactions in the range")
    else:
        _batching(plt, m, t0, to, written)

    with autocommit(main, guard=False) as conn, conn.cursor() as cur:  # read-only
        cur.execute(
            "SELECT at_us, config_version, shard_no, rows, event FROM photon.shard_history WHERE at_us >= %s"
            " ORDER BY at_us, 2, 3",
            (since_us or 0,),
        )
        hist = cur.fetchall()
    if not hist:
        skip("shard_sizes.png", "no shard sizes recorded in the range (GC runs record them)")
        return result
    t0 = t0 or hist[0][0] / US
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for key in sorted({(v, s) for _, v, s, _, _ in hist}):
        pts = [(a, r) for a, v, s, r, _ in hist if (v, s) == key]
        ax.plot([(a / US) - t0 for a, _ in pts], [r for _, r in pts], "-o", ms=3, label=f"c{key[0]}/s{key[1]}")
    for a in sorted({a for a, _, _, _, e in hist if e == "gc"}):
        ax.axvline(a / US - t0, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="seconds since the first batch (dashed: GC runs)", ylabel="rows", title="Registry rows per shard")
    ax.legend(ncol=4, fontsize=8)
    ax.grid(alpha=0.3)
    written.append(_save(fig, to / "shard_sizes.png"))
    return result


def far_out(values: np.ndarray) -> int:
    """How many of ``values`` lie beyond ``LOG_AXIS_RATIO`` times their median and beyond ``FAR_S``. Any such value
    makes the latency axis logarithmic."""
    values = values[~np.isnan(values)]
    if not len(values):
        return 0
    limit = max(LOG_AXIS_RATIO * float(np.median(np.abs(values))), FAR_S)
    return int((values > limit).sum())


def _duration(s: float) -> str:
    return f"{s:,.0f} s" if s < 7_200 else f"{s / 3_600:,.1f} h" if s < 172_800 else f"{s / 86_400:,.1f} days"


def _latency(plt: Any, m: dict[str, dict[str, np.ndarray]], t0: float, to: Path, written: list[Path]) -> str:
    """Draw the chart; what its axis is, in a few words."""
    fig, ax = plt.subplots(figsize=(9, 4.5))
    drawn = []
    for p, v in m.items():
        ok = ~np.isnan(v["p90"])
        for q, style in (("p50", ":"), ("p90", "-"), ("p99", "--")):
            # A marker on every batch: a pipeline with one batch (a short backfill) is a point, not an empty line.
            ax.plot(v["t"][ok] - t0, v[q][ok], style, marker=".", ms=4, label=f"{p} {q}")
            drawn.append(v[q][ok])
    values = np.concatenate(drawn)
    title, note = "Click latency per batch", "linear axis"
    if far := far_out(values):
        # Symmetric log: linear within 1 s of zero, so that a latency below zero (a click stamped ahead, within the
        # clock skew) is still drawn; logarithmic beyond.
        ax.set_yscale("symlog", linthresh=1.0)
        top = _duration(float(np.nanmax(values)))
        note = f"log axis: {far} of {len(values)} latencies far above the rest, up to {top}"
        title += f" (log axis: up to {top})"
    ax.set(xlabel="seconds since the first batch", ylabel="click latency, s", title=title)
    ax.legend(ncol=2, fontsize=8)
    ax.grid(alpha=0.3)
    written.append(_save(fig, to / "latency.png"))
    return note


def _shares(plt: Any, m: dict[str, dict[str, np.ndarray]], t0: float, to: Path, written: list[Path]) -> None:
    fig, ax = plt.subplots(figsize=(9, 4.5))
    end = max((float(v["t"].max()) for v in m.values() if len(v["t"])), default=t0) - t0
    edges = np.arange(0, end + 2 * BIN_S, BIN_S)
    counts = {p: np.histogram(v["t"] - t0, bins=edges, weights=v["joined"])[0] for p, v in m.items()}
    total = np.maximum(sum(counts.values(), np.zeros(len(edges) - 1)), 1)
    bottom = np.zeros(len(edges) - 1)
    for p, c in counts.items():
        ax.bar(edges[:-1], c / total * 100, width=BIN_S, bottom=bottom, align="edge", label=p)
        bottom += c / total * 100
    ax.set(
        xlabel="seconds since the first batch",
        ylabel="share of joins, %",
        title=f"Each pipeline's share of the joins ({BIN_S} s bins)",
    )
    ax.legend()
    written.append(_save(fig, to / "shares.png"))


def _batching(plt: Any, m: dict[str, dict[str, np.ndarray]], t0: float, to: Path, written: list[Path]) -> None:
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for p, v in m.items():
        ok = v["txns"] > 0
        ax.plot(v["t"][ok] - t0, v["rows"][ok] / v["txns"][ok], ".", label=p)
    ax.set(
        xlabel="seconds since the first batch",
        ylabel="rows per registry transaction",
        title="Registry batching: rows per transaction",
        yscale="log",
    )
    ax.legend()
    ax.grid(alpha=0.3)
    written.append(_save(fig, to / "registry_batching.png"))


def _save(fig: object, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()  # type: ignore[attr-defined]
    fig.savefig(path, dpi=110)  # type: ignore[attr-defined]
    plt.close(fig)  # type: ignore[arg-type]
    return path
