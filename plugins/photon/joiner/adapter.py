"""Adapters: how a query's fields are merged into its click (Photon's adapter). Pluggable: any function
``(pa.RecordBatch) -> pa.RecordBatch`` named as ``module:function``. Its input has the click's columns
(click_id, click_ts_us, query_id, ad_id) and the query's (query_ts_us, user_id, query_text, country, ads); its output
has the joined row's columns (schemas.JOINED_SCHEMA without pipeline and joined_at_us) plus ``reason``: null to keep
the row, or why it was filtered (the click then goes to unjoinable/ with that reason)."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from photon.logs.schemas import JOINED_SCHEMA

Adapter = Callable[[pa.RecordBatch], pa.RecordBatch]
ADAPTED_SCHEMA = pa.schema(
    [f for f in JOINED_SCHEMA if f.name not in ("pipeline", "joined_at_us")] + [pa.field("reason", pa.string())]
)


def default_adapter(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Fill the joined row of EVENTS.md from the clicked ad (the first of its query's ads with the clicked ad_id); a
    click on an ad its query did not show is filtered. Vectorised: the query's columns pass through untouched."""
    n = batch.num_rows
    # A null list shows no ad. Filled with empty lists first: a null slot may still span child values in Arrow's
    # format, which list_flatten skips and list_parent_indices counts.
    ads = pc.fill_null(batch.column("ads"), pa.scalar([], batch.schema.field("ads").type))
    flat = pc.list_flatten(ads)
    parents = pc.list_parent_indices(ads).to_numpy()
    match = pc.fill_null(pc.equal(pc.struct_field(flat, "ad_id"), batch.column("ad_id").take(pa.array(parents))), False)
    hits = np.flatnonzero(match.to_numpy(zero_copy_only=False))
    rows, first = np.unique(parents[hits], return_index=True)  # the first matching ad of each click
    pick = np.full(n, -1, np.int64)
    pick[rows] = hits[first]
    shown = pick >= 0
    at = pa.array(np.where(shown, pick, 0))
    null_unless_shown = pa.array(~shown)
    if len(flat):
        advertiser = pc.if_else(
            null_unless_shown, pa.scalar(None, pa.string()), pc.struct_field(flat, "advertiser_id").take(at)
        )
        bid = pc.if_else(null_unless_shown, pa.scalar(None, pa.int64()), pc.struct_field(flat, "bid_micros").take(at))
    else:
        advertiser, bid = pa.nulls(n, pa.string()), pa.nulls(n, pa.int64())
    reason = pc.if_else(null_unless_shown, "clicked ad not shown with its query", pa.scalar(None, pa.string()))
    return pa.RecordBatch.from_arrays(
        [
            *(batch.column(name) for name in ("click_id", "query_id", "ad_id", "click_ts_us", "query_ts_us")),
            *(batch.column(name) for name in ("user_id", "query_text", "country")),
            advertiser,
            bid,
            reason,
        ],
        schema=ADAPTED_SCHEMA,
    )


def load_adapter(path: str) -> Adapter:
    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"adapter {path!r}: expected module:function")
    fn = getattr(importlib.import_module(module), name, None)
    if not callable(fn):
        raise ValueError(f"adapter {path!r}: {name} is not a function of {module}")
    return fn
