"""Which new files a batch takes under a backlog: the oldest arrivals first, whatever their names, and the
verifier's re-dispatched clicks before any other, so that no file waits indefinitely behind later ones."""

from __future__ import annotations

import os
from pathlib import Path

from photon.clock import ServerClock
from photon.joiner import Joiner, JoinSettings


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
    queries, taken = joiner._new_files()
    assert queries == []
    assert taken == ["recovered-1795000000000000.jsonl", "9.9.9.9-1-1.jsonl", "1.1.1.1-1-5.jsonl"]
    joiner.consumed.update(("clicks", n) for n in taken)
    assert joiner._new_files()[1] == ["1.1.1.1-1-7.jsonl"]


def test_only_partitions_from_the_mark_on_are_listed_and_the_mark_moves_past_sealed_ones(tmp_path: Path) -> None:
    """Arrival partitions (EVENTS.md): a file arriving late (a replica catching up, a recovered file) lands in the
    partition of now and is found at once; a sealed partition whose files are all consumed is never listed again,
    so a trigger's cost does not grow with history."""
    import time

    from photon.layout import log_path, partition_of, sealed_before

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
    _, taken = joiner._new_files()
    assert taken == [f"{partition_of(old)}/1.1.1.1-1-1.jsonl", f"{partition_of(old)}/1.1.1.1-1-2.jsonl"]
    assert joiner._next_marks["clicks"] == min(partition_of(recent), sealed_before(now))
    # The batch commits: the hour-old partition is behind the mark, and a file put there now is never listed.
    joiner.marks = dict(joiner._next_marks)
    joiner.consumed.update(("clicks", n) for n in taken)
    touch(log_path(logs, "dc-a", "clicks", "1.1.1.1-1-9.jsonl", old), old // us)
    # A replica catching up an hour late, and a recovered file: both arrive now, in the partition of now.
    touch(log_path(logs, "dc-a", "clicks", "2.2.2.2-1-1.jsonl", now), now // us)
    touch(log_path(logs, "dc-a", "clicks", "recovered-1.jsonl", now), now // us)
    _, taken = joiner._new_files()
    assert [n.rsplit("/", 1)[1] for n in taken] == ["recovered-1.jsonl", "1.1.1.1-1-3.jsonl"]


def test_a_file_still_being_copied_waits_and_a_whole_one_is_taken_at_once(tmp_path: Path) -> None:
    """EVENTS.md's rule for closed files, the reader's side: a fresh file that is empty or ends mid-line (a copy
    still being written) is not taken, and the listing mark stays at its partition so it is listed again; a fresh
    file ending with a newline is taken at once (no settle delay for an honest, renamed file); a torn tail that has
    not changed for ``settle_s`` is taken (a crashed writer's: its last line is quarantined)."""
    import time

    from photon.joiner import read_whole

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
    _, taken = joiner._new_files()
    assert sorted(taken) == [f"{new_part}/settled.jsonl", f"{new_part}/whole.jsonl"]
    assert joiner._next_marks["clicks"] == old_part  # torn.jsonl is listed again
    # The task's own check, for a file that changed between the listing and the read.
    assert read_whole(torn, 5.0)[0] is None and read_whole(empty, 5.0)[0] is None
    assert read_whole(torn, 5.0, now_s=time.time() + 6)[0] == b'{"a": 1}\n{"a"'
    assert read_whole(whole, 5.0)[0] == b'{"a": 1}\n'
    assert read_whole(clicks / "gone.jsonl", 5.0)[0] is None
    # A file a task left for later keeps its kind's mark at or before its partition (None: every partition).
    from photon.joiner import _marks_before

    marks = _marks_before({"clicks": new_part, "queries": None}, {("clicks", f"{old_part}/torn.jsonl")})
    assert marks == {"clicks": old_part, "queries": None}
    assert _marks_before({"clicks": old_part}, {("clicks", f"{new_part}/x.jsonl")}) == {"clicks": old_part}
