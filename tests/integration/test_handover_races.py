"""Found by an adversarial review of the hand-over and the listing marks: two standbys racing for one lease, and a
lease whose host clock is behind the previous lease's. Both failed before their fixes."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from photon.joiner.common import JoinSettings
from photon.joiner.lease import Joiner
from photon.joiner.state import FencedError, Lease
from photon.logs.layout import partition_of
from photon.pg import autocommit
from photon.registry.clock import ServerClock
from tests.integration import output

pytestmark = pytest.mark.integration
US = 1_000_000


def beating(j: Joiner, lease: Lease, every_s: float, stop: threading.Event) -> threading.Thread:
    def run() -> None:
        with j.state.heartbeating(lease, every_s):
            stop.wait()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_the_standby_that_loses_the_race_waits_for_the_winners_whole_term(
    tmp_path: Path, servers: dict[str, str]
) -> None:
    """Was: the loser kept the deadline it set during the lease before, and fenced the winner's live lease seconds
    into it. Now its patience is measured from the winner's own lease start."""
    logs, out = tmp_path / "logs", tmp_path / "out"
    (logs / "dc-a" / "clicks").mkdir(parents=True)
    settings = JoinSettings(parallelism=1, heartbeat_s=0.5)
    a = Joiner("dc-a", logs, out, servers, None, settings)
    stop_a = threading.Event()
    thread_a = beating(a, a.start(), 0.5, stop_a)
    standbys = [Joiner("dc-a", logs, out, servers, None, settings) for _ in range(2)]
    took: dict[int, str] = {}

    def standby(i: int) -> None:
        took[i] = standbys[i].take_over(stale_s=3.0, timeout_s=6.0)  # a lease is overdue 6 s after its start

    threads = [threading.Thread(target=standby, args=(i,), daemon=True) for i in (0, 1)]
    for t in threads:
        t.start()
    time.sleep(4.0)  # A's lease runs 4 s of its 6, and ends
    stop_a.set()
    thread_a.join()
    a.release()
    deadline = time.monotonic() + 5
    while not took and time.monotonic() < deadline:
        time.sleep(0.01)
    ((x, why),) = took.items()
    assert why == "released"
    lease_x = standbys[x].lease
    assert lease_x is not None
    stop_x = threading.Event()
    thread_x = beating(standbys[x], lease_x, 0.5, stop_x)
    time.sleep(4.5)  # X runs 4.5 s of its term; the loser's old deadline (6 s after it began waiting) is long past
    standbys[x].state.heartbeat(lease_x)  # X is still the lease: not fenced
    assert len(took) == 1
    stop_x.set()
    thread_x.join()
    standbys[x].release()
    threads[1 - x].join(timeout=10)
    assert took[1 - x] == "released"  # the loser took over when X released, not before
    with pytest.raises(FencedError):
        standbys[x].state.heartbeat(lease_x)


def click_file(logs: Path, part: str, name: str, ts: int) -> None:
    p = logs / "dc-a" / "clicks" / part / name
    p.parent.mkdir(parents=True, exist_ok=True)
    line = {"click_id": f"10.0.0.1-5-{ts}", "ts_us": ts, "query_id": f"10.0.0.2-6-{ts - US}", "ad_id": "a1"}
    p.write_bytes(json.dumps(line).encode() + b"\n")


def test_a_lease_whose_clock_is_behind_never_moves_the_listing_mark_back(
    tmp_path: Path, servers: dict[str, str], spark: Any
) -> None:
    """Was: a lease on a host whose clock was a second or two behind the previous lease's committed an older mark;
    it had loaded no consumed-file record from before the committed mark, so it read a consumed file again and its
    commit failed on the consumed-file key (a crashed lease; after a GC of those records, a file read twice).
    Decisions now read the registry server's clock, but through an offset measured over a round trip: a lease's
    reading may still be behind the previous one's by up to half of it. Here lease 2 reads 1.5 s behind."""
    logs, out = tmp_path / "logs", tmp_path / "out"
    (logs / "dc-a" / "queries").mkdir(parents=True)
    settings = JoinSettings(parallelism=1, trigger_interval_s=0.2, max_join_delay_s=120)
    minute = int(time.time()) // 60 * 60

    class Shifted(ServerClock):  # the server's clock as this lease reads it: at_s when the lease starts
        def __init__(self, at_s: float) -> None:
            super().__init__(servers["main"], settings.max_clock_skew_s)
            self.shift_us = int((at_s - time.time()) * US)

        def now_us(self) -> int:
            return super().now_us() + self.shift_us

    old = int(time.time() * US) - 600 * US  # old clicks whose queries never come: unjoinable at once
    click_file(logs, partition_of((minute - 90) * US), "10.0.0.1-5-1.jsonl", old)  # two minutes back

    j1 = Joiner("dc-a", logs, out, servers, spark, settings, clock=Shifted(minute + 1.0))  # just after the minute
    j1.run(max_batches=1)
    j1.release()
    click_file(logs, partition_of(int(time.time() * US)), "10.0.0.1-5-2.jsonl", old + US)
    j2 = Joiner("dc-a", logs, out, servers, spark, settings, clock=Shifted(minute - 0.5))  # 1.5 s behind lease 1
    j2.run(until_caught_up=True, max_batches=3)  # raised UniqueViolation on consumed_files before
    j2.release()
    with autocommit(servers["main"]) as conn, conn.cursor() as cur:
        cur.execute("SELECT name FROM photon.consumed_files")
        names = [n for (n,) in cur.fetchall()]
        cur.execute("SELECT clicks_from FROM photon.batches ORDER BY batch_seq")
        marks = [m for (m,) in cur.fetchall()]
    assert sorted(names) == sorted(set(names)) and len(names) == 2
    assert marks == sorted(marks), marks  # never back
    ids = output.ids(out, "unjoinable", "dc-a")
    assert len(ids) == len(set(ids)) == 2


def test_two_standbys_that_time_out_on_one_stuck_lease_fence_it_once(
    tmp_path: Path, servers: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 19: two standbys that both found one live lease overdue both started a lease when the wait returned
    ``timeout``, so the second fenced the first (one wasted batch, against ``take_over``'s promise). Each standby's
    real wait is held at a barrier after it returns, so both have found the stuck lease overdue before either
    starts: the race, every time. Now exactly one fences the stuck lease; the other waits for the winner's term."""
    logs, out = tmp_path / "logs", tmp_path / "out"
    (logs / "dc-a" / "clicks").mkdir(parents=True)
    settings = JoinSettings(parallelism=1, heartbeat_s=0.5)
    stuck = Joiner("dc-a", logs, out, servers, None, settings)
    stop_stuck = threading.Event()
    lease_stuck = stuck.start()
    thread_stuck = beating(stuck, lease_stuck, 0.5, stop_stuck)  # alive, and never lets go
    standbys = [Joiner("dc-a", logs, out, servers, None, settings) for _ in range(2)]
    both_waited = threading.Barrier(2, timeout=20)
    for s in standbys:
        wait = s.state.wait_for_turn

        def wait_then_meet(wait: Any = wait, met: list[bool] = [], **kw: float) -> str:  # noqa: B006 (per standby)
            why = wait(**kw)
            if why == "timeout" and not met:  # the first time only: the loser's later waits run free
                met.append(True)
                both_waited.wait()
            return why

        monkeypatch.setattr(s.state, "wait_for_turn", wait_then_meet)
    took: dict[int, str] = {}
    threads = [
        threading.Thread(target=lambda i=i: took.update({i: standbys[i].take_over(stale_s=3.0, timeout_s=2.0)}))
        for i in (0, 1)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 15
    while not took and time.monotonic() < deadline:
        time.sleep(0.01)
    ((x, why),) = took.items()
    assert why == "timeout"
    lease_x = standbys[x].lease
    assert lease_x is not None and lease_x.epoch == lease_stuck.epoch + 1
    stop_x = threading.Event()
    thread_x = beating(standbys[x], lease_x, 0.5, stop_x)
    time.sleep(1.2)  # well within the winner's term of 2 s: the loser must still be waiting
    standbys[x].state.heartbeat(lease_x)  # raised FencedError before: the loser had fenced the winner
    assert len(took) == 1
    stop_x.set()
    thread_x.join()
    standbys[x].release()
    threads[1 - x].join(timeout=10)
    assert took[1 - x] == "released"  # the loser took over when the winner ended, not before
    with pytest.raises(FencedError):
        stuck.state.heartbeat(lease_stuck)
    stop_stuck.set()
    thread_stuck.join()


def test_a_lease_that_waited_on_a_stalled_commit_is_not_born_stale_and_the_next_standby_waits(
    servers: dict[str, str],
) -> None:
    """Review: a stale lease paused in the middle of its commit (a GC pause, SIGSTOP) holds its pipeline row. A standby
    that fences it waits on that row and then wrote its own lease's start and heartbeat as of its transaction's start
    (``now()``), before the wait: born stale, so the next standby fenced it at once. Two standbys fenced each other.
    Now a lease's start and heartbeat are the time it is written, checked after the row is locked."""
    from photon.joiner.state import PipelineState
    from photon.pg import connect

    state = PipelineState(servers["main"], "dc-a")
    stalled = state.start_lease()
    assert stalled is not None
    paused = connect(servers["main"])  # the stalled lease's commit, holding the row
    with paused.cursor() as cur:
        cur.execute("UPDATE photon.pipelines SET updated_at = now() WHERE pipeline = 'dc-a'")
    time.sleep(1.2)  # its heartbeat is stale (1 s)
    got: list[Lease | None] = []
    first = threading.Thread(target=lambda: got.append(state.start_lease(unless_live_within_s=1.0)))
    first.start()
    time.sleep(1.5)  # the first standby waits on the row all along
    assert first.is_alive()
    paused.commit()
    paused.close()
    first.join(timeout=10)
    (lease,) = got
    assert lease is not None and lease.epoch == stalled.epoch + 1
    # A moment later, well within its heartbeat's 1 s: the second standby must find it live
    assert state.start_lease(unless_live_within_s=1.0) is None
    state.heartbeat(lease)  # still the pipeline's lease (FencedError before)
