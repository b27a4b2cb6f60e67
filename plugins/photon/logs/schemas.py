"""The output contract of EVENTS.md as Arrow schemas: the rows the joiner writes and readers (the auditor, data
quality checks, downstream jobs) may rely on. Each kind is a Delta table per pipeline, ``<out>/<pipeline>/<kind>``,
whose schema adds ``batch`` and the partition column ``hour`` to these (``photon.logs.tables``)."""

from __future__ import annotations

import pyarrow as pa

# The generator's ground truth lives beside the logs it describes: <logs>/_manifest/.
MANIFEST_DIR = "_manifest"

JOINED = "joined"
UNJOINABLE = "unjoinable"
QUARANTINE = "quarantine"
OUTPUT_KINDS = (JOINED, UNJOINABLE, QUARANTINE)

# A line longer than this is malformed ("a line of megabytes"); quarantine keeps at most RAW_CAP bytes of it.
MAX_LINE_BYTES = 1 << 20
RAW_CAP_BYTES = 4096

JOINED_SCHEMA = pa.schema(
    [
        ("click_id", pa.string()),
        ("query_id", pa.string()),
        ("ad_id", pa.string()),
        ("click_ts_us", pa.int64()),
        ("query_ts_us", pa.int64()),
        ("joined_at_us", pa.int64()),
        ("pipeline", pa.string()),
        ("user_id", pa.string()),
        ("query_text", pa.string()),
        ("country", pa.string()),
        ("advertiser_id", pa.string()),
        ("bid_micros", pa.int64()),
    ]
)

UNJOINABLE_SCHEMA = pa.schema(
    [
        ("click_id", pa.string()),
        ("query_id", pa.string()),
        ("ad_id", pa.string()),
        ("click_ts_us", pa.int64()),
        ("decided_at_us", pa.int64()),
        ("pipeline", pa.string()),
        ("reason", pa.string()),
    ]
)

QUARANTINE_SCHEMA = pa.schema(
    [
        ("pipeline", pa.string()),
        ("kind", pa.string()),  # queries or clicks
        ("file", pa.string()),  # file name inside <logs>/<dc>/<kind>/
        ("line", pa.int64()),  # 1-based line number
        ("raw", pa.binary()),  # the line's bytes, at most RAW_CAP_BYTES
        ("raw_bytes", pa.int64()),  # the line's full length
        ("reason", pa.string()),
        ("decided_at_us", pa.int64()),
    ]
)
