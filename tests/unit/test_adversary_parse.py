"""Adversarial reproductions at unit level (parsing and the default adapter).

The parse paths held against every attack tried (see the report); what broke here is the vectorised default adapter:
on a valid Arrow list array whose null slot still spans values (legal in Arrow's format: a null slot's offsets are
unconstrained), ``pc.list_flatten`` skips the null slot's values but ``pc.list_parent_indices`` counts them, so the
two arrays it lines up differ in length and the adapter raises instead of following its rule (``ads or []``: a null
list shows no ad). Low severity: the joiner filters the found queries before calling the adapter, so today its input
has no null ``ads``; but the adapter is a public, pluggable function whose input is any RecordBatch of that schema.
Failed on 6180054; passes since dbb95bf (the adapter fills null lists with empty ones first): a regression test.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from photon.joiner.adapter import ADAPTED_SCHEMA, default_adapter
from photon.logs.parse import QUERY_FIELDS

ADS = QUERY_FIELDS.field("ads").type


def _rule(row: dict[str, Any]) -> dict[str, Any]:
    """The plain rule the adapter implements (the code before vectorising): the first ad with the clicked ad_id."""
    ad = next((a for a in row["ads"] or [] if a is not None and a["ad_id"] == row["ad_id"]), None)
    out = {k: v for k, v in row.items() if k != "ads"}
    return out | {
        "advertiser_id": ad["advertiser_id"] if ad else None,
        "bid_micros": ad["bid_micros"] if ad else None,
        "reason": None if ad else "clicked ad not shown with its query",
    }


def test_default_adapter_follows_its_rule_on_a_null_ads_slot_that_still_spans_values() -> None:
    """Attack: row 0's ``ads`` is null, but its slot's offsets (0 -> 1) still span one ad in the values (an ad with
    the clicked ad_id, which must NOT be used: the list is null). Row 1 is an ordinary query whose ad matches.
    The plain rule gives: row 0 filtered ("clicked ad not shown"), row 1 joined with advertiser "B".

    What happens: ``default_adapter`` raises ``ArrowInvalid: Array arguments must all be the same length`` at
    adapter.py line 31 (``pc.list_flatten`` drops the null slot's value, ``pc.list_parent_indices`` keeps it); in
    the joiner, a raising adapter sends every click of the partition's batch to ``unjoinable/``."""
    values = pa.array(
        [
            {"ad_id": "a1", "advertiser_id": "HIDDEN", "bid_micros": 1},
            {"ad_id": "a1", "advertiser_id": "B", "bid_micros": 2},
        ],
        ADS.value_type,
    )
    ads = pa.ListArray.from_arrays(pa.array([0, 1, 2], pa.int32()), values, mask=pa.array([True, False]))
    assert ads.to_pylist()[0] is None  # a valid array: row 0 is a null list
    n = 2
    batch = pa.RecordBatch.from_pydict(
        {
            "click_id": ["c0", "c1"],
            "click_ts_us": [1, 2],
            "query_id": ["q0", "q1"],
            "ad_id": ["a1"] * n,
            "query_ts_us": [1, 2],
            "user_id": ["u"] * n,
            "query_text": ["t"] * n,
            "country": ["DE"] * n,
            "ads": ads,
        }
    )
    expected = [{f.name: _rule(r)[f.name] for f in ADAPTED_SCHEMA} for r in batch.to_pylist()]
    assert [r["advertiser_id"] for r in expected] == [None, "B"]
    assert default_adapter(batch).to_pylist() == expected
