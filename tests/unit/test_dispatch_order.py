"""Which new files a batch takes under a backlog: the oldest arrivals first, whatever their names, and the
verifier's re-dispatched clicks before any other, so that no file waits indefinitely behind later ones."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from photon.joiner.common import JoinSettings
from photon.joiner.lease import Joiner
from photon.registry.clock import ServerClock


def touch(path: Path, arrived_s: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{}\n")  # whole: a fresh empty file is taken for a copy still being written
    os.utime(path, (arrived_s, arrived_s))


def test_oldest_arrivals_and_recovered_files_first(tmp_path: Path) -> None:
    clicks = tmp_path / "logs" / "dc-a" / "clicks"
    touch(clicks / "9.9.9.9-1-1.jsonl", 100)  # sorts last by name, arrived first
    touch(clicks / "1.1.1.1-1-7.jsonl", 300)
    touch(clicks / "1.1.1.1-1-5.jsonl", 200)
    touch(clicks / "recovered-1795000000000000.jsonl", 900)  # the newest, and it sorts late: still first
    touch(clicks / "1.1.1.1-1-8.jsonl.inprogress", 50)  # not closed: never taken
    settings = JoinSettings(max_click_files=3, parallelism=1)
    joiner = Joiner(
        "dc-a",
        tmp_path / "logs",
        tmp_path / "out",
        {"main": "dbname=unused"},
        None,
        settings,
        clock=ServerClock.assumed(),
    )
    queries, taken = joiner.discovery.new_files()
    assert queries == []
    assert taken == ["recovered-1795000000000000.jsonl", "9.9.9.9-1-1.jsonl", "1.1.1.1-1-5.jsonl"]
    joiner.discovery.consumed.update(("clicks", n) for n in taken)
    assert joiner.discovery.new_files()[1] == ["1.1.1.1-1-7.jsonl"]


def test_only_partitions_from_the_mark_on_are_listed_and_the_mark_moves_past_sealed_ones(tmp_path: Path) -> None:
    """Arrival partitions (EVENTS.md): a file arriving late (a replica catching up, a recovered file) lands in the
    partition of now and is found at once; a sealed partition whose files are all consumed is never listed again,
    so a trigger's cost does not grow with history."""
    import time

    from photon.logs.layout import log_path, partition_of, sealed_before

    us = 1_000_000
    now = int(time.time() * us)
    logs = tmp_path / "logs"
    old, recent = now - 3_600 * us, now - 5 * us
    for name, at in (("1.1.1.1-1-1.jsonl", old), ("1.1.1.1-1-2.jsonl", old), ("1.1.1.1-1-3.jsonl", recent)):
        touch(log_path(logs, "dc-a", "clicks", name, at), at // us)
    joiner = Joiner(
        "dc-a",
        logs,
        tmp_path / "out",
        {"main": "dbname=unused"},
        None,
        JoinSettings(max_click_files=2, parallelism=1),
        clock=ServerClock.assumed(),
    )
    _, taken = joiner.discovery.new_files()
    assert taken == [f"{partition_of(old)}/1.1.1.1-1-1.jsonl", f"{partition_of(old)}/1.1.1.1-1-2.jsonl"]
    assert joiner.discovery.next_marks["clicks"] == min(partition_of(recent), sealed_before(now))
    # The batch commits: the hour-old partition is behind the mark, and a file put there now is never listed.
    joiner.discovery.marks = dict(joiner.discovery.next_marks)
    joiner.discovery.consumed.update(("clicks", n) for n in taken)
    touch(log_path(logs, "dc-a", "clicks", "1.1.1.1-1-9.jsonl", old), old // us)
    # A replica catching up an hour late, and a recovered file: both arrive now, in the partition of now.
    touch(log_path(logs, "dc-a", "clicks", "2.2.2.2-1-1.jsonl", now), now // us)
    touch(log_path(logs, "dc-a", "clicks", "recovered-1.jsonl", now), now // us)
    _, taken = joiner.discovery.new_files()
    assert [n.rsplit("/", 1)[1] for n in taken] == ["recovered-1.jsonl", "1.1.1.1-1-3.jsonl"]


def as_seen(path: Path) -> tuple[int, str]:
    """A file's (size, tag) as a folder's listing shows it: what a driver that saw it settle hands its task."""
    from photon.storage import LocalStore

    e = LocalStore.entry_of(path.name, os.stat(path))
    return e.size, e.etag


def test_a_file_still_being_copied_waits_and_a_whole_one_is_taken_at_once(tmp_path: Path) -> None:
    """EVENTS.md's rule for closed files, the reader's side: a fresh file that is empty or ends mid-line (a copy
    still being written) is not taken, and the listing mark stays at its partition so it is listed again; a fresh
    file ending with a newline is taken at once (no settle delay for an honest, renamed file); a torn tail that has
    not changed for ``settle_s`` as this reader saw it is taken (a crashed writer's: its last line is quarantined)."""
    import time

    from photon.joiner.tasks import read_whole

    clicks = tmp_path / "logs" / "dc-a" / "clicks"
    old_part, new_part = "20250101/0000", "20250101/0001"  # sealed long ago: only a waiting file holds the mark
    whole, torn, empty, settled_torn = (
        clicks / new_part / "whole.jsonl",
        clicks / old_part / "torn.jsonl",
        clicks / new_part / "empty.jsonl",
        clicks / new_part / "settled.jsonl",
    )
    for path, body in ((whole, b'{"a": 1}\n'), (torn, b'{"a": 1}\n{"a"'), (empty, b""), (settled_torn, b'{"a"')):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)
    old = time.time() - 10
    os.utime(settled_torn, (old, old))
    settings = JoinSettings(settle_s=5.0, parallelism=1)
    joiner = Joiner(
        "dc-a",
        tmp_path / "logs",
        tmp_path / "out",
        {"main": "dbname=unused"},
        None,
        settings,
        clock=ServerClock.assumed(),
    )
    _, taken = joiner.discovery.new_files()
    assert taken == [f"{new_part}/whole.jsonl"]  # settled.jsonl's old mtime proves nothing (the file server's clock)
    # settled.jsonl as this reader first saw it 6 s ago, unchanged since: taken
    key = ("clicks", f"{new_part}/settled.jsonl")
    seen = joiner.discovery._seen
    seen[key] = (*seen[key][:2], seen[key][2] - 6, seen[key][3])
    _, taken = joiner.discovery.new_files()
    assert sorted(taken) == [f"{new_part}/settled.jsonl", f"{new_part}/whole.jsonl"]
    assert joiner.discovery.next_marks["clicks"] == old_part  # torn.jsonl is listed again
    # The task's own check, for a file that changed between the listing and the read.
    assert read_whole(torn)[0] is None and read_whole(empty)[0] is None
    size, tag = as_seen(torn)
    assert read_whole(torn, settled_as=(size, tag))[0] == b'{"a": 1}\n{"a"'  # as the driver saw it settle
    assert read_whole(torn, settled_as=(size - 1, tag))[0] is None  # changed since
    assert read_whole(whole)[0] == b'{"a": 1}\n'
    assert read_whole(clicks / "gone.jsonl")[0] is None
    # A file a task left for later keeps its kind's mark at or before its partition (None: every partition).
    from photon.joiner.discovery import _marks_before

    marks = _marks_before({"clicks": new_part, "queries": None}, {("clicks", f"{old_part}/torn.jsonl")})
    assert marks == {"clicks": old_part, "queries": None}
    assert _marks_before({"clicks": old_part}, {("clicks", f"{new_part}/x.jsonl")}) == {"clicks": old_part}


def _joiner(tmp_path: Path, **settings: float) -> Joiner:
    return Joiner(
        "dc-a",
        tmp_path / "logs",
        tmp_path / "out",
        {"main": "dbname=unused"},
        None,
        JoinSettings(parallelism=1, **settings),  # type: ignore[arg-type]
        clock=ServerClock.assumed(),
    )


def test_a_torn_file_settles_by_what_the_reader_saw_never_by_its_modification_time(tmp_path: Path) -> None:
    """Review: a file's modification time is the file server's clock, which may be ``max_clock_skew`` off the
    reader's. A copy still being written whose mtime looks 10 s old (the file server behind) was taken at once, its
    torn tail quarantined and the rest of it never read; a torn file whose mtime is far ahead (``touch -d 2100``)
    was never taken, and held the listing mark back for good. Now a torn or empty file is taken once this reader has
    seen it unchanged (size and mtime) for ``settle_s``, whatever its mtime says; the task reads it only as seen."""
    import time

    from photon.joiner.tasks import read_whole

    part = "20250101/0000"  # sealed long ago: only a waiting file holds the mark
    clicks = tmp_path / "logs" / "dc-a" / "clicks" / part
    clicks.mkdir(parents=True)
    behind, ahead = clicks / "behind.jsonl", clicks / "ahead.jsonl"
    behind.write_bytes(b'{"a": 1}\n{"a"')
    ahead.write_bytes(b'{"a": 1}\n{"a"')
    past = time.time() - 10  # within the maximum clock skew (10 s)
    os.utime(behind, (past, past))
    os.utime(ahead, (4102444800, 4102444800))  # 2100-01-01
    joiner = _joiner(tmp_path, settle_s=0.5, max_clock_skew_s=10.0)
    assert joiner.discovery.new_files()[1] == []  # first sighting: still possibly being written
    assert joiner.discovery.next_marks["clicks"] == part
    time.sleep(0.6)
    taken = joiner.discovery.new_files()[1]
    assert sorted(taken) == [f"{part}/ahead.jsonl", f"{part}/behind.jsonl"]
    assert joiner.discovery.next_marks["clicks"] != part  # nothing left there: the mark moves on
    # The task reads a torn file only as the driver saw it settle (size, mtime); never by its mtime's age.
    t = joiner.batches._task("t", 0, tmp_path / "stage", 0, 1)
    assert t.settled[f"clicks/{part}/ahead.jsonl"] == list(as_seen(ahead))
    assert read_whole(ahead, settled_as=as_seen(ahead))[0] == b'{"a": 1}\n{"a"'
    assert read_whole(behind)[0] is None
    # Changed between two listings: seen anew, and waits again.
    with open(behind, "ab") as fh:
        fh.write(b": 2")
    os.utime(behind, (past, past))
    assert f"{part}/behind.jsonl" not in joiner.discovery.new_files()[1]


def test_a_directory_or_a_named_pipe_named_like_a_log_file_is_skipped_not_a_crash(tmp_path: Path) -> None:
    """Review: a directory named ``x.jsonl`` in a partition (``mkdir``, a botched ``cp -r``) made every listing raise
    (IsADirectoryError while checking its last byte) or, once old, every batch's task: the pipeline stalled for good;
    a named pipe blocked the listing in ``open`` for good. Now neither is a log file: logged, skipped, and the mark
    moves past it once sealed; the task's read of one is an error, never a hang."""
    import time

    part = "20250101/0000"
    clicks = tmp_path / "logs" / "dc-a" / "clicks" / part
    (clicks / "fresh.jsonl").mkdir(parents=True)
    (clicks / "old.jsonl").mkdir()
    past = time.time() - 3600
    os.utime(clicks / "old.jsonl", (past, past))
    (clicks / "good.jsonl").write_bytes(b'{"a": 1}\n')
    os.mkfifo(clicks / "pipe.jsonl")  # opening it to read its last byte would block for good
    joiner = _joiner(tmp_path)
    assert joiner.discovery.new_files()[1] == [f"{part}/good.jsonl"]
    assert joiner.discovery.next_marks["clicks"] != part
    from photon.joiner.tasks import read_whole

    assert read_whole(clicks / "pipe.jsonl")[0] is None and read_whole(clicks / "old.jsonl")[0] is None  # no hang


def test_a_file_that_never_settles_holds_the_mark_at_most_the_seal_bound_then_is_taken_and_said(
    tmp_path: Path, caplog: Any
) -> None:
    """Review: a torn file that keeps changing (a writer appending to a closed name for good) held its kind's listing
    mark back for good, silently: every batch listed every partition since, and stat-ed every file consumed since
    (``_check_consumed``), a cost growing without bound. Now, once seen changing for longer than the seal bound, it
    is taken as it is then, with a logged error; whatever it gains after is reported as a consumed file's change."""
    import logging

    part = "20250101/0000"
    clicks = tmp_path / "logs" / "dc-a" / "clicks" / part
    clicks.mkdir(parents=True)
    growing = clicks / "growing.jsonl"
    growing.write_bytes(b'{"a"')
    joiner = _joiner(tmp_path, settle_s=5.0)
    assert joiner.discovery.new_files()[1] == [] and joiner.discovery.next_marks["clicks"] == part
    with open(growing, "ab") as fh:
        fh.write(b": 1")
    # changed: waits again
    assert joiner.discovery.new_files()[1] == [] and joiner.discovery.next_marks["clicks"] == part
    key = ("clicks", f"{part}/growing.jsonl")  # as if first seen changing the seal bound ago, and since
    seen = joiner.discovery._seen
    seen[key] = (*seen[key][:3], seen[key][3] - joiner.s.seal_s)
    with open(growing, "ab") as fh:
        fh.write(b"}")
    with caplog.at_level(logging.ERROR, logger="photon.joiner"):
        assert joiner.discovery.new_files()[1] == [f"{part}/growing.jsonl"]
    assert joiner.discovery.next_marks["clicks"] != part
    assert "still changing" in caplog.text and "growing.jsonl" in caplog.text
    # The task reads it as it is then, even changed since the listing (it may never stop), once stable during the read
    from photon.joiner.tasks import read_whole

    t = joiner.batches._task("t", 0, tmp_path / "stage", 0, 1)
    with open(growing, "ab") as fh:
        fh.write(b"\n{")
    as_listed = t.settled[f"clicks/{part}/growing.jsonl"]
    assert read_whole(growing, settled_as=(as_listed[0], as_listed[1]))[0] == b'{"a": 1}\n{'
    caplog.clear()  # listed again (the task left it, say): still taken at once, said again
    with caplog.at_level(logging.ERROR, logger="photon.joiner"):
        assert joiner.discovery.new_files()[1] == [f"{part}/growing.jsonl"]
    assert "still changing" in caplog.text
