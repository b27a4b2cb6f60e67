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
   (``photon.pipelines.config_version``); the reshard waits until every live pipeline reports ``v``.
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
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import psycopg2

from photon.pg import RegistryUnavailableError, autocommit, connect, is_connection_error
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
    with autocommit(main) as conn, conn.cursor() as cur:
        cur.execute(
            "SELECT pipeline, config_version FROM photon.pipelines"
            " WHERE heartbeat_at > now() - make_interval(secs => %s)",
            (grace_s,),
        )
        return {str(p): int(v) for p, v in cur.fetchall()}


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
    now = server_clock_us(servers[MAIN]) if now_us is None else now_us
    valid_from = now + int(lead_s * US)
    activate_by = valid_from - int(max_clock_skew_s * US)
    for attempt in range(2):
        try:
            with autocommit(servers[MAIN]) as conn, conn.cursor() as cur:
                cur.execute("SELECT photon.take_config_version(%s, %s, %s)", (valid_from, num_shards, activate_by))
                version = int(cur.fetchone()[0])
            break
        except psycopg2.Error as exc:
            err = _error(exc)
            if not isinstance(err, ReshardInProgressError) or attempt or not _abort_abandoned_plan(servers):
                raise err from exc
    shard_server = [placement[i % len(placement)] for i in range(num_shards)]
    for name in _ordered(servers):
        with autocommit(servers[name]) as conn:
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
    return Plan(version, valid_from, num_shards, activate_by)


def _abort_abandoned_plan(servers: Mapping[str, str]) -> bool:
    """Abort the planned configuration if main's clock is past its deadline (it can never be activated: a crashed
    reshard left it). True if one was aborted."""
    with autocommit(servers[MAIN]) as conn, conn.cursor() as cur:
        cur.execute(
            "SELECT version FROM photon.shard_config WHERE state = 'planned' AND activate_by_us <= photon.clock_us()"
        )
        row = cur.fetchone()
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
            retry = isinstance(exc, RegistryUnavailableError) or is_connection_error(exc)
            if isinstance(exc, psycopg2.Error) and not (retry or exc.pgcode == LOCK_NOT_AVAILABLE):
                raise _error(exc) from exc
            with autocommit(servers[MAIN]) as conn, conn.cursor() as cur:  # past the deadline? main's clock says
                cur.execute(
                    "SELECT activate_by_us, photon.clock_us() FROM photon.shard_config WHERE version = %s", (version,)
                )
                activate_by, now = cur.fetchone()
            if now >= activate_by:
                raise ActivationDeadlineError(f"v{version}: {exc}".strip()) from exc
            time.sleep(0.05)


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
    with autocommit(servers[MAIN], application_name="photon-reshard") as conn:
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
            conn.rollback()
            raise _error(exc) from exc
    failed: dict[str, str] = {}
    for name in _ordered(servers)[:-1]:
        try:
            with autocommit(servers[name], application_name="photon-reshard") as conn:
                conn.autocommit = False
                with conn.cursor() as cur:
                    _set_lock_timeout(cur, lock_timeout_s)
                    cur.execute("SELECT photon.abort_plan(%s, %s)", (version, back_to))
                conn.commit()
        except (psycopg2.Error, RegistryError) as exc:
            failed[name] = str(exc).strip()
    if failed:
        raise ReshardError(f"v{version} is aborted on main; not yet removed from {failed}: run abort again")


def resume(servers: Mapping[str, str], version: int, *, grace_s: float = 60.0, lock_timeout_s: float = 2.0) -> str:
    """Finish configuration ``v`` after a crash, whatever step it stopped at; returns its state now."""
    with autocommit(servers[MAIN]) as conn, conn.cursor() as cur:
        cur.execute("SELECT state FROM photon.shard_config WHERE version = %s", (version,))
        row = cur.fetchone()
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
        for name in _ordered(servers)[:-1]:
            _enforce(servers[name], version, activate=True, lock_timeout_s=lock_timeout_s)
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
        if server_clock_us(servers[MAIN]) + poll_s * US >= p.activate_by_us:
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
