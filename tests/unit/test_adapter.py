"""The default adapter, vectorised, against the rule it implements written plainly: the first of the query's ads with
the clicked ad_id gives advertiser and bid; no such ad filters the click with a reason; every other column passes."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from photon.joiner.adapter import ADAPTED_SCHEMA, default_adapter
from photon.logs.parse import QUERY_FIELDS

ADS = QUERY_FIELDS.field("ads").type
AD_IDS = st.sampled_from(["a1", "a2", "a3", "ü", ""])
AD = st.fixed_dictionaries(
    {"ad_id": AD_IDS, "advertiser_id": st.text(min_size=1, max_size=3), "bid_micros": st.integers(-(2**63), 2**63 - 1)}
)
ROW = st.fixed_dictionaries(
    {
        "click_id": st.text(min_size=1, max_size=5),
        "click_ts_us": st.integers(0, 2**62),
        "query_id": st.text(min_size=1, max_size=5),
        "ad_id": AD_IDS,
        "query_ts_us": st.integers(0, 2**62),
        "user_id": st.text(min_size=1, max_size=3),
        "query_text": st.text(min_size=1, max_size=40),
        "country": st.text(min_size=1, max_size=2),
        "ads": st.lists(AD, min_size=1, max_size=5),
    }
)
INPUT = pa.schema(
    [
        ("click_id", pa.string()),
        ("click_ts_us", pa.int64()),
        ("query_id", pa.string()),
        ("ad_id", pa.string()),
        ("query_ts_us", pa.int64()),
        ("user_id", pa.string()),
        ("query_text", pa.string()),
        ("country", pa.string()),
        ("ads", ADS),
    ]
)


def by_the_rule(row: dict[str, Any]) -> dict[str, Any]:
    ad = next((a for a in row["ads"] if a["ad_id"] == row["ad_id"]), None)
    out = {k: v for k, v in row.items() if k != "ads"}
    return out | {
        "advertiser_id": ad["advertiser_id"] if ad else None,
        "bid_micros": ad["bid_micros"] if ad else None,
        "reason": None if ad else "clicked ad not shown with its query",
    }


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(ROW, max_size=30))
def test_the_default_adapter_follows_its_rule(rows: list[dict[str, Any]]) -> None:
    out = default_adapter(pa.RecordBatch.from_pylist(rows, schema=INPUT))
    assert out.schema == ADAPTED_SCHEMA
    assert out.to_pylist() == [{f.name: by_the_rule(r)[f.name] for f in ADAPTED_SCHEMA} for r in rows]
