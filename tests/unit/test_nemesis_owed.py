"""What the nemesis waits for once the input has stopped (tests/nemesis/run.py, ``Nemesis._owed``): a fault kind
that has not happened yet, never a further kill after one landed (a lease with nothing left to join runs no batch,
so such a kill would only wait out OWED_FAULTS_S: seed 26112705 waited 120 s for one)."""

from __future__ import annotations

from pathlib import Path

from tests.nemesis.run import Nemesis, plan


def test_only_kinds_not_yet_seen_are_owed(tmp_path: Path) -> None:
    n = Nemesis(plan(seed=11, seconds=75), tmp_path)
    n.kill_pending["dc-a"] = 1.0
    assert n._owed() == ["kill dc-a"]
    n.outcome.faults["kill"] += 1  # an earlier kill landed
    assert n._owed() == []
    n.dying["dc-b"] = "after_register@+2"
    n.next_clock["dc-a"] = 4.0
    assert n._owed() == ["lost dc-b", "clock dc-a"]
