"""`make chaos`'s schedule and its summary agree on the kills: a kill drawn while another of the same data center was
pending replaced it, and kills drawn for the lost data center after its loss were printed but could never land, so
the timeline showed more kills than the summary counted (seed 1: six drawn, two of them after dc-a's loss). And the
run's folder no longer stays in the temporary folder once the run passed."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.nemesis.run import STORAGE_RETRY_S, Fault, Nemesis, keep_work, plan


def _lease() -> subprocess.Popen[bytes]:
    """A process standing for a joiner lease, in its own process group as the nemesis starts them."""
    return subprocess.Popen(["sleep", "60"], start_new_session=True)


def test_no_kill_is_drawn_for_the_lost_data_center_after_its_loss() -> None:
    for seed in (1, 7, 11, 102):
        p = plan(seed=seed, seconds=300)
        loss = next(f for f in p.faults if f.kind == "lose_dc")
        assert [f for f in p.faults if f.kind == "kill" and f.target == p.lost and f.at_s >= loss.at_s] == []
        assert [f for f in p.faults if f.kind == "kill"], seed  # the others are still there


def test_every_kill_drawn_lands_in_turn_or_is_counted_as_not_landed(tmp_path: Path) -> None:
    n = Nemesis(plan(seed=1, seconds=300), tmp_path)
    drawn = [Fault(10.0, "kill", "dc-a"), Fault(12.0, "kill", "dc-a"), Fault(13.0, "kill", "dc-b")]
    for f in drawn:
        n._apply(f, f.at_s)
    landed = 0
    for dc in ("dc-a", "dc-a", "dc-b"):  # each lease runs its first batch; the kill due lands on it
        proc = _lease()
        n.joiners[dc], n.first_batch_at[dc] = proc, 20.0
        assert n._kill_if_due(dc, proc, 30.0) and proc.poll() is not None
        landed += 1
    assert n.outcome.faults["kill"] == landed == 3 and not n.kill_pending
    late = Fault(40.0, "kill", "dc-b")  # drawn, and the input stops before a lease of dc-b runs a batch
    n._apply(late, late.at_s)
    n._drop_kills("dc-b")
    assert n.outcome.faults["kill"] + n.outcome.faults["kill_not_landed"] == len(drawn) + 1


def test_the_work_folder_goes_once_the_run_passed(tmp_path: Path) -> None:
    for owned, keep, ok, kept in (
        (True, False, True, False),
        (True, True, True, True),  # --keep
        (True, False, False, True),  # a failed run's folder is there to look into
        (False, False, True, True),  # --work DIR: the caller's folder
    ):
        work = tmp_path / f"run-{owned}-{keep}-{ok}"
        (work / "logs").mkdir(parents=True)
        assert keep_work(work, owned=owned, keep=keep, ok=ok) is kept
        assert work.exists() is kept


def test_once_the_input_stopped_an_owed_kill_lands_on_a_lease_holder_that_runs_no_batch(tmp_path: Path) -> None:
    """CI: on a loaded machine every lease of a 75 s seed's input ended before its kill was due, and once the input
    had stopped the leases, with nothing to join, ran no batch: the kill waited out the owed time and never landed."""
    n = Nemesis(plan(seed=1, seconds=300), tmp_path)
    n._apply(Fault(10.0, "kill", "dc-a"), 10.0)
    log = tmp_path / "lease.log"
    log.write_text("dc-a: lease epoch 3, resuming after batch 7 (reading from the beginning of the logs)\n")
    proc = _lease()
    n.joiners["dc-a"], n.lease_log["dc-a"] = proc, log
    n._note_first_batch("dc-a", 20.0, input_stopped=False)  # while input flows, a kill waits for a batch
    assert n.first_batch_at["dc-a"] is None and not n._kill_if_due("dc-a", proc, 40.0)
    n._note_first_batch("dc-a", 50.0, input_stopped=True)
    assert n._kill_if_due("dc-a", proc, 57.0) and proc.wait(timeout=10) < 0
    assert n.outcome.faults["kill"] == n.outcome.faults["kill_idle"] == 1
    # Once a kill has landed, a later one waits for a batch again.
    n._apply(Fault(60.0, "kill", "dc-a"), 60.0)
    again = _lease()
    n.joiners["dc-a"], n.first_batch_at["dc-a"] = again, None
    n._note_first_batch("dc-a", 61.0, input_stopped=True)
    assert n.first_batch_at["dc-a"] is None and not n._kill_if_due("dc-a", again, 90.0)
    again.kill()
    again.wait()


def test_an_s3_schedule_is_the_folder_schedule_plus_store_restarts_some_past_the_retry_budget() -> None:
    """`--storage s3` adds the S3 server's restarts to a seed's schedule without moving any other fault (a seed keeps
    meaning what it meant), and some of its outages outlast the requests' retry budget (the failing path)."""
    past = 0
    for seed in (1, 7, 11, 102, 2911501):
        folder, s3 = plan(seed=seed, seconds=180), plan(seed=seed, seconds=180, storage="s3")
        restarts = [f for f in s3.faults if f.kind == "store_restart"]
        assert [f for f in s3.faults if f.kind != "store_restart"] == folder.faults and len(restarts) >= 2
        assert all(0 < f.at_s < 180 and f.arg > 0 for f in restarts)
        past += sum(1 for f in restarts if f.arg > STORAGE_RETRY_S)
    assert past > 0
