"""A pipeline's lease, on the driver: the ``Joiner``. Starting a lease recovers what the last one left (publishes
its committed batches, drops what was only staged), loads the marks, consumed files and retry set, checks the state
files and prepares the lookups; then batches run, one per trigger, until the term ends. A standby warms up beside
the running lease and takes over the moment it is released; a lease whose term is over holds on while a standby is
still starting. A host whose clock drifts past the maximum skew stops after its batch."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from photon.durable import check_parquet
from photon.joiner.adapter import load_adapter
from photon.joiner.batch import BatchRunner
from photon.joiner.common import (
    BEGINNING,
    HOLD_POLL_S,
    NOW,
    SUCCESSOR_WAIT_S,
    US,
    BatchResult,
    JoinSettings,
    batch_tag,
    epoch_of_tag,
)
from photon.joiner.discovery import Discovery, oldest_partition, query_index_range
from photon.joiner.eventstore import RECOVER_STORE, read_store_file
from photon.joiner.publish import STAGING, STATE
from photon.joiner.state import Heartbeat, Lease, PipelineState
from photon.logs.layout import partition_start_us
from photon.logs.tables import ensure_tables
from photon.registry.clock import ClockSkewError, ServerClock
from photon.spark_session import default_parallelism
from photon.storage import Store, check_conditional_writes, open_store

log = logging.getLogger(__name__)


class Joiner:
    """A pipeline's lease and its loop: start (recover what the last lease left, load the state), run batches until
    the term ends (holding on for a starting standby, ``term``), hand over. Listing files is ``discovery``'s, running
    a batch ``batches``'."""

    def __init__(
        self,
        dc: str,
        logs: Path | str,
        out: Path | str,
        servers: Mapping[str, str],
        spark: Any,
        settings: JoinSettings | None = None,
        *,
        pipeline: str | None = None,
        clock: ServerClock | None = None,
    ):
        """Joins ``<logs>/<dc>`` into ``<out>/<pipeline>``; the pipeline (its state, token owner and output folder)
        is named after the data center unless given, as a backfill names its own. ``clock``: the registry main
        server's (measured here unless given)."""
        # Absolute: the executors (a Spark Connect server's workers, a cluster's) have working folders of their own.
        # An s3:// URL: read through the store by the driver and by every executor, with the workers' credentials.
        self.logs = open_store(logs if str(logs).startswith("s3://") else Path(logs).resolve())
        # The output likewise: its tables, the pipeline's state and the shared query index
        self.out = open_store(out if str(out).startswith("s3://") else Path(out).resolve())
        self.dc = dc
        self.pipeline = pipeline or dc
        if not re.fullmatch(r"[a-z][a-z0-9_-]{0,30}", self.pipeline):
            raise ValueError(
                f"pipeline name {self.pipeline!r}: 1 to 31 lowercase letters, digits, '-' or '_', "
                "starting with a letter"
            )
        self.servers = dict(servers)
        self.spark = spark
        self.s = settings or JoinSettings()
        self.clock = clock or ServerClock(self.servers["main"], self.s.max_clock_skew_s)
        self.state = PipelineState(self.servers["main"], self.pipeline)
        self.root = self.out.child(self.pipeline)
        self.state_store = self.root.child(STATE)
        if self.out.atomic:  # an object store: its conditional writes carry the tables' commits
            check_conditional_writes(self.state_store)
        ensure_tables(self.root)  # before any lease: an --out holding something else is refused, untouched
        self.lease: Lease | None = None
        self.index_stats: dict[str, Any] = {}  # what the last lease start did to the shared index (tests, logs)
        self.discovery = Discovery(self.logs, dc, self.pipeline, self.s, self.clock)
        self.stopping = threading.Event()  # set by stop(): the loop ends after the batch in progress
        self.stopped_by: str | None = None
        self.term = Term(self.state, self.pipeline, self.s.trigger_interval_s, self.stopping)
        self.batches = BatchRunner(
            dc=dc,
            pipeline=self.pipeline,
            logs=self.logs,
            root=self.root,
            servers=self.servers,
            spark=spark,
            settings=self.s,
            clock=self.clock,
            state=self.state,
            discovery=self.discovery,
            parallelism=max(1, self.s.parallelism or default_parallelism(spark)),
        )
        load_adapter(self.s.adapter)  # fail fast on a bad adapter path

    # lease start: recover, then load state --------------------------------------------------------------
    def start(self) -> Lease:
        lease = self._start(None)
        assert lease is not None
        return lease

    def _start(self, unless_live_within_s: float | None, overdue_after_s: float | None = None) -> Lease | None:
        """A new lease, then recovery and state; None (nothing done) if ``unless_live_within_s`` is given and a live
        lease holds the pipeline (one that started more than ``overdue_after_s`` ago is fenced all the same)."""
        self.clock.measure()  # a host whose clock is off more than the skew takes no lease (ClockSkewError)
        self.clock.check()
        start = BEGINNING if self.s.window_start_us is not None else self.s.start  # a backfill has its window
        lease = self.state.start_lease(
            unless_live_within_s=unless_live_within_s, overdue_after_s=overdue_after_s, start=start
        )
        if lease is None:
            return None
        self.lease = lease
        # Which logs this output came from (the auditor reads it)
        self.root.put("_pipeline.json", (json.dumps({"pipeline": self.pipeline, "dc": self.dc}) + "\n").encode())
        open_batches = self.state.open_batches()
        committed = {(b.batch, b.epoch): b.published for b in open_batches}
        # Alive while it publishes (a stage listed short is listed again for up to PHOTON_STORAGE_RETRY_S per kind):
        # a standby must not take it for dead after 15 s and fence it.
        with self.state.heartbeating(lease, self.s.heartbeat_s):
            for b in open_batches:
                if not b.published:  # never fewer rows than its tasks staged, nor fewer index files than they named
                    self.batches.publish(b.batch, b.epoch, expect=b.rows, indexed=b.queries)
        self._sweep(lease, {batch_tag(*max(committed))} if committed else set())
        now = self.clock.now_us()
        marks = self.state.marks() if committed else self.discovery.first_marks(lease.start_us, now)
        self.discovery.restart(marks, self.state.consumed(marks), lease.start_us)
        if not committed:
            self._say_where_it_starts(lease.start_us, marks, now)
        asked = self.s.start
        if self.s.window_start_us is None and not lease.created and asked != BEGINNING and asked != lease.start_us:
            # "now" on an existing pipeline is never its start either (its start was the clock when it was created).
            log.warning(
                "%s: resumes from its committed position (after batch %d); the start asked for (%s) is ignored: a "
                "pipeline's start is recorded when it is created (here %s) and never moves",
                *(self.pipeline, lease.last_batch, "now" if asked == NOW else _when(int(asked))),
                "the beginning of the logs" if lease.start_us is None else _when(lease.start_us),
            )
        self.batches.last_batch = self.lease.last_batch
        last = max(committed, default=None)
        self.batches.retry_key = f"retries/{batch_tag(*last)}" if last else None
        self.batches.retry_rows = open_batches[-1].retried if open_batches else None
        # Building the shared query index can take minutes (hours of query history), and a retry set listed short is
        # listed again for up to PHOTON_STORAGE_RETRY_S: heartbeat meanwhile, or a standby takes the lease for dead
        # after 15 s and fences it.
        with self.state.heartbeating(lease, self.s.heartbeat_s):
            self.batches.retry_files()  # read whole now, each file checked (a damaged one named), not by a batch
            _check_state(self.state_store, self.clock.now_us(), self.s.bucket_s)
            self._prepare_lookups(lease.start_us, new_pipeline=not committed)
        log.info("%s: lease epoch %d, last batch %d", self.pipeline, self.lease.epoch, self.lease.last_batch)
        return self.lease

    def _sweep(self, lease: Lease, keep: set[str]) -> None:
        """What earlier leases left and nothing will read: their stages (never committed: the committed ones were
        published just now) and their retry sets but the last committed batch's (``keep``). Only an earlier epoch's:
        a sweep that outlives this lease's fence (a slow store, a paused process) must never remove what the lease
        that fenced it writes (its stage before its commit, its retry set after it). A stage not named by a batch (a
        warm-up's, a tool's) is swept too: its writer lets nothing depend on it."""
        for name in self.root.folders(STAGING):
            epoch = epoch_of_tag(name)
            if epoch is None or epoch < lease.epoch:
                self.root.remove_all(f"{STAGING}/{name}")
        for name in self.state_store.folders("retries"):
            epoch = epoch_of_tag(name)
            if name not in keep and epoch is not None and epoch < lease.epoch:
                self.state_store.remove_all(f"retries/{name}")

    # hand-over: a standby lease warms up while the current one runs, and takes over when it ends ------------
    def warm_up(self) -> None:
        """The standby's warm-up batch (``BatchRunner.warm_up``), before its take-over."""
        self.batches.warm_up()

    def take_over(self, *, stale_s: float, timeout_s: float) -> str:
        """Wait for the pipeline's current lease to end (released, or stale), then start this lease at once; a
        lease that started more than ``timeout_s`` ago and holds on is fenced. Returns why the pipeline was free.
        Two standbys never fence each other: the lease starts only if, at that moment and by the server's clock, no
        live lease holds the pipeline or the one that does is still overdue (``PipelineState.start_lease``); the
        standby that lost the race finds the winner's fresh lease and waits for its whole term."""
        while True:
            why = self.state.wait_for_turn(stale_s=stale_s, timeout_s=timeout_s)
            if self._start(stale_s, timeout_s if why == "timeout" else None) is not None:
                return why

    def release(self) -> None:
        if self.lease is not None:
            self.state.release(self.lease)

    def stop(self, why: str) -> None:
        """Ask the loop to end after the batch in progress (a signal handler may call it): its batch commits and
        publishes, no other starts, and ``run`` returns; the caller then releases the lease."""
        self.stopped_by = self.stopped_by or why
        self.stopping.set()

    def _say_where_it_starts(self, start_us: int | None, marks: Mapping[str, str | None], now_us: int) -> None:
        """A new live pipeline says where it starts reading, once per lease until its first commit; one that starts
        at the beginning of logs holding history warns that it joins that history itself, at its age."""
        if self.s.window_start_us is not None:
            return
        if start_us is not None:
            log.info(
                "%s: a new pipeline, started at %s (recorded in the registry): it lists clicks from partition %s "
                "and queries from %s; click files before its start are history, for photon_backfill (the hours "
                "that start before %s)",
                *(self.pipeline, _when(start_us), marks["clicks"], marks["queries"], _when(start_us)),
            )
            return
        oldest = oldest_partition(self.logs.child(f"{self.dc}/clicks"))
        oldest_us = now_us if oldest is None else partition_start_us(oldest)
        if now_us - oldest_us > (self.s.max_join_delay_s + self.s.seal_s + 60) * US:  # more than what is in flight
            log.warning(
                "%s: a new pipeline, started at the beginning of the logs: it joins their history itself, from "
                "%s (%.1f h ago), at that latency; to leave history to photon_backfill, start it with --start now "
                '(or a time) instead (README, "Where a live pipeline starts")',
                *(self.pipeline, _when(oldest_us), (now_us - oldest_us) / US / 3600),
            )
        else:
            log.info("%s: a new pipeline, started at the beginning of the logs", self.pipeline)

    def _prepare_lookups(self, start_us: int | None = None, *, new_pipeline: bool = False) -> None:
        """At a lease's start: read the registry's horizon, prune the pipeline's EventStore behind it, and for a
        backfill make sure the data center's shared query index covers every sealed query partition from the horizon
        to the window's end plus the maximum join delay and margins (only partitions not yet indexed are parsed).
        A live pipeline created with a start looks up the shared index for the queries that arrived before it; until
        its first commit (``new_pipeline``) its lease makes sure the index covers them (``discovery.start_marks``)."""
        from photon.joiner.query_index import ensure_indexed, index_range, index_root, prune, registry_horizon_us

        skew = self.s.max_clock_skew_s
        self.batches.horizon_us, now = registry_horizon_us(self.servers, max_clock_skew_s=skew)
        pruned = prune(self.state_store.child("eventstore"), self.batches.horizon_us, self.s.bucket_s, skew)
        if pruned.buckets:
            log.info("%s: EventStore pruned behind the registry's horizon: %s", self.pipeline, pruned)
        if self.s.window_end_us is None and start_us is None:
            return
        self.batches.shared_index = index_root(self.out, self.dc)
        if self.s.window_end_us is None and not new_pipeline:
            # Every query partition before the pipeline's first query mark was sealed, and so indexed, by the lease
            # that committed its first batch; every later one it consumes itself.
            return
        pruned = prune(self.batches.shared_index, self.batches.horizon_us, self.s.bucket_s, skew)
        if self.s.window_end_us is None:
            assert start_us is not None
            # From the oldest partition the horizon keeps (the window end given does not bound ``first``).
            first = index_range(start_us, self.batches.horizon_us, 0.0, skew)[0]
            last = query_index_range(start_us, self.s.seal_s)
        else:
            after_s = self.s.max_join_delay_s + 2 * self.s.window_margin_s + self.s.seal_s
            first, last = index_range(self.s.window_end_us, self.batches.horizon_us, after_s, skew)
        t0 = time.monotonic()
        built = ensure_indexed(
            self.spark,
            self.logs.child(f"{self.dc}/queries"),
            self.batches.shared_index,
            first=first,
            last=last,
            now_us=now,
            bucket_s=self.s.bucket_s,
            parallelism=self.batches.parallelism,
            seal_s=self.s.seal_s,
            max_future_s=self.s.max_future_s,
        )
        self.index_stats = {**built, "seconds": time.monotonic() - t0, "pruned_buckets": pruned.buckets}
        log.info(
            "%s: shared query index %s, %s..%s: %s in %.1fs (pruned %s)",
            *(self.pipeline, self.batches.shared_index.url, first, last, built, time.monotonic() - t0, pruned),
        )

    # the loop --------------------------------------------------------------------------------------------
    @property
    def held_s(self) -> float:
        """How long the last run() went on past its term, waiting for a standby to be ready."""
        return self.term.held_s

    def run(
        self,
        *,
        run_for_s: float | None = None,
        until_caught_up: bool = False,
        drain: bool = False,
        max_batches: int | None = None,
        on_batch: Callable[[BatchResult], None] | None = None,
        hand_over_wait_s: float = 0.0,
    ) -> list[BatchResult]:
        """Run batches until ``run_for_s`` passes (a lease), or until caught up: no new file, and the retries that
        were due have had one batch since the last new file. With ``drain``, until no retry is left at all.

        A lease ends right after a batch, once its term ends before the next trigger would. If a standby of the
        pipeline is still starting then (``PipelineState.successor``), it keeps joining, up to ``hand_over_wait_s``
        past its term, until the standby is ready: the caller then releases the pipeline and the standby takes over
        at once, instead of the pipeline waiting for a Spark start.

        Once per heartbeat period, between batches, the offset to the registry server's clock is measured again: a
        host whose clock drifted further than the maximum clock skew stops after its current batch and raises
        :class:`ClockSkewError`."""
        if self.lease is None:
            self.start()
        assert self.lease is not None
        with self.state.heartbeating(self.lease, self.s.heartbeat_s) as beat:
            results = self._loop(run_for_s, until_caught_up, drain, max_batches, on_batch, hand_over_wait_s, beat)
        if self.clock_error is not None:  # its batches are committed; the caller releases the lease and fails
            raise self.clock_error
        return results

    def _loop(
        self,
        run_for_s: float | None,
        until_caught_up: bool,
        drain: bool,
        max_batches: int | None,
        on_batch: Callable[[BatchResult], None] | None,
        hand_over_wait_s: float = 0.0,
        beat: Heartbeat | None = None,
    ) -> list[BatchResult]:
        lease = self.lease
        assert lease is not None
        deadline = time.monotonic() + run_for_s if run_for_s is not None else None
        self.term.reset()
        self.clock_error = None
        k = self.batches.last_batch
        results = []
        retried_since_files = False
        while True:
            t0 = time.monotonic()
            if beat is not None and beat.fenced is not None:  # idle, or it would have failed its next commit
                raise beat.fenced
            if self.stopping.is_set() or self._clock_off():
                break
            q_files, c_files = self.discovery.new_files()
            pending, due = self.batches.retry_counts()
            ran = False
            if q_files or c_files or self.discovery.changed:
                retried_since_files = False
                ran = True
            elif due and (drain or not until_caught_up or not retried_since_files):
                retried_since_files = True
                ran = True
            elif until_caught_up and (not drain or pending == 0):
                break
            if ran:
                k += 1
                results.append(self.batches.run_batch(lease, k, q_files, c_files))
                if on_batch:
                    on_batch(results[-1])
            elif beat is not None and beat.behind:  # idle, and the heartbeat found a newer configuration
                beat.behind = not self._acknowledge(lease)
            if self.stopping.is_set() or (max_batches is not None and len(results) >= max_batches):
                break  # a stop never holds on for a standby: the release hands over at once
            if deadline is not None and self.term.lease_over(t0, deadline, hand_over_wait_s):
                break
            if self.term.pause(t0 + self.s.trigger_interval_s, deadline, hand_over_wait_s):
                break
        return results

    clock_error: ClockSkewError | None = None  # why the last run() stopped early: this host's clock drifted off

    def _acknowledge(self, lease: Lease) -> bool:
        """An idle trigger acknowledges a newer shard configuration, as a batch commit would: a quiet data center
        must not hold up a reshard (``PipelineState.acknowledge``; here, in the loop thread, no batch is in flight).
        False if the registry could not be reached (the next idle trigger asks again)."""
        try:
            version = self.state.acknowledge(lease, self.batches.last_batch)
        except Exception as exc:
            log.debug("%s: cannot acknowledge the shard configuration: %s", self.pipeline, exc)
            return False
        if version is not None:
            log.info("%s: acknowledged shard configuration v%d (idle: between batches)", self.pipeline, version)
        return True

    def _clock_off(self) -> bool:
        """Between batches, once per heartbeat period: measure the offset to the server again; True (and
        ``clock_error`` set) if this host's clock has drifted past the bound, so the lease stops after the batch it
        ran. A registry that cannot be reached keeps the last offset (the batch itself will fail or wait)."""
        if time.monotonic() - self.clock.measured_at < self.s.heartbeat_s:
            return False
        try:
            self.clock.measure()
        except Exception as exc:
            log.warning("%s: cannot measure the registry server's clock: %s", self.pipeline, exc)
            return False
        try:
            self.clock.check()
        except ClockSkewError as exc:
            log.error("%s: %s", self.pipeline, exc)
            self.clock_error = exc
            return True
        return False


class Term:
    """How a lease's run ends: right after a batch, once its term ends before the next trigger would; or, while a
    standby of the pipeline is still starting (``PipelineState.successor``), up to ``wait_s`` past its term, as soon
    as the standby is ready."""

    def __init__(
        self, state: PipelineState, pipeline: str, trigger_interval_s: float, stopping: threading.Event | None = None
    ):
        self.state, self.pipeline, self.trigger_interval_s = state, pipeline, trigger_interval_s
        self.stopping = stopping or threading.Event()  # a stop ends the pause at once
        self.held_s = 0.0  # how long the last run went on past its term, waiting for a standby to be ready
        self.holding = False
        self._asking: Future[str | None] | None = None

    def reset(self) -> None:
        self.held_s, self.holding = 0.0, False

    def _successor(self, timeout_s: float) -> str | None:
        """``PipelineState.successor()``, waited for at most ``timeout_s`` (TimeoutError). The server's statement
        timeout bounds only what the server runs: a query it never gets or never answers (a connection dropped by
        the network, a stuck pooler, a frozen server, a hanging DNS lookup or connect) must not hold the lease past
        its bound. A question still unanswered is waited for again, never asked twice at once."""
        if self._asking is None or self._asking.done():
            asking: Future[str | None] = Future()

            def ask() -> None:
                try:
                    asking.set_result(self.state.successor())
                except BaseException as exc:
                    asking.set_exception(exc)

            threading.Thread(target=ask, name=f"photon-successor-{self.pipeline}", daemon=True).start()
            self._asking = asking
        return self._asking.result(timeout=max(0.0, timeout_s))

    def pause(self, next_at: float, deadline: float | None, wait_s: float) -> bool:
        """Sleep until the next trigger. While the lease holds on for a standby, ask every ``HOLD_POLL_S`` instead,
        and end it as soon as the standby is ready or the hold reaches its bound: a long trigger interval never
        stretches the hold, and no trigger starts past the bound (a batch begun before it still runs to its end)."""
        while (left := next_at - time.monotonic()) > 0:
            if not self.holding or deadline is None:
                return self.stopping.wait(left)
            if self.stopping.wait(min(HOLD_POLL_S, left)):
                return True
            if self.lease_over(next_at - self.trigger_interval_s, deadline, wait_s):
                return True
        return False

    def lease_over(self, t0: float, deadline: float, wait_s: float) -> bool:
        """After a trigger (``t0``): whether the lease ends now. Not before its term ends by the next trigger; then
        at once, unless a standby is still starting and the lease has held on for less than ``wait_s`` past its
        term (a ready standby takes over the moment the lease releases; with none coming, the next lease starts
        cold whenever the lease ends)."""
        now = time.monotonic()
        if max(now, t0 + self.trigger_interval_s) < deadline:
            return False
        if self.holding:  # only a hold counts: a batch that ends past the term is not one
            self.held_s = max(0.0, now - deadline)
        if wait_s <= 0 or now >= deadline + wait_s:
            return True
        try:
            successor = self._successor(min(SUCCESSOR_WAIT_S, deadline + wait_s - now))
        except Exception as exc:  # unreachable, or no answer in time: hold on (within the bound), and ask again
            if not self.holding:
                log.warning("%s: cannot tell whether a standby is coming: %s", self.pipeline, exc)
            successor = "starting"
        if successor != "starting":
            return True
        if not self.holding:
            log.info("%s: lease term over; joining on while a standby starts (up to %.0fs)", self.pipeline, wait_s)
            self.holding = True
        self.held_s = max(0.0, now - deadline)
        return False


def _when(us: int) -> str:
    """A time in a log line: UTC, to the second."""
    return datetime.fromtimestamp(us / US, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _check_state(state: Store, now_us: int, bucket_s: int) -> None:
    """Fail the lease at its start, naming the file, if an EventStore file the next batches read first is empty or
    truncated (a damaged disk), rather than failing every batch of every lease on it (the retry set is checked as
    it is read: ``BatchRunner.retry_files``)."""
    # The EventStore's newest minute, which the next lookups read first (named from the clock, not listed: the
    # store holds every bucket ever written). An older damaged file is named when a lookup reads it.
    newest = now_us // US // bucket_s
    for b in range(newest - max(1, 60 // bucket_s), newest + 1):
        for e in state.files(f"eventstore/bucket={b}"):
            if e.key.endswith(".parquet"):
                check_parquet(state.get(e.key), state.location(e.key), RECOVER_STORE)
            elif e.key.endswith(".arrow"):
                read_store_file(state, e.key)  # raises CorruptStateError naming it
