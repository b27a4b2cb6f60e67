"""Data-quality checkpoint (Great Expectations 1.x): every expectation made to fail and made to pass on synthetic
output, a backfilled hour judged like a live one, the GX log kept short, and one run over generated logs."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, write_deltalake

from photon.logs import tables
from photon.logs.layout import partition_of
from photon.logs.parse import parse_file
from photon.logs.schemas import JOINED_SCHEMA
from photon.storage import open_store
from photon.tools.generator import GeneratorSettings, generate
from photon.tools.quality import NotSettled, QualityInputError, QualitySettings, check_quality
from tests.integration.audit_fixtures import perfect_output
from tests.integration.helpers import to_bucket

US = 1_000_000
HOUR = 3600 * US
START = 1_763_697_600 * US  # 2025-11-21 04:00 UTC: the interval under check
END = START + HOUR
BACKFILL = "backfill-dc-a-202511210400"  # as photon_backfill names the pipeline for this hour
LATE = 45 * HOUR  # a backfill run two days later
N = 1_000  # clicks of the hour, joined half by dc-a and half by dc-b; 10 more given up by both


def _click_id(ts: int) -> str:
    return f"10.9.8.7-88-{ts}"  # EVENTS.md: the id ends with the event's timestamp


class World:
    """One hour of output of two live pipelines (dc-a, dc-b) and the click logs their quarantine records name;
    a case edits the rows, then ``write`` commits them to the tables ``<out>/<pipeline>/{joined,unjoinable,quarantine}``
    (batch 1 of each pipeline) and lays out ``<logs>/<dc>/clicks/``."""

    def __init__(self) -> None:
        self.joined: list[dict[str, Any]] = []
        for i in range(N):
            ts = START + i * 3_600_000 + 1
            self.joined.append(self.row(ts, "dc-a" if i % 2 == 0 else "dc-b"))
        self.unjoinable: list[dict[str, Any]] = []
        for i in range(10):
            self.give_up(START + i * 300 * US + 7)
        # The click logs, in each replica's arrival partitions: every click above (the interval's input), in a file
        # per 10 minutes that arrives 1 s (dc-a) or 30 s (dc-b) after its last click, so dc-b's last file lands in
        # the next hour. Cases add files (``log_clicks``).
        self.logged: list[tuple[str, str, list[int]]] = []  # (dc, path under clicks/, click timestamps)
        clicks = sorted({r["click_ts_us"] for r in self.joined + self.unjoinable})
        for block in range(6):
            mine = [ts for ts in clicks if (ts - START) // (600 * US) == block]
            for dc, delay in (("dc-a", 1 * US), ("dc-b", 30 * US)):
                self.log_clicks(dc, mine, arrival=mine[-1] + delay, name=f"10.9.8.7-88-b{block}.jsonl")
        # Flat log files (the layout before partitions) by their first event's time, for quarantine records to name:
        # one per 10 minutes of this hour (whose valid line is a joined click), one in the hour before and after.
        self.files = {
            f"10.9.8.7-88-{k}.jsonl": self.joined[k * 167]["click_ts_us"] if 0 <= k < 6 else START + k * 600 * US + 5
            for k in range(-1, 7)
        }
        self.files["recovered-1763700000000000.jsonl"] = START + 60 * US
        self.quarantine: list[dict[str, Any]] = []
        self.quarantine_lines("10.9.8.7-88-1.jsonl", 5, ("dc-a", "dc-b"), decided_at=START + 11 * 60 * US)
        self.dc = {"dc-a": "dc-a", "dc-b": "dc-b", BACKFILL: "dc-a"}

    def log_clicks(self, dc: str, stamps: list[int], arrival: int, name: str) -> str:
        """A click file of well-formed clicks (and one malformed line) in ``dc``'s partition of ``arrival``."""
        rel = f"{partition_of(arrival)}/{name}"
        self.logged.append((dc, rel, stamps))
        return rel

    @staticmethod
    def row(ts: int, pipeline: str, latency_s: float = 2.0) -> dict[str, Any]:
        q = ts - 5 * US
        return {
            "click_id": _click_id(ts),
            "query_id": f"10.1.2.3-4711-{q}",
            "ad_id": "a1",
            "click_ts_us": ts,
            "query_ts_us": q,
            "joined_at_us": ts + int(latency_s * US),
            "pipeline": pipeline,
            "user_id": "u1",
            "query_text": "q",
            "country": "DE",
            "advertiser_id": "adv1",
            "bid_micros": 1,
        }

    def give_up(self, ts: int, pipelines: tuple[str, ...] = ("dc-a", "dc-b"), decided_at: int | None = None) -> None:
        for p in pipelines:
            self.unjoinable.append(
                {
                    "click_id": _click_id(ts),
                    "query_id": "10.1.2.3-4711-1",
                    "ad_id": "a1",
                    "click_ts_us": ts,
                    "decided_at_us": decided_at or ts + 120 * US,
                    "pipeline": p,
                    "reason": "query not found within the maximum join delay",
                }
            )

    def quarantine_lines(self, file: str, n: int, pipelines: tuple[str, ...], decided_at: int) -> None:
        for p in pipelines:
            for line in range(2, n + 2):
                self.quarantine.append(
                    {
                        "pipeline": p,
                        "kind": "clicks",
                        "file": file,
                        "line": line,
                        "raw": b'{"click_id": ',
                        "raw_bytes": 13,
                        "reason": "truncated",
                        "decided_at_us": decided_at,
                    }
                )

    def write(self, root: Path) -> tuple[Path, Path]:
        out, logs = root / "out", root / "logs"
        for p in ("dc-a", "dc-b"):  # the live pipelines' folders exist, output or not
            (out / p).mkdir(parents=True, exist_ok=True)
            (out / p / "_pipeline.json").write_text(json.dumps({"pipeline": p, "dc": p}))
        rows = {"joined": self.joined, "unjoinable": self.unjoinable, "quarantine": self.quarantine}
        # A row that lost its pipeline: dc-a wrote it.
        for p in sorted({r["pipeline"] for kind in rows.values() for r in kind if r["pipeline"] is not None}):
            mine = {k: [r for r in v if (r["pipeline"] or "dc-a") == p] for k, v in rows.items()}
            commit(out, p, mine, batch=1)
            (out / p / "_pipeline.json").write_text(json.dumps({"pipeline": p, "dc": self.dc[p]}))
        for dc in ("dc-a", "dc-b"):
            (logs / dc / "clicks").mkdir(parents=True)
            for name, first in self.files.items():
                line = {"click_id": _click_id(first), "ts_us": first, "query_id": "10.1.2.3-4711-1", "ad_id": "a1"}
                (logs / dc / "clicks" / name).write_text(json.dumps(line) + "\n" + '{"click_id": \n' * 3)
        for dc, rel, stamps in self.logged:
            path = logs / dc / "clicks" / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            lines = [json.dumps(click_line(ts)) for ts in stamps]
            path.write_text("\n".join([*lines, '{"click_id": ', *lines[:1]]) + "\n")  # a bad line, a re-sent one
        return out, logs


def commit(out: Path, pipeline: str, rows: dict[str, Any], batch: int) -> None:
    """Batch ``batch`` of ``pipeline``: ``rows`` (per kind) committed to its output tables as a joiner commits them
    (its tasks stage the data files, its driver commits them under its txn). A row without its time, which a task
    cannot place in an hour, is appended by deltalake to the table's null hour: a broken row the check must see."""
    root = out / pipeline
    stage = f"_staging/{pipeline}-{batch}"
    broken: dict[str, pa.Table] = {}
    for kind, found in rows.items():
        schema = tables.ROW_SCHEMAS[kind]
        table = (
            found.select(schema.names).cast(schema)
            if isinstance(found, pa.Table)
            else pa.Table.from_pylist(found, schema=schema)
        )
        timed = pc.is_valid(table[tables.TIME_COLUMN[kind]])
        tables.stage_rows(root, kind, stage, f"b{batch:010d}-e1-p0", table.filter(timed), batch)
        broken[kind] = table.filter(pc.invert(timed))
    tables.publish_batch(root, pipeline, batch, stage)
    shutil.rmtree(root / stage, ignore_errors=True)
    for kind, table in broken.items():
        if table.num_rows:
            table = table.append_column(tables.BATCH, pa.array([batch] * table.num_rows, pa.int64()))
            table = table.append_column(tables.PARTITION, pa.nulls(table.num_rows, pa.string()))
            write_deltalake(str(root / kind), table, mode="append", partition_by=[tables.PARTITION])


def click_line(ts: int) -> dict[str, Any]:
    return {"click_id": _click_id(ts), "ts_us": ts, "query_id": f"10.1.2.3-4711-{ts - 5 * US}", "ad_id": "a1"}


def check(world: World, tmp_path: Path, settings: QualitySettings | None = None) -> Any:
    out, logs = world.write(tmp_path)
    return check_quality(out, logs, START, END, settings)


# -- one case to fail and one to pass, for every expectation ---------------------------------------------------


def _duplicate(w: World) -> None:  # dc-b joined a click dc-a joined too
    w.joined.append({**w.joined[0], "pipeline": "dc-b"})


def _second_click_on_a_query(w: World) -> None:  # a new click id on the same query: not a duplicate
    w.joined.append({**w.joined[0], "click_id": _click_id(w.joined[0]["click_ts_us"] + 1), "pipeline": "dc-b"})


def _null(column: str, hours: int) -> Callable[[World], None]:
    """A row of this hour (``hours=0``) or of the next (1) with ``column`` missing: only this hour's must fail. A row
    without its click time is placed by the time in its click id (EVENTS.md), so that check can fail too."""

    def edit(w: World) -> None:
        ts = START + hours * HOUR + 17
        w.joined.append({**World.row(ts, "dc-a"), column: None})

    return edit


def _skew(seconds: float) -> Callable[[World], None]:  # a click stamped this long before its query
    def edit(w: World) -> None:
        w.joined[3]["query_ts_us"] = w.joined[3]["click_ts_us"] + int(seconds * US)

    return edit


def _slow(n: int, by: int = 61 * US) -> Callable[[World], None]:  # n clicks of live dc-a joined after the SLO
    def edit(w: World) -> None:
        for r in [r for r in w.joined if r["pipeline"] == "dc-a"][:n]:
            r["joined_at_us"] = r["click_ts_us"] + by

    return edit


def _fell_behind(w: World) -> None:
    """Live dc-a, joining since the hour before (a click of it joined on time), joined this hour 45 h late."""
    _slow(N, LATE)(w)
    w.joined.append(World.row(START - HOUR + 7, "dc-a"))


def _history_of_a_new_live_pipeline(w: World) -> None:
    """dc-a created 45 h later at the beginning of the logs (its first output then): this hour is history to it."""
    _slow(N, LATE)(w)


def _backfilled(w: World) -> None:
    """The whole hour joined, given up and quarantined by one backfill pipeline two days later."""
    for r in w.joined:
        r["pipeline"], r["joined_at_us"] = BACKFILL, r["click_ts_us"] + LATE + 2 * US
    for r in w.unjoinable:
        r["pipeline"], r["decided_at_us"] = BACKFILL, r["click_ts_us"] + LATE
    for r in w.quarantine:
        r["pipeline"], r["decided_at_us"] = BACKFILL, START + LATE


def _backfilled_with_bad_input(w: World) -> None:  # 100 malformed lines in the hour's files: 9.9% of decided clicks
    _backfilled(w)
    w.quarantine_lines("10.9.8.7-88-2.jsonl", 100, (BACKFILL,), decided_at=START + LATE)


def _bad_lines_of_the_hour_before(w: World) -> None:  # read during this hour, but the previous hour's input
    w.quarantine_lines("10.9.8.7-88--1.jsonl", 100, ("dc-a", "dc-b"), decided_at=START + 60 * US)


def _bad_lines_in_both_replicas(w: World) -> None:  # 40 lines, each quarantined by both pipelines: 4%, not 8%
    w.quarantine_lines("10.9.8.7-88-3.jsonl", 40, ("dc-a", "dc-b"), decided_at=START + 31 * 60 * US)


def _bad_lines_recovered(w: World) -> None:  # the verifier's copies are no new input
    w.quarantine_lines("recovered-1763700000000000.jsonl", 100, ("dc-a",), decided_at=START + 120 * US)


def _nothing_but_bad_lines(w: World) -> None:  # no click decided at all: 105 malformed lines fail the rate
    w.joined.clear()
    w.unjoinable.clear()
    w.quarantine_lines("10.9.8.7-88-2.jsonl", 100, ("dc-a",), decided_at=START + 60 * US)


def _tiny_hour(w: World) -> None:
    """The README's boundary hour: 4 clicks, 3 bad lines of its input (a quarantine rate of 0.75 over 7 lines)."""
    w.joined = w.joined[:4]
    w.unjoinable.clear()
    stamps = [r["click_ts_us"] for r in w.joined]
    w.logged = []
    w.log_clicks("dc-a", stamps, arrival=stamps[-1] + US, name="10.9.8.7-88-b0.jsonl")
    w.files = {"10.9.8.7-88-0.jsonl": stamps[0]}
    w.quarantine.clear()
    w.quarantine_lines("10.9.8.7-88-0.jsonl", 3, ("dc-a",), decided_at=START + 60 * US)


def _no_input(w: World) -> None:  # nothing in any replica: log shipping stopped (or never started)
    w.joined.clear()
    w.unjoinable.clear()
    w.quarantine.clear()
    w.logged = []
    w.files = {}


def _given_up(n: int, pipelines: tuple[str, ...]) -> Callable[[World], None]:
    def edit(w: World) -> None:
        for i in range(n):
            w.give_up(START + i * 20 * US + 11, pipelines)
            if pipelines == ("dc-a",):  # ... and joined by dc-b
                w.joined.append(World.row(START + i * 20 * US + 11, "dc-b"))

    return edit


UNIQUE = "joined: expect_column_values_to_be_unique(click_id)"
NOT_NULL = "joined: expect_column_values_to_not_be_null({})"
SKEW = "joined: expect_column_values_to_be_between(click_after_query_s)"
LATENCY = "joined: expect_column_values_to_be_between(live_latency_s)"
UNJOINABLE = "rates: expect_column_values_to_be_between(unjoinable_rate)"
QUARANTINE = "rates: expect_column_values_to_be_between(quarantine_rate)"
INPUT = "rates: expect_column_values_to_be_between(input_click_files)"
NO_OUTCOME = "completeness: expect_column_values_to_be_null(no_outcome)"
TWICE = "completeness: expect_column_values_to_be_null(joined_more_than_once)"
REQUIRED = ["click_id", "query_id", "ad_id", "click_ts_us", "query_ts_us", "joined_at_us", "pipeline"]
UNREAD = [START + 1_234 * US + k for k in range(7)]  # clicks of a file no pipeline read


def _file_never_read(w: World) -> None:  # dropped into dc-a's 04:20 partition after the joiner ran
    w.log_clicks("dc-a", UNREAD, arrival=START + 20 * 60 * US + 3 * US, name="10.9.8.7-88-late.jsonl")


def _file_never_read_next_hour(w: World) -> None:  # the same, in the next hour's partition: that hour's business
    w.log_clicks("dc-a", UNREAD, arrival=END + 3 * US, name="10.9.8.7-88-late.jsonl")


def _recovered_copy(w: World) -> None:  # the verifier's copy names clicks whose originals are in older files
    w.log_clicks("dc-a", UNREAD, arrival=START + 20 * 60 * US, name="recovered-1763698800000000.jsonl")


def _only_one_replica(w: World) -> None:  # dc-b never received the first file; dc-a's copy is enough
    w.logged = [f for f in w.logged if not (f[0] == "dc-b" and f[1].endswith("b0.jsonl"))]


def _joined_by_one_given_up_by_the_other(w: World) -> None:
    w.give_up(w.joined[0]["click_ts_us"], ("dc-b",))


def _no_output_at_all(w: World) -> None:  # the input is there, every pipeline's output for it is not
    w.joined.clear()
    w.unjoinable.clear()
    w.quarantine.clear()


CASES: list[Any] = [
    pytest.param(_duplicate, [UNIQUE, TWICE], id="unique-fails-on-a-click-joined-twice"),
    pytest.param(_second_click_on_a_query, [], id="unique-passes-two-clicks-of-one-query"),
    *(pytest.param(_null(c, 0), [NOT_NULL.format(c)], id=f"not-null-{c}-fails-in-this-hour") for c in REQUIRED),
    *(pytest.param(_null(c, 1), [], id=f"not-null-{c}-passes-a-row-of-the-next-hour") for c in REQUIRED),
    pytest.param(_null("user_id", 0), [], id="not-null-passes-an-optional-field-missing"),
    pytest.param(_skew(11), [SKEW], id="click-after-query-fails-11s-before"),
    pytest.param(_skew(9), [], id="click-after-query-passes-9s-before-within-the-skew"),
    pytest.param(_slow(20), [LATENCY], id="latency-fails-2pct-of-live-clicks-slow"),
    pytest.param(_slow(5), [], id="latency-passes-0.5pct-of-live-clicks-slow"),
    pytest.param(_fell_behind, [LATENCY], id="latency-fails-a-live-pipeline-45h-late"),
    pytest.param(_history_of_a_new_live_pipeline, [], id="latency-passes-history-joined-by-a-new-live-pipeline"),
    pytest.param(_backfilled, [], id="latency-passes-an-hour-backfilled-45h-later"),
    pytest.param(_given_up(70, ("dc-a", "dc-b")), [UNJOINABLE], id="unjoinable-fails-7pct"),
    pytest.param(_given_up(70, ("dc-a",)), [], id="unjoinable-passes-given-up-by-one-joined-by-the-other"),
    pytest.param(_backfilled_with_bad_input, [QUARANTINE], id="quarantine-fails-a-past-hour-of-bad-lines"),
    pytest.param(_bad_lines_of_the_hour_before, [], id="quarantine-passes-bad-lines-of-the-hour-before"),
    pytest.param(_bad_lines_in_both_replicas, [], id="quarantine-passes-a-line-counted-once-across-replicas"),
    pytest.param(_bad_lines_recovered, [], id="quarantine-passes-recovered-copies-not-counted"),
    pytest.param(
        _nothing_but_bad_lines, [QUARANTINE, NO_OUTCOME], id="quarantine-fails-bad-lines-and-no-click-decided"
    ),
    pytest.param(_tiny_hour, [], id="quarantine-passes-3-bad-lines-beside-4-clicks-not-judged"),
    pytest.param(_no_input, [INPUT], id="input-fails-an-hour-without-click-files"),
    pytest.param(_no_output_at_all, [NO_OUTCOME], id="completeness-fails-input-without-any-output"),
    pytest.param(_file_never_read, [NO_OUTCOME], id="completeness-fails-a-click-file-no-pipeline-read"),
    pytest.param(_file_never_read_next_hour, [], id="completeness-passes-a-file-of-the-next-hours-partition"),
    pytest.param(_recovered_copy, [], id="completeness-passes-recovered-copies-not-counted"),
    pytest.param(_only_one_replica, [], id="completeness-passes-a-file-in-one-replica-only"),
    pytest.param(_joined_by_one_given_up_by_the_other, [], id="completeness-passes-joined-once-given-up-elsewhere"),
]


@pytest.mark.parametrize(("edit", "fails"), CASES)
def test_expectation(edit: Callable[[World], None], fails: list[str], tmp_path: Path) -> None:
    w = World()
    edit(w)
    r = check(w, tmp_path)
    assert sorted(r.failed) == sorted(fails), r.details
    assert r.success == (not fails)
    assert len(r.details) == len(fails)


def test_every_expectation_has_a_case() -> None:
    """The cases above cover the whole checkpoint: a new expectation needs its own pair."""
    import great_expectations as gx

    from photon.tools.quality import _suites

    suites = _suites(gx, QualitySettings())
    names = {
        f"{batch}: {e.expectation_type}({e.column})" for batch, suite in suites.items() for e in suite.expectations
    }
    covered = {f for case in CASES for f in case.values[1]}
    assert names == covered


def test_backfilled_hour_counts(tmp_path: Path) -> None:
    """What the summary says of a backfilled hour: 100 lines quarantined two days later count for their hour (the
    decision-time filter counted 0), the rows are backfilled (no latency judged), the failure names the rate."""
    w = World()
    _backfilled_with_bad_input(w)
    r = check(w, tmp_path)
    assert (r.joined, r.unjoinable, r.quarantined, r.backfilled) == (N, 10, 105, N)
    assert r.details == [f"{QUARANTINE}: observed {round(105 / (N + 10), 4)}"]
    assert r.statistics["joined"]["unsuccessful_expectations"] == 0


def test_history_joined_by_a_new_live_pipeline_is_counted_not_judged(tmp_path: Path) -> None:
    """A live pipeline started at the beginning of the logs (`photon join`'s default) 45 h after this hour: its click
    files arrived long before its first output, so its latency measures the history's age; its rows are counted as
    history and not judged. Was: FAIL on live_latency_s, 100% of dc-a's rows at 162,000 s."""
    w = World()
    _history_of_a_new_live_pipeline(w)
    r = check(w, tmp_path)
    assert r.success, r.details
    assert (r.history, r.backfilled) == (N // 2, 0)


def test_history_whose_file_arrived_in_the_next_hour_is_history_too(tmp_path: Path) -> None:
    """Clicks stamped in the hour's last seconds whose file landed in the next hour's partition are that hour's input,
    not this one's, so their arrival was unknown here and they were judged live: on the README's own path (history
    joined by new live pipelines, then this check) 104 such rows at 9,595 s failed the hour. Their arrival is read
    from the partitions that land before the hour settles."""
    w = World()
    _history_of_a_new_live_pipeline(w)
    stamps = [END - 3 * US + i for i in range(3)]
    w.joined += [World.row(ts, "dc-a", latency_s=LATE / US) for ts in stamps]
    w.log_clicks("dc-a", stamps, arrival=END + 20 * US, name="10.9.8.7-88-next.jsonl")
    r = check(w, tmp_path)
    assert r.success, r.details
    assert (r.joined, r.history, r.backfilled) == (N + 3, N // 2 + 3, 0), r.details


def test_a_failure_says_what_its_share_is_of(tmp_path: Path) -> None:
    """An hour mostly backfilled, 8 clicks joined live and all of them late: the latency expectation judges only the
    8 live rows (the others' live latency is null). Was: 'unexpected 8 of 1,000 (100.00%)', a share of 8 given
    beside 1,000."""
    w = World()
    _backfilled(w)
    live = w.joined[:8]
    for r in live:
        r["pipeline"], r["joined_at_us"] = "dc-a", r["click_ts_us"] + 3_600 * US
    w.joined.append(World.row(START - HOUR + 7, "dc-a"))  # dc-a has joined since the hour before: live, and late
    r = check(w, tmp_path)
    assert r.failed == [LATENCY]
    assert r.details == [
        f"{LATENCY}: unexpected 8 of the 8 non-null values (100.00%; 992 of 1,000 rows null, not judged), e.g."
        " [3600.0, 3600.0, 3600.0]"
    ]


def test_unattributed_quarantine_is_reported_not_counted(tmp_path: Path) -> None:
    w = World()
    w.quarantine_lines("10.9.8.7-88-gone.jsonl", 100, ("dc-a",), decided_at=START + 60 * US)
    r = check(w, tmp_path)
    assert r.success, r.details
    assert (r.quarantined, r.quarantine_unattributed) == (5, 100)


def test_gx_log_keeps_to_one_line_per_failed_expectation(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    w = World()
    _duplicate(w)
    _skew(11)(w)
    caplog.set_level(logging.DEBUG)
    r = check(w, tmp_path)
    assert sorted(r.failed) == sorted([UNIQUE, SKEW, TWICE])
    gx_records = [rec for rec in caplog.records if rec.name.startswith("great_expectations")]
    assert [rec for rec in gx_records if rec.levelno < logging.WARNING] == []
    mine = [rec.getMessage() for rec in caplog.records if rec.name == "photon.tools.quality"]
    assert len(mine) == 4, mine  # the verdict, then one line per failed expectation
    assert "FAIL, 3 expectation(s)" in mine[0]
    assert "1010 input clicks in 23 click files, 0 without outcome, 1 joined more than once" in mine[0]
    assert "expect_column_values_to_be_unique(click_id): unexpected 2 of 1,001 rows" in "".join(mine[1:])
    assert f"(joined_more_than_once): unexpected 1 of 1,010 rows (0.10%), e.g. ['{w.joined[0]['click_id']}']" in mine[3]
    captured = capfd.readouterr()
    assert "Calculating Metrics" not in captured.err + captured.out  # GX's progress bars are off


def test_an_interval_without_input_fails_unless_accepted(tmp_path: Path) -> None:
    """No click file in any replica is what stopped log shipping looks like: it fails, saying so. Was: PASS."""
    out, logs = World().write(tmp_path)
    r = check_quality(out, logs, END + HOUR, END + 2 * HOUR)
    assert not r.success and r.failed == [INPUT] and r.input_files == 0
    assert "observed 0.0 click files in any replica, where input is expected" in r.details[0], r.details
    accepted = check_quality(out, logs, END + HOUR, END + 2 * HOUR, QualitySettings(allow_empty=True))
    assert accepted.success and accepted.joined == 0 and accepted.quarantined == 0 and accepted.input_clicks == 0


def test_rates_over_a_tiny_denominator_are_reported_not_judged(tmp_path: Path) -> None:
    """The boundary hour: 3 bad lines beside 4 clicks is a rate of 0.75, reported; judged only from
    ``min_rate_denominator`` lines on (here lowered to 7, and it fails). Was: FAIL on quarantine_rate 0.75."""
    w = World()
    _tiny_hour(w)
    r = check(w, tmp_path)
    assert r.success, r.details
    assert (r.quarantine_rate, r.rates_not_judged) == (0.75, ["unjoinable_rate", "quarantine_rate"])
    judged = check_quality(tmp_path / "out", tmp_path / "logs", START, END, QualitySettings(min_rate_denominator=4))
    assert judged.failed == [QUARANTINE] and judged.rates_not_judged == [], judged.details


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    logs = tmp_path_factory.mktemp("logs")
    start = START + 600 * US
    generate(GeneratorSettings(events_per_s=2_000), logs, start_us=start, end_us=start + 20 * US)
    truth = tmp_path_factory.mktemp("truth")
    perfect_output(logs, truth)
    out = tmp_path_factory.mktemp("perfect")
    now = int(time.time() * US)  # the fixture leaves decision times at 0; a joiner stamps its batch's time
    for folder in sorted(p for p in truth.iterdir() if p.is_dir()):  # the fixture's rows, committed as one batch
        rows = {kind: pq.read_table(folder / kind, columns=tables.ROW_SCHEMAS[kind].names) for kind in KINDS}
        rows["quarantine"] = rows["quarantine"].set_column(
            7, "decided_at_us", pa.array([now] * rows["quarantine"].num_rows, pa.int64())
        )
        commit(out, folder.name, rows, batch=1)
    return out, logs


KINDS = ("joined", "unjoinable", "quarantine")


def test_generated_logs_and_their_correct_output_pass(generated: tuple[Path, Path]) -> None:
    out, logs = generated
    t0 = time.monotonic()
    r = check_quality(out, logs, START, END, QualitySettings(max_unjoinable_rate=0.2))
    seconds = time.monotonic() - t0
    assert r.success, r.details
    assert r.joined > 1_000 and r.unjoinable > 0
    files = pq.read_table(logs / "_manifest" / "files.parquet")
    one_replica = files.filter(pc.equal(files["dc"], "dc-a"))
    assert r.quarantined == pc.sum(one_replica["malformed"]).as_py() > 0  # every malformed line, once
    assert r.statistics["joined"]["evaluated_expectations"] == 10
    clicks = pq.read_table(logs / "_manifest" / "clicks.parquet", columns=["click_id"])
    assert (r.input_clicks, r.no_outcome, r.joined_more_than_once) == (clicks.num_rows, 0, 0)  # read by our parser
    index = Path(r.docs_index)
    assert index.is_file() and "photon_joined" in index.read_text()
    print(f"GX checkpoint for one interval, {r.joined} joined rows: {seconds:.2f} s")


# -- completeness ---------------------------------------------------------------------------------------------------


def test_completeness_counts_and_names_the_clicks_no_pipeline_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    w = World()
    _file_never_read(w)
    caplog.set_level(logging.INFO, logger="photon.tools.quality")
    r = check(w, tmp_path)
    assert not r.success
    assert (r.input_clicks, r.no_outcome, r.joined_more_than_once) == (N + 10 + 7, 7, 0)
    assert r.samples["no_outcome"] == sorted(_click_id(ts) for ts in UNREAD)[:5]
    assert r.details == [
        f"{NO_OUTCOME}: unexpected 7 of 1,017 rows (0.69%), e.g. {[_click_id(ts) for ts in UNREAD[:3]]}"
    ]
    assert any(NO_OUTCOME in rec.getMessage() and _click_id(UNREAD[0]) in rec.getMessage() for rec in caplog.records)
    page = next((tmp_path / "out" / "_quality" / "data_docs" / "validations").rglob("*.html")).parent.parent
    pages = "".join(p.read_text() for p in page.parent.rglob("*.html"))
    assert "no_outcome" in pages and _click_id(UNREAD[0]) in pages  # Data Docs show the ids too


def test_completeness_reads_the_tables_as_they_are_now(tmp_path: Path) -> None:
    """Each check reads the tables' current snapshots: rows deleted from dc-b's joined table since the last check (a
    Delta delete: their data files stay on disk until vacuumed, no longer named by the table) have no outcome."""
    out, logs = World().write(tmp_path)
    first = check_quality(out, logs, START, END)
    assert first.success, first.details
    assert (first.input_clicks, first.output_files_read) == (N + 10, 4)
    DeltaTable(str(out / "dc-b" / "joined")).delete()
    assert list((out / "dc-b" / "joined").glob("hour=*/*.parquet"))  # still there, in no snapshot
    r = check_quality(out, logs, START, END)
    assert not r.success and r.failed == [NO_OUTCOME]
    assert r.no_outcome == N // 2  # dc-b's half
    assert r.samples["no_outcome"] == sorted(_click_id(START + i * 3_600_000 + 1) for i in range(1, N, 2))[:5]


def test_data_files_no_commit_names_are_never_counted(tmp_path: Path) -> None:
    """A data file in a table's folder that no commit names is no output: a crashed batch's (its tasks staged it, its
    registry commit never came), or a copy under a new name. Data quality reads the tables' snapshots, so dc-a's
    committed joined file copied beside it is no click joined twice, and a crashed batch of dc-b holding the 7 clicks
    no pipeline committed gives them no outcome. A reader that globs the folders reports 1,000 clicks joined twice
    and 7 fewer without outcome."""
    w = World()
    _file_never_read(w)
    out, logs = w.write(tmp_path)
    (committed,) = (out / "dc-a" / "joined").glob("hour=*/*.parquet")
    shutil.copy(committed, committed.with_name("b0000000002-e1-p0-copy.parquet"))
    crashed = pa.Table.from_pylist([World.row(ts, "dc-b") for ts in UNREAD], schema=JOINED_SCHEMA)
    assert tables.stage_rows(out / "dc-b", "joined", "_staging/crashed", "b0000000002-e1-p0", crashed, 2)
    r = check_quality(out, logs, START, END)
    assert r.failed == [NO_OUTCOME], r.details
    assert (r.joined, r.joined_more_than_once, r.no_outcome) == (N, 0, len(UNREAD))
    assert r.samples["no_outcome"] == sorted(_click_id(ts) for ts in UNREAD)[:5]
    assert (r.output_files, r.output_files_read) == (4, 4)


def test_a_committed_data_file_gone_is_an_error_not_an_hour_judged(tmp_path: Path) -> None:
    """A data file a commit names, deleted by hand (not by a Delta delete and a vacuum): the table is broken and the
    hour cannot be judged. One line naming the table, not half of dc-b's clicks reported without outcome."""
    out, logs = World().write(tmp_path)
    (committed,) = (out / "dc-b" / "joined").glob("hour=*/*.parquet")
    committed.unlink()
    with pytest.raises(QualityInputError, match=re.escape(f"output table {out / 'dc-b' / 'joined'} is unreadable")):
        check_quality(out, logs, START, END)


def test_completeness_reads_only_output_files_that_can_hold_the_intervals_clicks(tmp_path: Path) -> None:
    """A data file of other hours (its hour partition and its click-time statistics hold no input click) is never
    opened; one of this hour is, and a second joined copy there fails the hour."""
    w = World()
    out, logs = w.write(tmp_path)
    old = [World.row(START - 2 * HOUR + i, "dc-a") for i in range(100)]  # an older hour, in its own file
    commit(out, "dc-a", {"joined": old}, batch=2)
    commit(out, "dc-b", {"joined": old}, batch=2)  # the older hour joined twice: not ours
    r = check_quality(out, logs, START, END)
    assert r.success, r.details
    assert (r.output_files, r.output_files_read) == (6, 4)  # batch 1's of each pipeline and kind, not the old hour's
    commit(out, "dc-a", {"joined": [{**w.joined[1], "pipeline": "dc-a"}]}, batch=3)  # dc-b's click, joined by dc-a too
    r = check_quality(out, logs, START, END)
    assert sorted(r.failed) == sorted([UNIQUE, TWICE])
    assert (r.joined_more_than_once, r.samples["joined_more_than_once"]) == (1, [w.joined[1]["click_id"]])
    assert (r.output_files, r.output_files_read) == (7, 5)


def test_quarantine_reads_only_files_decided_since_the_interval_could_begin(tmp_path: Path) -> None:
    """A pipeline's quarantine table holds a file per batch with bad lines: a month of them by the time an hour is
    checked. Only the hour partitions from the one the interval's files could arrive in on are read (and of those the
    files whose decided_at_us statistics reach it); an old one is in the snapshot, not read (it was: every check read
    the whole history). A file committed later with lines of this hour's input still counts."""
    w = World()
    out, logs = w.write(tmp_path)
    old = [{**r, "decided_at_us": START - 2 * 24 * HOUR} for r in w.quarantine if r["pipeline"] == "dc-a"]
    for k in range(20):  # two days before: other hours' bad lines (their files are those of this test's World)
        commit(out, "dc-a", {"quarantine": old}, batch=2 + k)
    r = check_quality(out, logs, START, END)
    assert r.success and r.quarantined == 5, r.details
    assert (r.quarantine_files, r.quarantine_files_read) == (22, 2)  # batch 1's of dc-a and dc-b
    late = [{**r, "line": r["line"] + 100, "decided_at_us": START + 30 * 60 * US} for r in w.quarantine[:3]]
    commit(out, "dc-a", {"quarantine": late}, batch=22)
    r = check_quality(out, logs, START, END)
    assert r.quarantined == 8 and (r.quarantine_files, r.quarantine_files_read) == (23, 3), r


def test_an_unsettled_interval_neither_passes_nor_fails(tmp_path: Path) -> None:
    """Before its partitions are sealed and its last clicks' deadlines have passed, a click may still wait in a
    retry set: the check refuses to judge (clear error), and judges once settled."""
    w = World()
    _no_output_at_all(w)
    out, logs = w.write(tmp_path)
    s = QualitySettings()
    settled = s.settled_at_us(END)
    assert settled == END + (60 + 120 + 120) * US
    with pytest.raises(NotSettled, match="settles at 2025-11-21 05:05:00"):
        check_quality(out, logs, START, END, s, now_us=settled - 1)
    assert not (out / "_quality").exists()  # nothing judged, nothing reported
    r = check_quality(out, logs, START, END, s, now_us=settled)
    assert not r.success and r.no_outcome == N + 10
    # The seal follows the configured skew (2 x skew + 40 s): with a 300 s skew a writer's file may land in the
    # hour's last partition until 640 s after it ends, so no judgement before that plus the join delay and margin
    # (on the old code the settle time kept the default skew's 60 s seal: the hour was judged at 05:05, its input
    # files not final).
    wide = QualitySettings(max_clock_skew_s=300.0)
    assert wide.settled_at_us(END) == END + (640 + 120 + 120) * US
    with pytest.raises(NotSettled, match="seal 640 s after it ends"):
        check_quality(out, logs, START, END, wide, now_us=settled)


def test_interval_clicks_parses_files_together_as_each_alone(tmp_path: Path) -> None:
    """The click files are parsed together (one Arrow read per few MB): a file's torn last line must stay its own
    line, not swallow the next file's first click, and a torn tail that is a whole event still counts, as when each
    file is parsed alone."""
    from photon.storage import LocalStore
    from photon.tools.quality import ClickFile, interval_clicks

    a, b, c = (START + k * US for k in (1, 2, 3))
    torn = tmp_path / "torn.jsonl"
    torn.write_text(json.dumps(click_line(a)) + '\n{"click_id": ')  # a crashed writer's tail, no newline
    whole = tmp_path / "whole-tail.jsonl"
    whole.write_text(json.dumps(click_line(b)) + "\n" + json.dumps(click_line(c)))  # its last event lacks "\n"
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    files = [torn, whole, empty, torn]
    together = interval_clicks([ClickFile(LocalStore(tmp_path), f.name) for f in files]).sort_by("click_id")
    alone = [parse_file(f.name, f.read_bytes(), "clicks")[0]["click_id"].to_pylist() for f in files]
    assert together["click_id"].to_pylist() == sorted({i for ids in alone for i in ids})
    assert together["click_id"].to_pylist() == sorted(_click_id(ts) for ts in (a, b, c))


def test_the_data_docs_index_lists_the_newest_results_only(tmp_path: Path) -> None:
    """The index reads every result it lists (about 5 ms each: 11 s with a month of hourly checks, rebuilt by every
    check): it lists the newest ``index_results``, so its cost stays flat as the history grows."""
    out, logs = World().write(tmp_path)
    for k in range(3):  # three hours, three results each
        check_quality(out, logs, END + k * HOUR, END + (k + 1) * HOUR, QualitySettings(index_results=4))
    index = (out / "_quality" / "data_docs" / "index.html").read_text()
    listed = re.findall(r"interval (\d{4}-\d\d-\d\dT\d\d)", index)
    newest, before = (f"{datetime.fromtimestamp((END + k * HOUR) / US, UTC):%Y-%m-%dT%H}" for k in (2, 1))
    assert sorted(listed) == [before] + [newest] * 3, listed


RUN_ONE = """
import json, sys
from photon.tools.quality import QualitySettings, check_quality
out, logs, start, end = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
r = check_quality(out, logs, start, end, QualitySettings(**json.loads(sys.argv[5])))
print(json.dumps({"success": r.success, "failed": r.failed}))
sys.exit(0 if r.success else 1)
"""


def test_concurrent_runs_on_different_and_the_same_hours_all_succeed(tmp_path: Path) -> None:
    """Airflow runs one data-quality task per hour, several at once after a backfill: five processes at once (four
    hours, one of them twice) each pass, and the Data Docs site lists every hour. Was: the second run read GX's shared
    expectation store while another rewrote it (``TypeError: ExpectationSuite() argument after ** must be a mapping,
    not NoneType``)."""

    out, logs = World().write(tmp_path)
    # The hours after START have no input: accepted as empty, so that each run passes on its own.
    hours = [START, START, END + HOUR, END + 2 * HOUR, END + 3 * HOUR]
    run_at_once(str(out), str(logs), hours)
    index = (out / "_quality" / "data_docs" / "index.html").read_text()
    listed = set(re.findall(r"interval (\d{4}-\d\d-\d\dT\d\d)", index))
    assert listed == {f"{datetime.fromtimestamp(h / US, UTC):%Y-%m-%dT%H}" for h in hours}, listed


EMPTY_OK: dict[str, Any] = {"allow_empty": True}


def run_at_once(out: str, logs: str, hours: list[int]) -> None:
    """``check_quality`` of each hour in a process of its own, all at once (the hours but START accepted empty, so
    that each passes alone): every one must pass."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                RUN_ONE,
                out,
                logs,
                str(h),
                str(h + HOUR),
                json.dumps(EMPTY_OK if h != START else {}),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for h in hours
    ]
    done = [(p.wait(timeout=600), *p.communicate()) for p in procs]
    for code, stdout, stderr in done:
        assert code == 0, stderr[-3000:] + stdout


# -- on an object store ------------------------------------------------------------------------------------------


JUDGED = ("success", "failed", "joined", "unjoinable", "quarantined", "quarantine_unattributed", "input_clicks")
JUDGED += ("input_files", "no_outcome", "joined_more_than_once", "samples", "history", "backfilled")


OUT = "an é/out"  # a prefix the Delta log names as "an%20%C3%A9/out"


def test_output_and_logs_in_a_bucket_are_judged_as_in_folders(bucket: str, tmp_path: Path) -> None:
    """The same hour, its output and logs in folders and copied into a bucket, judged alike (a duplicate, a click
    without outcome, quarantined lines attributed by their log file); the bucket's Data Docs are objects under
    ``<out>/_quality/data_docs`` and a second run's index lists the first's results; nothing is written beside the
    process. A committed data file gone from the bucket: an error, not an hour judged. The output's prefix has a space
    and a non-ASCII letter: the tables' logs name their files percent-encoded (it crashed the read, found in review)."""
    w = World()
    _duplicate(w)
    w.joined.pop(7)  # a click of the input without outcome
    out, logs = w.write(tmp_path)
    local = check_quality(out, logs, START, END)
    assert not local.success and local.joined_more_than_once == 1 and local.no_outcome == 1 and local.quarantined
    to_bucket(out, f"s3://{bucket}/{OUT}")
    to_bucket(logs, f"s3://{bucket}/logs")
    shutil.rmtree(out / "_quality")
    cwd = set(Path.cwd().iterdir())
    remote = check_quality(f"s3://{bucket}/{OUT}", f"s3://{bucket}/logs", START, END)
    assert {k: getattr(remote, k) for k in JUDGED} == {k: getattr(local, k) for k in JUDGED}
    assert remote.docs_index == f"s3://{bucket}/{OUT}/_quality/data_docs/index.html"
    assert remote.output_files_read == local.output_files_read and remote.quarantine_files_read
    store = open_store(f"s3://{bucket}/{OUT}")
    later = check_quality(
        f"s3://{bucket}/{OUT}", f"s3://{bucket}/logs", END + HOUR, END + 2 * HOUR, QualitySettings(**EMPTY_OK)
    )
    assert later.success
    index = store.get("_quality/data_docs/index.html").decode()
    assert set(re.findall(r"interval (\d{4}-\d\d-\d\dT\d\d)", index)) == {
        f"{datetime.fromtimestamp(h / US, UTC):%Y-%m-%dT%H}" for h in (START, END + HOUR)
    }
    pages = [e.key for e in store.listing("_quality/data_docs/validations")]
    assert len(pages) == 6, pages  # three suites, two hours
    assert any(e.key.endswith(".js") for e in store.listing("_quality/data_docs/static/vendor"))  # offline assets
    assert not (out / "_quality").exists() and set(Path.cwd().iterdir()) == cwd
    # The lock's generations before the last are pruned; the last is released.
    held = sorted(e.key.rpartition("/")[2] for e in store.files("_quality/_lock"))
    assert held == ["lock-000000000001.json", "lock-000000000001.released"], held

    gone = next(e.key for e in store.listing("dc-a/joined") if e.key.endswith(".parquet"))
    store.delete(gone)
    with pytest.raises(QualityInputError, match="unreadable"):
        check_quality(f"s3://{bucket}/{OUT}", f"s3://{bucket}/logs", START, END)


def test_concurrent_runs_on_a_bucket_all_publish(bucket: str, tmp_path: Path) -> None:
    """Two processes at once on one bucket, two hours: each passes, and the index in the bucket lists both hours; the
    index built after keeps to the newest ``index_results`` though every result is in the bucket."""

    out, logs = World().write(tmp_path)
    to_bucket(out, f"s3://{bucket}/out")
    to_bucket(logs, f"s3://{bucket}/logs")
    hours = [START, END + HOUR]
    where = [f"s3://{bucket}/out", f"s3://{bucket}/logs"]
    run_at_once(*where, hours)
    store = open_store(f"s3://{bucket}/out")
    index = store.get("_quality/data_docs/index.html").decode()
    assert set(re.findall(r"interval (\d{4}-\d\d-\d\dT\d\d)", index)) == {
        f"{datetime.fromtimestamp(h / US, UTC):%Y-%m-%dT%H}" for h in (START, END + HOUR)
    }
    check_quality(*where, END + 2 * HOUR, END + 3 * HOUR, QualitySettings(index_results=4, **EMPTY_OK))
    index = store.get("_quality/data_docs/index.html").decode()
    listed = re.findall(r"interval (\d{4}-\d\d-\d\dT\d\d)", index)
    newest, before = (f"{datetime.fromtimestamp((END + k * HOUR) / US, UTC):%Y-%m-%dT%H}" for k in (2, 1))
    assert sorted(listed) == [before] + [newest] * 3, listed
    results = [e.key for e in store.listing("_quality/gx/uncommitted/validations") if e.key.endswith(".json")]
    assert len(results) == 9, results  # three hours' results, all kept
    # index_results 0: no limit, as GX reads it (the run downloads every result, not none)
    check_quality(*where, END + 3 * HOUR, END + 4 * HOUR, QualitySettings(index_results=0, **EMPTY_OK))
    index = store.get("_quality/data_docs/index.html").decode()
    assert len(set(re.findall(r"interval (\d{4}-\d\d-\d\dT\d\d)", index))) == 4, index
