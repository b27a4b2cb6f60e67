"""Where a live pipeline starts reading, and which files are then its and which are history for the backfills
(README, "Where a live pipeline starts"): listing only, no registry and no Spark."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from photon.joiner.common import BEGINNING, JoinSettings
from photon.joiner.discovery import Discovery, is_after_start, start_marks
from photon.joiner.lease import Joiner
from photon.logs.layout import log_path, partition_of, sealed_before
from photon.registry.clock import ServerClock

US = 1_000_000
SEAL_S = JoinSettings().seal_s


def clicks_file(logs: Path, name: str, arrival_us: int, first_event_us: int) -> str:
    """A closed click file that arrived at ``arrival_us`` whose first event is stamped ``first_event_us``; its name
    relative to ``clicks/``."""
    path = log_path(logs, "dc-a", "clicks", name, arrival_us)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = {"click_id": f"10.0.0.2-8-{first_event_us}", "ts_us": first_event_us, "query_id": "x", "ad_id": "a"}
    path.write_text(json.dumps(line) + "\n")
    os.utime(path, (arrival_us / US, arrival_us / US))
    return f"{partition_of(arrival_us)}/{name}"


def discovery(logs: Path, settings: JoinSettings) -> Discovery:
    joiner = Joiner("dc-a", logs, logs.parent / "out", {"main": "dbname=unused"}, None, settings,
                    clock=ServerClock.assumed())  # fmt: skip
    return joiner.discovery


def test_start_marks() -> None:
    now = int(time.time()) * US
    assert start_marks(None, now, SEAL_S) == {"queries": None, "clicks": None}  # the beginning: every partition
    past = now - 3_600 * US
    assert start_marks(past, now, SEAL_S) == dict.fromkeys(("queries", "clicks"), partition_of(past - 60 * US))
    # A start in the future (or the last minute): queries from the oldest partition not sealed yet, since only
    # sealed partitions go into the shared query index; clicks from where a file of the start can have arrived.
    future = now + 600 * US
    assert start_marks(future, now, SEAL_S) == {
        "queries": sealed_before(now, SEAL_S),
        "clicks": partition_of(future - 60 * US),
    }


def test_a_live_pipeline_takes_files_from_its_start_and_leaves_history_to_the_backfills(tmp_path: Path) -> None:
    """A pipeline started at S lists clicks from the partition a file of S can have arrived in (S - seal); of the
    files that arrived before S's partition it takes only those whose first event is at or after S, and it takes
    every file that arrived from S's partition on, a late file with old events included (the rules for late files
    hold). The history it leaves does not hold its listing mark back."""
    logs = tmp_path / "logs"
    now = int(time.time()) * US
    start = (now - 1_800 * US) // (60 * US) * (60 * US) + 30 * US  # half a minute into a partition, 30 min ago
    long_ago = clicks_file(logs, "1.1.1.1-1-1.jsonl", start - 3_600 * US, start - 3_610 * US)  # never listed
    just_before = clicks_file(logs, "1.1.1.1-1-2.jsonl", start - 40 * US, start - 45 * US)  # history, listed
    stamped_after = clicks_file(logs, "1.1.1.1-1-3.jsonl", start - 20 * US, start + 5 * US)  # a writer ahead
    late = clicks_file(logs, "2.2.2.2-1-1.jsonl", start + 10 * US, start - 7_200 * US)  # a replica catching up
    recent = clicks_file(logs, "1.1.1.1-1-4.jsonl", now - 5 * US, now - 6 * US)
    d = discovery(logs, JoinSettings(parallelism=1))
    marks = d.first_marks(start, now)
    assert marks["clicks"] == partition_of(start - 60 * US) <= partition_of(start - 40 * US)  # the history is listed
    d.restart(marks, set(), start)
    _, taken = d.new_files()
    assert taken == [stamped_after, late, recent]
    assert long_ago not in taken and just_before not in taken
    # Consumed: the mark moves past the sealed partitions, the history file's included (a file the pipeline never
    # takes must not hold it there: every trigger would list from it for good).
    d.committed([("clicks", n) for n in taken], {}, 0, dict(d.next_marks))
    assert d.marks["clicks"] == sealed_before(now, SEAL_S)
    # The same rule, file by file: the start's partition or later, or a first event at or after the start.
    assert is_after_start(late, start, lambda: 0)
    assert not is_after_start(just_before, start, lambda: start - 1)
    assert is_after_start(just_before, start, lambda: start)


def test_a_backfills_files_outside_its_window_still_hold_its_mark(tmp_path: Path) -> None:
    """Unlike a live pipeline's history, the files a backfill window lists but does not take keep its listing mark
    at its window's first partitions: a re-run of the hour lists its whole arrival range again, and finds a file of
    the hour dropped late into an old partition (which the data-quality check counts for the hour)."""
    logs = tmp_path / "logs"
    now = int(time.time()) * US
    window = (now // (3_600 * US) - 3) * 3_600 * US  # an hour three hours ago
    before = clicks_file(logs, "1.1.1.1-1-1.jsonl", window - 30 * US, window - 35 * US)  # the hour before's
    inside = clicks_file(logs, "1.1.1.1-1-2.jsonl", window + 300 * US, window + 290 * US)
    d = discovery(logs, JoinSettings(parallelism=1, window_start_us=window, window_end_us=window + 3_600 * US))
    d.restart(d.first_marks(None, now), set())
    assert d.new_files()[1] == [inside]
    d.committed([("clicks", inside)], {}, 0, dict(d.next_marks))
    assert d.marks["clicks"] == before.rsplit("/", 1)[0]


def test_a_new_pipeline_starts_at_the_beginning_unless_told(tmp_path: Path) -> None:
    """The default: every file in the logs, history included (nothing is left to anyone by default)."""
    logs = tmp_path / "logs"
    now = int(time.time()) * US
    old = clicks_file(logs, "1.1.1.1-1-1.jsonl", now - 86_400 * US, now - 86_401 * US)
    assert JoinSettings().start == BEGINNING
    d = discovery(logs, JoinSettings(parallelism=1))
    d.restart(d.first_marks(None, now), set(), None)
    assert d.new_files()[1] == [old]


def test_the_join_dags_pass_the_start_from_the_run_or_the_variable() -> None:
    """photon_join_<dc> passes ``--start``: the run's ``start`` param, else the Variable ``photon_join_start``, else
    the beginning of the logs (rendered here by Jinja as Airflow does, ``var.value.get`` with its default)."""
    import jinja2

    from photon.airflow.dags import START_AT, join_dag

    dag = join_dag("dc-a")
    args = dag.get_task("joiner_lease").application_args
    assert args[args.index("--start") + 1] == START_AT
    assert dag.params["start"] is None and dag.params.get_param("start").schema["type"] == ["null", "string"]
    render = jinja2.Template(START_AT).render
    assert render(params={"start": None}, var={"value": {}}) == "beginning"
    assert render(params={"start": None}, var={"value": {"photon_join_start": "now"}}) == "now"
    at = "2026-11-25T00:00:00Z"
    assert render(params={"start": at}, var={"value": {"photon_join_start": "now"}}) == at
