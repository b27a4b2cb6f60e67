"""Adapters: how a query's fields are merged into its click (Photon's adapter). Pluggable: any function
``(pa.RecordBatch) -> pa.RecordBatch`` named as ``module:function``. Its input has the click's columns
(click_id, click_ts_us, query_id, ad_id) and the query's (query_ts_us, user_id, query_text, country, ads); its output
has the joined row's columns (schemas.JOINED_SCHEMA without pipeline and joined_at_us) plus ``reason``: null to keep
the row, or why it was filtered (the click then goes to unjoinable/ with that reason)."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import pyarrow as pa

from photon.schemas import JOINED_SCHEMA

Adapter = Callable[[pa.RecordBatch], pa.RecordBatch]
ADAPTED_SCHEMA = pa.schema(
    [f for f in JOINED_SCHEMA if f.name not in ("pipeline", "joined_at_us")] + [pa.field("reason", pa.string())]
)


def default_adapter(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Fill the joined row of EVENTS.md from the clicked ad; a click on an ad its query did not show is filtered."""
    cols = batch.to_pydict()
    advertiser, bid, reason = [], [], []
    for ad_id, ads in zip(cols["ad_id"], cols["ads"], strict=True):
        ad = next((a for a in ads or [] if a["ad_id"] == ad_id), None)
        advertiser.append(ad["advertiser_id"] if ad else None)
        bid.append(ad["bid_micros"] if ad else None)
        reason.append(None if ad else "clicked ad not shown with its query")
    return pa.RecordBatch.from_pydict(
        {
            "click_id": cols["click_id"],
            "query_id": cols["query_id"],
            "ad_id": cols["ad_id"],
            "click_ts_us": cols["click_ts_us"],
            "query_ts_us": cols["query_ts_us"],
            "user_id": cols["user_id"],
            "query_text": cols["query_text"],
            "country": cols["country"],
            "advertiser_id": advertiser,
            "bid_micros": bid,
            "reason": reason,
        },
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
