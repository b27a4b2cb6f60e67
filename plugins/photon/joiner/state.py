"""A pipeline's durable state on the registry's main server: leases with fencing epochs (DistributedLog), batch
commits keyed by pipeline and batch number (Pravega), the input files each batch consumed, per-batch metrics.

A lease takes a new epoch. A batch commits in one transaction that advances ``last_batch`` from k-1 to k only if
the lease's epoch is still current: a zombie lease that Airflow gave up on can never move the position or publish
a batch after its successor started. Committing batch k again with the same epoch is a no-op; committing out of
order is refused.

A standby (the next lease, started while the current one runs) announces itself in ``photon.standbys`` from its
process start: ``starting`` while it starts its Spark session and warms up, ``ready`` once it waits for its turn. A
lease whose term is over releases the pipeline at once if a standby is ready (or none is coming), and otherwise keeps
joining, for a bounded time, until the one that is starting is ready: the hand-over never waits for a Spark start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from psycopg2.extras import execute_values

from photon.joiner.common import BEGINNING, NOW, Start
from photon.logs.layout import part_of_name
from photon.logs.schemas import OUTPUT_KINDS
from photon.pg import across_failover, autocommit, connect, sync_barrier
from photon.registry.owners import Token

log = logging.getLogger(__name__)


class OpenBatch(NamedTuple):
    """A committed batch as a lease start sees it, with what its tasks reported staging (its committed metrics)."""

    batch: int
    epoch: int
    published: bool
    rows: dict[str, int]  # rows per output kind: what a publish of it must find staged (``publish_files``' expect)
    queries: int | None  # queries it indexed in its staged EventStore (None: no metrics)
    retried: int | None  # clicks its tasks wrote to its retry set


# A standby refreshes its announcement this often; one not refreshed for STANDBY_FRESH_S seconds (by the server's
# clock) died or was stopped, and a lease does not wait for it.
STANDBY_EVERY_S = 1.0
STANDBY_FRESH_S = 10.0
STANDBY_TIMEOUT_MS = 1000


def holder_name() -> str:
    """How a lease or a standby names its process: host:pid."""
    return f"{socket.gethostname()}:{os.getpid()}"


class FencedError(RuntimeError):
    """This lease's epoch is no longer current, or the batch is out of order: stop, commit nothing."""


@dataclass
class Heartbeat:
    """What a lease's heartbeat thread found: set once it finds the lease fenced (it stops beating then); whether a
    shard configuration newer than the one the pipeline acknowledged exists (an idle loop then acknowledges it)."""

    fenced: FencedError | None = None
    behind: bool = True  # until the first beat says otherwise: a lease's first idle trigger asks


@dataclass(frozen=True)
class Lease:
    pipeline: str
    epoch: int
    owner_id: int
    last_batch: int  # last committed batch when the lease started
    # Where the pipeline started reading, as recorded when it was created: epoch microseconds, or None for the
    # beginning of the logs (discovery.start_marks).
    start_us: int | None = None
    created: bool = False  # this lease created the pipeline (recorded its start)

    def token(self, batch_seq: int) -> Token:
        # The token names (pipeline, batch), not the lease: a lease that re-runs batch k after a crash finds the
        # ids its predecessor registered for k as its own (WON_AGAIN) and writes them, so nothing is lost.
        return Token(self.owner_id, batch_seq)


class StandbyAnnouncement:
    """What a standby announces (``PipelineState.standing_by``): ``starting`` until ``ready()``, which is announced
    at once."""

    def __init__(self) -> None:
        self.phase = "starting"
        self.stopped = False
        self.wake = threading.Event()
        self.announced = threading.Event()  # set once an announcement has reached the registry

    def ready(self) -> None:
        self.phase = "ready"
        self.wake.set()


class PipelineState:
    def __init__(self, main_dsn: str, pipeline: str):
        self.dsn = main_dsn
        self.pipeline = pipeline

    def start_lease(
        self,
        *,
        unless_live_within_s: float | None = None,
        overdue_after_s: float | None = None,
        start: Start = BEGINNING,
    ) -> Lease | None:
        # Again after a failover: a lease whose COMMIT was lost only fences itself (a new epoch, never used), and a
        # pipeline whose creation was lost is created again (its start, "now", read again: nothing consumed yet).
        return across_failover(lambda: self._start_lease(unless_live_within_s, overdue_after_s, start))

    def _start_lease(
        self, unless_live_within_s: float | None, overdue_after_s: float | None, start: Start
    ) -> Lease | None:
        """Take a new epoch (fencing the lease before). With ``unless_live_within_s``, only if no lease holds the
        pipeline with a heartbeat that recent (a standby must not fence the lease another standby just took):
        None if one does. With ``overdue_after_s`` too, a live lease that started longer ago than that is fenced
        all the same (it holds on past its term), but never one that started since: two standbys that both found
        one lease overdue fence it once, and the second finds the first one's fresh lease and waits for its term.
        Both decided by the server's clock, under the pipeline's lock. A pipeline created here records ``start``
        (``now``: the server's clock, in this transaction); an existing one keeps the start it was created with."""
        holder = holder_name()
        conn = connect(self.dsn, application_name=f"photon-join-{self.pipeline}")
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT pg_advisory_xact_lock(hashtext('photon.pipeline.' || %s))", (self.pipeline,))
                # The row first (a stalled lease's commit may hold it for long), then every time as of now, after
                # the waits (clock_timestamp(), not the transaction's start: a lease written as started before its
                # wait would be born stale, and the next standby would fence it at once).
                cur.execute("SELECT 1 FROM photon.pipelines WHERE pipeline = %s FOR UPDATE", (self.pipeline,))
                cur.execute(
                    "SELECT lease_owner IS NOT NULL AND clock_timestamp() - heartbeat_at <= make_interval(secs => %s)"
                    " AND (%s::float8 IS NULL OR clock_timestamp() - lease_started_at <= make_interval(secs => %s))"
                    " FROM photon.pipelines WHERE pipeline = %s",
                    (unless_live_within_s or 0.0, overdue_after_s, overdue_after_s or 0.0, self.pipeline),
                )
                row = cur.fetchone()
                if row is not None and unless_live_within_s is not None and row[0]:
                    conn.rollback()
                    return None
                if row is None:
                    cur.execute(
                        "INSERT INTO photon.owners (pipeline, host, pid, info) VALUES (%s, %s, %s, %s)"
                        " RETURNING owner_id",
                        (self.pipeline, socket.gethostname(), os.getpid(), '{"kind": "pipeline"}'),
                    )
                    owner_id = cur.fetchone()[0]
                    cur.execute(
                        "INSERT INTO photon.pipelines (pipeline, owner_id, start_us) VALUES (%s, %s,"
                        " CASE WHEN %s THEN photon.clock_us() ELSE %s::bigint END)",
                        (self.pipeline, owner_id, start == NOW, start if isinstance(start, int) else None),
                    )
                cur.execute(
                    "UPDATE photon.pipelines SET epoch = epoch + 1, lease_owner = %s,"
                    " lease_started_at = clock_timestamp(), heartbeat_at = clock_timestamp(), updated_at = now()"
                    " WHERE pipeline = %s"
                    " RETURNING epoch, owner_id, last_batch, start_us",
                    (holder, self.pipeline),
                )
                epoch, owner_id, last_batch, start_us = cur.fetchone()
            conn.commit()
        finally:
            conn.close()
        return Lease(
            self.pipeline,
            int(epoch),
            int(owner_id),
            int(last_batch),
            None if start_us is None else int(start_us),
            created=row is None,
        )

    def consumed(self, since: Mapping[str, str | None] | None = None) -> set[tuple[str, str]]:
        """(kind, file) consumed by this pipeline: of every kind, or only from partition ``since[kind]`` on (and the
        files directly in ``<kind>/``), which is what a lease still lists. Read again after a failover."""
        return across_failover(lambda: self._consumed(since))

    def _consumed(self, since: Mapping[str, str | None] | None) -> set[tuple[str, str]]:
        out: set[tuple[str, str]] = set()
        with autocommit(self.dsn) as conn, conn.cursor() as cur:
            for kind in ("queries", "clicks"):
                mark = (since or {}).get(kind)
                if mark is None:
                    cur.execute(
                        "SELECT name FROM photon.consumed_files WHERE pipeline = %s AND kind = %s",
                        (self.pipeline, kind),
                    )
                else:
                    cur.execute(
                        "SELECT name FROM photon.consumed_files WHERE pipeline = %s AND kind = %s"
                        " AND (part >= %s OR part IS NULL)",
                        (self.pipeline, kind, mark),
                    )
                out.update((kind, str(n)) for (n,) in cur.fetchall())
        return out

    def marks(self) -> dict[str, str | None]:
        """Per kind, the oldest partition the pipeline must still list, as its last batch recorded it."""
        return across_failover(self._marks)  # a read

    def _marks(self) -> dict[str, str | None]:
        with autocommit(self.dsn) as conn, conn.cursor() as cur:
            cur.execute(
                "SELECT b.queries_from, b.clicks_from FROM photon.pipelines p JOIN photon.batches b"
                " ON b.pipeline = p.pipeline AND b.batch_seq = p.last_batch WHERE p.pipeline = %s",
                (self.pipeline,),
            )
            row = cur.fetchone()
        return {"queries": row[0], "clicks": row[1]} if row else {"queries": None, "clicks": None}

    def open_batches(self) -> list[OpenBatch]:
        """The batches a lease start needs: the unpublished ones and the last one (whose retry set the next batch
        reads). Bounded, however many batches the pipeline has committed."""
        return across_failover(self._open_batches)  # a read

    def _open_batches(self) -> list[OpenBatch]:
        with autocommit(self.dsn) as conn, conn.cursor() as cur:
            cur.execute(
                "SELECT b.batch_seq, b.epoch, b.published, m.queries, m.retried, m.joined, m.unjoinable, m.quarantined"
                " FROM photon.batches b JOIN photon.pipelines p ON p.pipeline = b.pipeline"
                " LEFT JOIN photon.batch_metrics m ON m.pipeline = b.pipeline AND m.batch_seq = b.batch_seq"
                " WHERE b.pipeline = %s AND (NOT b.published OR b.batch_seq = p.last_batch) ORDER BY 1",
                (self.pipeline,),
            )
            return [
                OpenBatch(
                    int(b), int(e), bool(p),
                    {k: int(n) for k, n in zip(OUTPUT_KINDS, rows, strict=True) if n is not None},  # zeros too
                    None if q is None else int(q), None if r is None else int(r),
                )
                for b, e, p, q, r, *rows in cur.fetchall()
            ]  # fmt: skip

    def batches(self) -> list[tuple[int, int, bool]]:
        """(batch_seq, epoch, published) of every committed batch."""
        return across_failover(self._batches)  # a read

    def _batches(self) -> list[tuple[int, int, bool]]:
        with autocommit(self.dsn) as conn, conn.cursor() as cur:
            cur.execute(
                "SELECT batch_seq, epoch, published FROM photon.batches WHERE pipeline = %s ORDER BY 1",
                (self.pipeline,),
            )
            return [(int(b), int(e), bool(p)) for b, e, p in cur.fetchall()]

    def commit(
        self,
        lease: Lease,
        batch_seq: int,
        files: Iterable[tuple[str, str]],
        metrics: Mapping[str, Any] | None = None,
        config_version: int | None = None,
        marks: Mapping[str, str | None] | None = None,
    ) -> bool:
        """Commit batch ``batch_seq`` and acknowledge shard configuration ``config_version`` (by default the newest
        one planned or active, read in the same transaction). True if this call committed it, False if it was already
        committed by this epoch. Raises FencedError if the epoch was superseded
        or the batch is out of order. Run again after a failover: a COMMIT whose answer was lost is found committed
        by this epoch (False)."""
        files = list(files)  # read again by a second try
        return across_failover(lambda: self._commit(lease, batch_seq, files, metrics, config_version, marks))

    def _commit(
        self,
        lease: Lease,
        batch_seq: int,
        files: Iterable[tuple[str, str]],
        metrics: Mapping[str, Any] | None,
        config_version: int | None,
        marks: Mapping[str, str | None] | None,
    ) -> bool:
        conn = connect(self.dsn, application_name=f"photon-join-{self.pipeline}")
        try:
            with conn.cursor() as cur:
                cur.execute(
                    "UPDATE photon.pipelines SET last_batch = %s, heartbeat_at = now(), updated_at = now(),"
                    " config_version = greatest(config_version, coalesce(%s, (SELECT max(version)"
                    "  FROM photon.shard_config WHERE state IN ('planned', 'active'))))"
                    " WHERE pipeline = %s AND epoch = %s AND last_batch = %s",
                    (batch_seq, config_version, self.pipeline, lease.epoch, batch_seq - 1),
                )
                if cur.rowcount == 0:
                    cur.execute(
                        "SELECT epoch, last_batch, lease_owner FROM photon.pipelines WHERE pipeline = %s",
                        (self.pipeline,),
                    )
                    epoch, last, holder = cur.fetchone()
                    conn.rollback()
                    if epoch != lease.epoch:
                        raise FencedError(_superseded(self.pipeline, lease.epoch, epoch, holder))
                    if last >= batch_seq and self._committed_by(batch_seq, lease.epoch):
                        return False
                    raise FencedError(f"{self.pipeline}: batch {batch_seq} out of order (last committed {last})")
                cur.execute(
                    "INSERT INTO photon.batches (pipeline, batch_seq, epoch, owner_id, queries_from, clicks_from)"
                    " VALUES (%s, %s, %s, %s, %s, %s)",
                    (
                        self.pipeline,
                        batch_seq,
                        lease.epoch,
                        lease.owner_id,
                        (marks or {}).get("queries"),
                        (marks or {}).get("clicks"),
                    ),
                )
                execute_values(
                    cur,
                    "INSERT INTO photon.consumed_files (pipeline, kind, name, batch_seq, part) VALUES %s",
                    [(self.pipeline, k, n, batch_seq, part_of_name(n)) for k, n in files],
                    page_size=1000,
                )
                if metrics:
                    cols = list(metrics)
                    cur.execute(
                        f"INSERT INTO photon.batch_metrics (pipeline, batch_seq, epoch, {', '.join(cols)})"
                        f" VALUES (%s, %s, %s, {', '.join(['%s'] * len(cols))})",
                        (self.pipeline, batch_seq, lease.epoch, *[metrics[c] for c in cols]),
                    )
            conn.commit()
            return True
        finally:
            conn.close()

    def _committed_by(self, batch_seq: int, epoch: int) -> bool:
        with autocommit(self.dsn) as conn, conn.cursor() as cur:
            cur.execute(
                "SELECT epoch FROM photon.batches WHERE pipeline = %s AND batch_seq = %s", (self.pipeline, batch_seq)
            )
            row = cur.fetchone()
            if row is not None:
                sync_barrier(cur)  # "committed already" only once a standby holds that commit (pg.py says why)
            return row is not None and int(row[0]) == epoch

    def acknowledge(self, lease: Lease, last_batch: int) -> int | None:
        """An idle lease acknowledges the newest shard configuration (planned or active) without a batch: the
        version it acknowledged now, or None if there was nothing newer to acknowledge. Called from the lease's
        loop thread between batches only, so no batch of this lease is in flight: one that routed its ids earlier
        has committed (or failed) already, and the next one starts after this. Fenced as a batch commit is: only while
        ``lease.epoch`` is current and the pipeline's last batch is still ``last_batch`` (a successor lease acknowledges
        for itself). Why an acknowledgement is safe at all is said in ``photon.registry.reshard`` (step 2)."""
        with autocommit(self.dsn) as conn, conn.cursor() as cur:
            # Writes only when there is something newer: an idle joiner asks once per trigger, and a row updated for
            # nothing would cost a replicated commit every second.
            cur.execute(
                "UPDATE photon.pipelines p SET config_version = c.newest, heartbeat_at = now(), updated_at = now()"
                " FROM (SELECT max(version) AS newest FROM photon.shard_config WHERE state IN ('planned', 'active')) c"
                " WHERE p.pipeline = %s AND p.epoch = %s AND p.last_batch = %s AND p.config_version < c.newest"
                " RETURNING p.config_version",
                (self.pipeline, lease.epoch, last_batch),
            )
            row = cur.fetchone()
        return None if row is None else int(row[0])

    def mark_published(self, batch_seq: int) -> None:
        # Again after a failover: setting published twice is setting it once.
        across_failover(lambda: self._mark_published(batch_seq))

    def _mark_published(self, batch_seq: int) -> None:
        with autocommit(self.dsn) as conn, conn.cursor() as cur:
            cur.execute(
                "UPDATE photon.batches SET published = true WHERE pipeline = %s AND batch_seq = %s",
                (self.pipeline, batch_seq),
            )

    @contextlib.contextmanager
    def heartbeating(self, lease: Lease, every_s: float) -> Iterator[Heartbeat]:
        """Heartbeat every ``every_s`` seconds while the block runs, idle or in a long batch: the verifier fences a
        pipeline only after a grace period without one, so a live joiner is never taken for a gone one. The thread
        stops at the block's end or once the lease is superseded (``Heartbeat.fenced`` then says by whom, for the
        loop to stop on); a registry that cannot be reached is retried."""
        stop = threading.Event()
        state = Heartbeat()

        def beat() -> None:
            while not stop.wait(every_s):
                try:
                    # One try: the next beat is the retry (and the block's end never waits).
                    state.behind = self._heartbeat(lease) or state.behind
                except FencedError as exc:
                    state.fenced = exc
                    return
                except Exception as exc:  # the registry is down: the next beat tries again
                    log.warning("%s: heartbeat failed: %s", self.pipeline, exc)

        thread = threading.Thread(target=beat, name=f"photon-heartbeat-{self.pipeline}", daemon=True)
        thread.start()
        try:
            yield state
        finally:
            stop.set()
            thread.join(timeout=10)

    def release(self, lease: Lease) -> None:
        """The lease is done (its last batch committed and published): a standby waiting for its turn takes over now,
        not after a heartbeat goes stale. A no-op if another lease has taken over already."""
        # Again after a failover: it clears the holder only while this lease's epoch is current, twice as once.
        across_failover(lambda: self._release(lease))

    def _release(self, lease: Lease) -> None:
        with autocommit(self.dsn) as conn, conn.cursor() as cur:
            cur.execute(
                "UPDATE photon.pipelines SET lease_owner = NULL, updated_at = now() WHERE pipeline = %s AND epoch = %s",
                (self.pipeline, lease.epoch),
            )

    def wait_for_turn(self, *, stale_s: float, timeout_s: float, poll_s: float = 0.05) -> str:
        """Block until no live lease holds the pipeline, and say why it is free: ``new`` (never leased),
        ``released`` (its lease ended), ``stale`` (no heartbeat for ``stale_s``: it died), or ``timeout`` (the
        current lease started more than ``timeout_s`` ago and holds on: the lease that starts now fences it). Both
        measured by the server's clock from the current lease's own heartbeat and start, so a lease that another
        standby has just taken gets its whole term. Waits on after a failover (it only reads)."""
        return across_failover(lambda: self._wait_for_turn(stale_s, timeout_s, poll_s))

    def _wait_for_turn(self, stale_s: float, timeout_s: float, poll_s: float) -> str:
        with autocommit(self.dsn, application_name=f"photon-standby-{self.pipeline}") as conn, conn.cursor() as cur:
            while True:
                cur.execute(
                    "SELECT lease_owner IS NULL, extract(epoch FROM now() - heartbeat_at),"
                    " extract(epoch FROM now() - lease_started_at) FROM photon.pipelines WHERE pipeline = %s",
                    (self.pipeline,),
                )
                row = cur.fetchone()
                if row is None:
                    return "new"
                if row[0]:
                    return "released"
                if row[1] is not None and float(row[1]) > stale_s:
                    return "stale"
                if row[2] is not None and float(row[2]) > timeout_s:
                    return "timeout"
                time.sleep(poll_s)

    # standbys ------------------------------------------------------------------------------------------------
    # Every call here is bounded (STANDBY_TIMEOUT_MS per statement and lock wait, a short connect timeout): the
    # announcements only ever shorten a gap, so a locked table or a slow registry must never hold up a standby's
    # start or a lease's end.
    def _standby_conn(self) -> contextlib.AbstractContextManager[Any]:
        return autocommit(
            self.dsn,
            application_name=f"photon-standby-{self.pipeline}",
            connect_timeout=2,
            statement_timeout_ms=STANDBY_TIMEOUT_MS,
        )

    def announce_standby(self, phase: str, holder: str | None = None, conn: Any = None) -> None:
        """Say that a standby of this pipeline is ``starting`` or ``ready`` (waiting for its turn), as of now."""
        with contextlib.ExitStack() as stack:
            conn = conn or stack.enter_context(self._standby_conn())
            with conn.cursor() as cur:
                cur.execute(
                    "SELECT photon.announce_standby(%s, %s, %s)", (self.pipeline, holder or holder_name(), phase)
                )

    def withdraw_standby(self, holder: str | None = None, conn: Any = None) -> None:
        """This standby took over, or gave up: it is nobody's successor any more."""
        with contextlib.ExitStack() as stack:
            conn = conn or stack.enter_context(self._standby_conn())
            with conn.cursor() as cur:
                cur.execute("SELECT photon.withdraw_standby(%s, %s)", (self.pipeline, holder or holder_name()))

    def successor(self, fresh_s: float = STANDBY_FRESH_S) -> str | None:
        """The most advanced live standby's phase: ``ready`` if one waits for its turn, else ``starting`` if one is
        starting, else None. Live: announced within ``fresh_s`` seconds, by the server's clock."""
        with self._standby_conn() as conn, conn.cursor() as cur:
            cur.execute(
                "SELECT phase FROM photon.standbys"
                " WHERE pipeline = %s AND seen_at >= now() - make_interval(secs => %s)",
                (self.pipeline, fresh_s),
            )
            phases = {str(p) for (p,) in cur.fetchall()}
        return "ready" if "ready" in phases else "starting" if phases else None

    @contextlib.contextmanager
    def standing_by(self, every_s: float = STANDBY_EVERY_S) -> Iterator[StandbyAnnouncement]:
        """A standby's whole wait, from its process start to its take-over: announced ``starting`` at once, then
        every ``every_s`` seconds in the phase the block sets (``announcement.ready()``), and withdrawn at the end.
        All of it runs in a thread: neither entering nor leaving the block waits for the registry (a registry that
        cannot be reached is retried at the next beat; a withdrawal that fails leaves a row that goes stale)."""
        announcement = StandbyAnnouncement()
        holder = holder_name()

        def beat() -> None:
            with contextlib.ExitStack() as stack:
                conn = None
                while not announcement.stopped:
                    try:
                        conn = conn or stack.enter_context(self._standby_conn())
                        self.announce_standby(announcement.phase, holder, conn)
                        announcement.announced.set()
                    except Exception as exc:  # the next beat tries again, on a new connection
                        log.warning("%s: standby announcement failed: %s", self.pipeline, exc)
                        stack.close()
                        conn = None
                    announcement.wake.wait(every_s)
                    announcement.wake.clear()  # a phase set from here on is announced at the next beat, at once
                try:
                    self.withdraw_standby(holder, conn)
                except Exception as exc:  # its row goes stale within seconds anyway
                    log.warning("%s: standby withdrawal failed: %s", self.pipeline, exc)

        thread = threading.Thread(target=beat, name=f"photon-standby-{self.pipeline}", daemon=True)
        thread.start()
        try:
            yield announcement
        finally:
            announcement.stopped = True
            announcement.wake.set()
            thread.join(timeout=1.0)  # the withdrawal, usually in milliseconds; never long after a take-over

    def heartbeat(self, lease: Lease) -> None:
        # Again after a failover: a beat twice is a beat (FencedError is not retried: the lease is over).
        across_failover(lambda: self._heartbeat(lease))

    def _heartbeat(self, lease: Lease) -> bool:
        """One beat; True if a shard configuration newer than the one the pipeline acknowledged exists (planned or
        active), asked here so that an idle lease asks nothing more of the registry until one does."""
        with autocommit(self.dsn) as conn, conn.cursor() as cur:
            cur.execute(
                "UPDATE photon.pipelines SET heartbeat_at = now() WHERE pipeline = %s AND epoch = %s"
                " RETURNING config_version < (SELECT coalesce(max(version), 0) FROM photon.shard_config"
                "  WHERE state IN ('planned', 'active'))",
                (self.pipeline, lease.epoch),
            )
            row = cur.fetchone()
            if row is None:
                cur.execute("SELECT epoch, lease_owner FROM photon.pipelines WHERE pipeline = %s", (self.pipeline,))
                row = cur.fetchone()
                raise FencedError(_superseded(self.pipeline, lease.epoch, *(row or (None, None))))
            return bool(row[0])


def _superseded(pipeline: str, epoch: int, by_epoch: int | None, by_holder: str | None) -> str:
    """What a fenced lease says: which lease fenced it, as far as the registry knows."""
    if by_holder:
        return f"{pipeline}: lease epoch {epoch} was fenced by lease epoch {by_epoch}, held by {by_holder}"
    # The verifier fences a pipeline it took for gone without taking a lease; or the lease that fenced it ended.
    return f"{pipeline}: lease epoch {epoch} was fenced: the pipeline is at epoch {by_epoch}, held by no lease now"
