"""Resharding with timestamp-based configurations (Photon) and acknowledged desired state (Turbine).

The invariant: an id is registered only in the shard that the configuration in force at its own timestamp names.
A client routed with an older layout would put an id stamped at or after ``valid_from`` into an old shard, so every
server must refuse such clients before any such id can exist: before ``deadline = valid_from - max_clock_skew``,
measured by that server's own clock. The steps, each safe to crash after and to run again:

1. Plan: main takes version ``v`` (``photon.take_config_version``: a table lock serialises planners and the INSERT
   has no ON CONFLICT, so a version is taken exactly once and a second reshard is refused while a plan exists).
   ``valid_from = main's clock + lead`` and the deadline are stored with it. Every server records the plan and its
   shard map; the hosting servers create its shard tables. Routing ignores a planned configuration.
2. Acknowledge: joiners report the newest configuration they know with every batch commit
   (``photon.pipelines.config_version``), and an idle joiner (no batch to commit) between two batches, from its loop
   thread, fenced by its lease's epoch and last batch (``PipelineState.acknowledge``), once its heartbeat found a newer
   configuration (within a heartbeat period: well inside ``lead - skew``): a quiet data center never holds up a
   reshard. The reshard waits until every live pipeline reports ``v``. An acknowledgement is safe whenever it is
   taken because no id is routed by the acknowledgement: a client routes by the active configurations it loaded, and
   once a server enforces ``v`` (3a, 3b) it refuses a client on an older layout before anything is written (it
   reloads and routes by ``v``); a batch that routed by the old layout and registered before that did so before the
   deadline, when no id stamped at or after ``valid_from`` can exist yet. So a joiner that acknowledged ``v``, idle
   or not, registers nothing by the old layout once ``v`` is active.
3. Activate, holding main's plan row locked (``FOR UPDATE``: activation, resume and abort of ``v`` are serialised):
   a. main: ``photon.enforce_layout(v, activate)`` locks main's ``layout_enforced`` table (in-flight register
      transactions finish, new ones queue in order), checks main's clock against the deadline, raises the enforced
      version and marks ``v`` active: all uncommitted, so main's writers wait rather than being refused.
   b. every other server: ``photon.enforce_layout(v)`` the same way, each committed on its own before the deadline
      by that server's clock (or refused with ``ActivationDeadlineError``; ``lock_timeout`` bounds every wait).
   c. commit main: ``v`` is active and clients that reload the layout route by it. Only main's commit makes ``v``
      active, and it happens after every server enforces ``v``; a server that enforces ``v`` refuses clients on
      older layouts (``StaleLayoutError``), so a partial state (some servers enforcing, main not yet active) can
      refuse writes but never let an id into the wrong shard.
   d. mark ``v`` active on the other servers' copies (bookkeeping that lets each server refuse to abort it).
4. Or abort, when the acknowledgements or the activation miss the deadline: main marks ``v`` aborted under the row
   lock (refused if it is active), then each server withdraws its enforcement of ``v`` (no client ever routed with
   an unactivated ``v``) and drops the plan's shard tables, each only if the plan is still planned on that server
   and the table is empty (``photon.abort_plan``). An active configuration's tables are never dropped.

``resume(v)`` finishes after a crash: an active ``v`` gets step 3d; a planned one is activated if every live joiner
acknowledged it and its deadline allows, else aborted; an aborted one is cleaned up on every server. A new reshard
aborts a leftover plan whose deadline has passed (it can never be activated) before taking its version.

Every step's transactions run again on a fresh connection while their server is lost (``pg.across_failover``: a
multi-host DSN then finds the promoted standby), each safe to run twice (why is said where it runs): a COMMIT whose
answer was lost may have committed.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import psycopg2

from photon.pg import (
    RegistryUnavailableError,
    across_failover,
    autocommit,
    connect,
    is_connection_error,
    is_server_lost,
    sync_barrier,
)
from photon.registry.admin import _check_placement, _ordered, server_clock_us
from photon.registry.client import MAIN, RegistryError, _check_server_names

US = 1_000_000
DEADLINE_MISSED = "PH001"  # a server's clock is past the plan's activation deadline
IN_PROGRESS = "PH002"  # another plan exists
REFUSED = "PH003"  # the configuration is not in a state that allows this (e.g. active: never aborted)
LOCK_NOT_AVAILABLE = "55P03"  # lock_timeout


class ReshardError(RegistryError):
    """A reshard step was refused or could not complete."""


class ReshardInProgressError(ReshardError):
    """Another plan exists: one reshard at a time (the loser of two reshards started at once gets this)."""


class ActivationDeadlineError(ReshardError):
    """A server's clock passed the plan's activation deadline before it enforced the new layout."""


@dataclass
class ReshardReport:
    version: int
    num_shards: int
    valid_from_us: int
    state: str  # "active" or "aborted"
    acknowledged: dict[str, int] = field(default_factory=dict)  # live pipeline -> config version it reported
    waited_s: float = 0.0
    reason: str = ""
    activate_by_us: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Plan:
    version: int
    valid_from_us: int
    num_shards: int
    activate_by_us: int


def _error(exc: psycopg2.Error) -> ReshardError:
    msg = (getattr(exc, "pgerror", None) or str(exc)).strip().removeprefix("ERROR:").strip()
    code = str(getattr(exc, "pgcode", None) or "")
    kind = {DEADLINE_MISSED: ActivationDeadlineError, IN_PROGRESS: ReshardInProgressError}.get(code, ReshardError)
    return kind(msg)


def _live_acks(main: str, grace_s: float) -> dict[str, int]:
    def read() -> dict[str, int]:
        with autocommit(main) as conn, conn.cursor() as cur:
            cur.execute(
                "SELECT pipeline, config_version FROM photon.pipelines"
                " WHERE heartbeat_at > now() - make_interval(secs => %s)",
                (grace_s,),
            )
            return {str(p): int(v) for p, v in cur.fetchall()}

    return across_failover(read)  # a read


def _main_clock_us(servers: Mapping[str, str]) -> int:
    return across_failover(lambda: server_clock_us(servers[MAIN]))  # a read


def _raise_unless_lost(exc: psycopg2.Error) -> None:
    """A refusal becomes its ReshardError; a lost connection stays what it is, for across_failover to retry."""
    if not is_connection_error(exc):
        raise _error(exc) from exc


def _set_lock_timeout(cur: Any, lock_timeout_s: float) -> None:
    cur.execute("SELECT set_config('lock_timeout', %s, true)", (f"{int(lock_timeout_s * 1000)}ms",))


def plan(
    servers: Mapping[str, str],
    *,
    num_shards: int,
    placement: Sequence[str] | None = None,
    lead_s: float = 120.0,
    max_clock_skew_s: float = 10.0,
    now_us: int | None = None,
) -> Plan:
    """Step 1: take version ``v`` on main (exactly once), valid from main's clock + ``lead_s``; record the plan and
    its shard map on every server and create its shard tables. A leftover plan past its deadline is aborted first;
    a live one raises :class:`ReshardInProgressError`."""
    _check_server_names(servers)
    placement = _check_placement(servers, placement)
    if not 1 <= num_shards <= 4096:
        raise ValueError("num_shards must be in 1..4096")
    now = _main_clock_us(servers) if now_us is None else now_us
    valid_from = now + int(lead_s * US)
    activate_by = valid_from - int(max_clock_skew_s * US)
    tries: list[int] = []
    version = across_failover(lambda: _take_version(servers, valid_from, num_shards, activate_by, tries))
    shard_server = [placement[i % len(placement)] for i in range(num_shards)]
    for name in _ordered(servers):
        # Twice is once: copy_plan inserts ON CONFLICT DO NOTHING (and refuses a different row), create_shard
        # creates IF NOT EXISTS.
        across_failover(
            functools.partial(
                _copy_plan, servers[name], name, version, valid_from, num_shards, activate_by, shard_server
            )
        )
    return Plan(version, valid_from, num_shards, activate_by)


def _take_version(
    servers: Mapping[str, str], valid_from: int, num_shards: int, activate_by: int, tries: list[int]
) -> int:
    """Step 1 on main: take the plan's version. Run again after a failover (``tries`` counts the runs): a version
    that a COMMIT whose answer was lost did take is found by the plan's own valid_from, shard count and deadline
    (valid_from is main's clock to the microsecond plus the lead: no other plan has them) and is this plan's, rather
    than another reshard in progress. A first try never looks: a plan with the same values is someone else's."""
    tries.append(1)
    for attempt in range(2):
        try:
            with autocommit(servers[MAIN]) as conn, conn.cursor() as cur:
                if len(tries) > 1:
                    cur.execute(
                        "SELECT version FROM photon.shard_config WHERE state = 'planned' AND valid_from_us = %s"
                        " AND num_shards = %s AND activate_by_us = %s",
                        (valid_from, num_shards, activate_by),
                    )
                    row = cur.fetchone()
                    if row is not None:
                        return int(row[0])
                cur.execute("SELECT photon.take_config_version(%s, %s, %s)", (valid_from, num_shards, activate_by))
                return int(cur.fetchone()[0])
        except psycopg2.Error as exc:
            if is_connection_error(exc):
                raise  # across_failover's to retry
            err = _error(exc)
            if not isinstance(err, ReshardInProgressError) or attempt or not _abort_abandoned_plan(servers):
                raise err from exc
    raise AssertionError("unreachable")


def _copy_plan(
    dsn: str, name: str, version: int, valid_from: int, num_shards: int, activate_by: int, shard_server: list[str]
) -> None:
    with autocommit(dsn) as conn:
        conn.autocommit = False
        with conn.cursor() as cur:
            cur.execute(
                "SELECT photon.copy_plan(%s, %s, %s, %s, %s::text[])",
                (version, valid_from, num_shards, activate_by, shard_server),
            )
            for i, srv in enumerate(shard_server):
                if srv == name:
                    cur.execute("SELECT photon.create_shard(%s, %s)", (version, i))
        conn.commit()


def _abort_abandoned_plan(servers: Mapping[str, str]) -> bool:
    """Abort the planned configuration if main's clock is past its deadline (it can never be activated: a crashed
    reshard left it). True if one was aborted."""

    def read() -> Any:
        with autocommit(servers[MAIN]) as conn, conn.cursor() as cur:
            cur.execute(
                "SELECT version FROM photon.shard_config WHERE state = 'planned'"
                " AND activate_by_us <= photon.clock_us()"
            )
            return cur.fetchone()

    row = across_failover(read)  # a read
    if row is None:
        return False
    abort(servers, int(row[0]))
    return True


def activate(servers: Mapping[str, str], version: int, *, lock_timeout_s: float = 2.0) -> None:
    """Step 3, retried on lock timeouts and lost connections until the deadline; idempotent. Raises
    :class:`ActivationDeadlineError` if a server's clock passed the deadline first (the caller then aborts)."""
    while True:
        try:
            _activate_once(servers, version, lock_timeout_s)
            return
        except (psycopg2.Error, RegistryUnavailableError) as exc:
            retry = is_server_lost(exc)
            if isinstance(exc, psycopg2.Error) and not (retry or exc.pgcode == LOCK_NOT_AVAILABLE):
                raise _error(exc) from exc
            # Then _activate_once again, which twice is once: on main an active v goes straight to 3d, and a
            # server that enforces v already (in time: enforce_layout is its only writer) only gets the mark.
            activate_by, now = across_failover(functools.partial(_deadline_and_clock, servers[MAIN], version))
            if now >= activate_by:
                raise ActivationDeadlineError(f"v{version}: {exc}".strip()) from exc
            time.sleep(0.05)


def _deadline_and_clock(main: str, version: int) -> tuple[int, int]:
    """The plan's activation deadline and main's clock now (a read)."""
    with autocommit(main) as conn, conn.cursor() as cur:
        cur.execute("SELECT activate_by_us, photon.clock_us() FROM photon.shard_config WHERE version = %s", (version,))
        activate_by, now = cur.fetchone()
    return int(activate_by), int(now)


def _activate_once(servers: Mapping[str, str], version: int, lock_timeout_s: float) -> None:
    main = connect(servers[MAIN], application_name="photon-reshard")
    try:
        with main.cursor() as cur:
            _set_lock_timeout(cur, lock_timeout_s)
            cur.execute("SELECT state FROM photon.shard_config WHERE version = %s", (version,))
            row = cur.fetchone()
            if row is None or row[0] == "aborted":
                raise ReshardError(f"shard configuration v{version} is {row[0] if row else 'missing'}: not activated")
            if row[0] == "planned":
                # 3a. Main: lock the plan row (re-checked there) and the layout table (its writers wait), check its
                # clock, enforce and activate, uncommitted.
                cur.execute("SELECT photon.enforce_layout(%s, true)", (version,))
                # 3b. Every other server enforces v and commits, each before the deadline by its own clock.
                for name in _ordered(servers)[:-1]:
                    _enforce(servers[name], version, activate=False, lock_timeout_s=lock_timeout_s)
            else:
                # Found active (a retry after a lost or unreplicated answer): said so only once a standby holds it.
                sync_barrier(cur)
        main.commit()  # 3c. v is active.
    finally:
        main.close()
    # 3d. The copies on the other servers are marked active (enforcement is already in place everywhere).
    for name in _ordered(servers)[:-1]:
        _enforce(servers[name], version, activate=True, lock_timeout_s=lock_timeout_s)


def _enforce(dsn: str, version: int, *, activate: bool, lock_timeout_s: float) -> None:
    with autocommit(dsn, application_name="photon-reshard") as conn:
        conn.autocommit = False
        with conn.cursor() as cur:
            _set_lock_timeout(cur, lock_timeout_s)
            cur.execute("SELECT photon.enforce_layout(%s, %s)", (version, activate))
        conn.commit()


def abort(servers: Mapping[str, str], version: int, *, lock_timeout_s: float = 5.0) -> None:
    """Step 4: remove plan ``v``. Main decides first, under the plan row's lock: an active configuration is refused
    (:class:`ReshardError`), never dropped. Then every server withdraws its enforcement of ``v`` and drops the plan's
    empty shard tables; a server that fails is reported after the others were tried (run again to finish)."""
    # Twice is once, on every server: abort_plan leaves an aborted plan aborted, drops only tables still there,
    # withdraws an enforcement only while it is in place; back_to is read again from main's own rows.
    back_to = across_failover(functools.partial(_abort_on_main, servers[MAIN], version, lock_timeout_s))
    failed: dict[str, str] = {}
    for name in _ordered(servers)[:-1]:
        try:
            across_failover(functools.partial(_abort_on, servers[name], version, back_to, lock_timeout_s))
        except (psycopg2.Error, RegistryError, RegistryUnavailableError) as exc:
            failed[name] = str(exc).strip()
    if failed:
        raise ReshardError(f"v{version} is aborted on main; not yet removed from {failed}: run abort again")


def _abort_on_main(main: str, version: int, lock_timeout_s: float) -> int:
    """Main decides: plan ``version`` aborted, under its row lock; returns the version the servers go back to."""
    with autocommit(main, application_name="photon-reshard") as conn:
        conn.autocommit = False
        try:
            with conn.cursor() as cur:
                _set_lock_timeout(cur, lock_timeout_s)
                cur.execute(
                    "SELECT coalesce(max(version), 0) FROM photon.shard_config WHERE state = 'active' AND version < %s",
                    (version,),
                )
                back_to = int(cur.fetchone()[0])
                cur.execute("SELECT photon.abort_plan(%s, %s)", (version, back_to))
            conn.commit()
        except psycopg2.Error as exc:
            with contextlib.suppress(psycopg2.Error):  # a lost connection cannot roll back: its server did
                conn.rollback()
            _raise_unless_lost(exc)
            raise
    return back_to


def _abort_on(dsn: str, version: int, back_to: int, lock_timeout_s: float) -> None:
    with autocommit(dsn, application_name="photon-reshard") as conn:
        conn.autocommit = False
        with conn.cursor() as cur:
            _set_lock_timeout(cur, lock_timeout_s)
            cur.execute("SELECT photon.abort_plan(%s, %s)", (version, back_to))
        conn.commit()


def resume(servers: Mapping[str, str], version: int, *, grace_s: float = 60.0, lock_timeout_s: float = 2.0) -> str:
    """Finish configuration ``v`` after a crash, whatever step it stopped at; returns its state now."""

    def read() -> Any:
        with autocommit(servers[MAIN]) as conn, conn.cursor() as cur:
            cur.execute("SELECT state FROM photon.shard_config WHERE version = %s", (version,))
            row = cur.fetchone()
            sync_barrier(cur)  # acted on below, on other servers too: only a state a standby holds
            return row

    row = across_failover(read)  # a read
    if row is None:
        raise ReshardError(f"no shard configuration v{version}")
    state = str(row[0])
    if state == "planned":
        if all(v >= version for v in _live_acks(servers[MAIN], grace_s).values()):
            try:
                activate(servers, version, lock_timeout_s=lock_timeout_s)
                return "active"
            except ActivationDeadlineError:
                pass
        abort(servers, version)
        return "aborted"
    if state == "active":
        for name in _ordered(servers)[:-1]:  # 3d again: twice is once (the mark of an enforced, active v)
            across_failover(
                functools.partial(_enforce, servers[name], version, activate=True, lock_timeout_s=lock_timeout_s)
            )
    else:
        abort(servers, version)
    return state


def reshard(
    servers: Mapping[str, str],
    *,
    num_shards: int,
    placement: Sequence[str] | None = None,
    lead_s: float = 120.0,
    max_clock_skew_s: float = 10.0,
    grace_s: float = 60.0,
    poll_s: float = 0.5,
    now_us: int | None = None,
    lock_timeout_s: float = 2.0,
) -> ReshardReport:
    """Plan, wait for every live joiner's acknowledgement, then activate or abort (the steps are in the module's
    doc). Deadlines are measured by the registry servers' clocks, never by this host's."""
    if lead_s <= 2 * max_clock_skew_s:
        raise ValueError(
            f"lead {lead_s}s must exceed twice the maximum clock skew ({max_clock_skew_s}s): the joiners need time "
            "to acknowledge before the activation deadline (valid_from - skew)"
        )
    p = plan(
        servers,
        num_shards=num_shards,
        placement=placement,
        lead_s=lead_s,
        max_clock_skew_s=max_clock_skew_s,
        now_us=now_us,
    )
    report = ReshardReport(p.version, num_shards, p.valid_from_us, "planned", activate_by_us=p.activate_by_us)
    t0 = time.monotonic()
    while True:
        acks = _live_acks(servers[MAIN], grace_s)
        report.acknowledged = acks
        if all(v >= p.version for v in acks.values()):
            break
        if _main_clock_us(servers) + poll_s * US >= p.activate_by_us:
            report.waited_s = time.monotonic() - t0
            behind = sorted(name for name, v in acks.items() if v < p.version)
            return _abort(servers, report, f"not acknowledged before the deadline by: {', '.join(behind)}")
        time.sleep(poll_s)
    report.waited_s = time.monotonic() - t0
    try:
        activate(servers, p.version, lock_timeout_s=lock_timeout_s)
    except ActivationDeadlineError as exc:
        return _abort(servers, report, f"not activated before the deadline: {exc}")
    report.state = "active"
    return report


def _abort(servers: Mapping[str, str], report: ReshardReport, reason: str) -> ReshardReport:
    abort(servers, report.version)
    report.state, report.reason = "aborted", reason
    return report
