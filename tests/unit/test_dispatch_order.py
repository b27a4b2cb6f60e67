"""Which new files a batch takes under a backlog: the oldest arrivals first, whatever their names, and the
verifier's re-dispatched clicks before any other, so that no file waits indefinitely behind later ones."""

from __future__ import annotations

import os
from pathlib import Path

from photon.joiner import Joiner, JoinSettings


def touch(path: Path, arrived_s: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    os.utime(path, (arrived_s, arrived_s))


def test_oldest_arrivals_and_recovered_files_first(tmp_path: Path) -> None:
    clicks = tmp_path / "logs" / "dc-a" / "clicks"
    touch(clicks / "9.9.9.9-1-1.jsonl", 100)  # sorts last by name, arrived first
    touch(clicks / "1.1.1.1-1-7.jsonl", 300)
    touch(clicks / "1.1.1.1-1-5.jsonl", 200)
    touch(clicks / "recovered-1795000000000000.jsonl", 900)  # the newest, and it sorts late: still first
    touch(clicks / "1.1.1.1-1-8.jsonl.inprogress", 50)  # not closed: never taken
    settings = JoinSettings(max_click_files=3, parallelism=1)
    joiner = Joiner("dc-a", tmp_path / "logs", tmp_path / "out", {"main": "dbname=unused"}, None, settings)
    queries, taken = joiner._new_files()
    assert queries == []
    assert taken == ["recovered-1795000000000000.jsonl", "9.9.9.9-1-1.jsonl", "1.1.1.1-1-5.jsonl"]
    joiner.consumed.update(("clicks", n) for n in taken)
    assert joiner._new_files()[1] == ["1.1.1.1-1-7.jsonl"]
