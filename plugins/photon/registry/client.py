"""The IdRegistry client: ``register`` (who owns each id) and ``lookup`` (the dispatcher's pre-filter).

One SERIALIZABLE transaction per shard per batch, shards in parallel. Inside it the shard's GC threshold row is
locked FOR SHARE (a GC run moving it waits for us; if it moved after our snapshot we fail with 40001 and retry),
ids below it are answered TOO_OLD, and the rest are written one of two ways:

- fast path: a binary COPY straight into the shard under a savepoint. It succeeds only if every id is new (the
  common case after the dispatcher's pre-filter); a single id already there fails it with a unique violation, the
  savepoint is rolled back and the batch takes the conditional path. A shard whose last batch met ids already
  registered skips the fast path for its next batch.
- conditional path: the batch goes to a temp table by binary COPY, then one ``INSERT ... SELECT ... ON CONFLICT DO
  NOTHING`` whose CTEs also read the rows that were there before, with their tokens.

Correctness rests on the unique key either way: a key present with another token is LOST; with our own token it
is WON_AGAIN (a retry after an unknown commit outcome). Whole transactions are retried on 40001/40P01 and on lost
connections (including a COMMIT whose answer never came, or came with the warning that its wait for a standby was
cancelled: the retry re-reads), with capped, jittered backoff.

Acknowledged means replicated: an answer that rests on rows this transaction did not write (WON_AGAIN, LOST, TOO_OLD,
a lookup's hit) is given only after a COMMIT that waited for a synchronous standby (pg.sync_barrier), because a
cancelled wait leaves rows visible on the primary that a failover forgets (README, "Acknowledged means replicated").
"""

from __future__ import annotations

import contextlib
import io
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import numpy as np
import psycopg2.errors
import pyarrow as pa
from psycopg2.extensions import ISOLATION_LEVEL_SERIALIZABLE
from tenacity import RetryCallState, Retrying, retry_if_exception, wait_random_exponential

from photon.logs.ids import EventKeys, InvalidEventIdError
from photon.pg import (
    RegistryUnavailableError,
    UnsafeReplicationError,
    across_failover,
    autocommit,
    check_replication,
    connect,
    is_connection_error,
    is_server_lost,
    is_transient,
    redact,
    sync_barrier,
)
from photon.pg import failover_s as default_failover_s
from photon.registry import sql as q
from photon.registry.owners import Token
from photon.registry.sharding import SERVER_NAME_RE, ShardConfig, ShardLayout, ShardRef
from photon.settings import MAX_FUTURE_S, Settings, load_settings

log = logging.getLogger(__name__)

MAIN = "main"


class Outcome(IntEnum):
    WON = 0  # newly registered with our token
    WON_AGAIN = 1  # already registered with our token: a retry of ours
    LOST = 2  # registered by another token (or committed and its token cleared)
    TOO_OLD = 3  # older than the shard's GC threshold: refused


class RegistryError(RuntimeError):
    pass


class RegistryInvariantError(RegistryError):
    """The database answered something that cannot happen; the transaction was rolled back."""


class StaleLayoutError(RegistryError):
    """The shard's server enforces a newer shard configuration than the client routed with: nothing was written.
    The client reloads the layout and routes again (unless told not to follow layout changes)."""

    def __init__(self, shard: ShardRef, client_version: int, server_version: int):
        self.shard, self.client_version, self.server_version = shard, client_version, server_version
        super().__init__(
            f"shard {shard}: routed with shard configuration v{client_version}, the server enforces v{server_version}"
        )


class PartialRegistrationError(RegistryError):
    """Some shards committed, others failed. The committed shards hold this batch's token: retrying the batch with
    the same token completes it (their ids come back ``WON_AGAIN``); otherwise the verifier recovers them."""

    def __init__(self, committed: list[ShardRef], failed: dict[ShardRef, BaseException]):
        self.committed = committed
        self.failed = failed
        first = next(iter(failed.values()))
        super().__init__(
            f"registration failed on {len(failed)} shard(s) ({', '.join(map(str, failed))}) after "
            f"{len(committed)} committed: {first}"
        )


@dataclass(frozen=True)
class RegistryOptions:
    max_attempts: int = 12  # whole-transaction attempts per shard and batch on 40001/40P01
    # A lost server is retried (whole transactions, a multi-host DSN finding the new primary) this long: a failover
    # takes Patroni's ttl plus the promotion (PHOTON_REGISTRY_FAILOVER_S). Before issue 21 the only bound was
    # max_attempts, about 5 s of backoff: a failover failed the batch.
    failover_s: float = field(default_factory=default_failover_s)
    backoff_base_s: float = 0.02
    backoff_max_s: float = 2.0
    connect_attempts: int = 3
    max_parallel: int = 8  # shards registered at once
    max_future_s: float = MAX_FUTURE_S  # the joiner refuses such clicks at its door with the same bound
    application_name: str = "photon-registry"
    fast_path: bool = True  # try the all-new bulk COPY first; False: always the conditional INSERT
    follow_layout: bool = True  # on StaleLayoutError reload the shard configuration and route again


@dataclass(frozen=True)
class ShardStats:
    shard: ShardRef
    server: str
    rows: int  # distinct ids sent to this shard
    inserted: int  # rows this transaction inserted
    attempts: int  # transactions tried (1 = no retry)
    seconds: float
    partitions_created: int = 0


@dataclass
class RegisterResult:
    keys: EventKeys
    outcomes: np.ndarray  # int8 Outcome per input id, in input order
    shards: list[ShardStats] = field(default_factory=list)

    def mask(self, *outcomes: Outcome) -> np.ndarray:
        return np.isin(self.outcomes, np.array([int(o) for o in outcomes], dtype=np.int8))

    @property
    def ours(self) -> np.ndarray:
        """Ids this token owns (newly or again): the rows to write to output."""
        return self.mask(Outcome.WON, Outcome.WON_AGAIN)

    def counts(self) -> dict[str, int]:
        binc = np.bincount(self.outcomes.astype(np.int64), minlength=len(Outcome))
        return {o.name.lower(): int(binc[o]) for o in Outcome}

    def ids(self, *outcomes: Outcome) -> list[str]:
        return self.keys.take(np.flatnonzero(self.mask(*outcomes))).to_ids()

    @property
    def retries(self) -> int:
        return sum(s.attempts - 1 for s in self.shards)

    @property
    def rows_per_transaction(self) -> float:
        return sum(s.rows for s in self.shards) / max(1, sum(s.attempts for s in self.shards))


@dataclass
class LookupResult:
    keys: EventKeys
    registered: np.ndarray  # bool per input id
    tokens: np.ndarray  # int64 token value, 0 where unregistered or where the token was cleared
    too_old: np.ndarray  # bool: below the shard's GC threshold (the registry would refuse it)


def servers_from_settings(settings: Settings | None = None) -> dict[str, str]:
    """Server name -> DSN: ``main`` from PHOTON_REGISTRY_DSN (or the embedded server), others from
    PHOTON_REGISTRY_SERVERS."""
    from photon.pg import embedded_dsn

    settings = settings or load_settings()
    servers = {MAIN: settings.registry_dsn or embedded_dsn(settings.home)}
    for name, dsn in settings.registry_servers.items():
        if name == MAIN:
            raise ValueError("PHOTON_REGISTRY_SERVERS cannot redefine 'main'; set PHOTON_REGISTRY_DSN")
        servers[name] = dsn
    return servers


def _check_server_names(servers: Mapping[str, str]) -> None:
    if MAIN not in servers:
        raise ValueError("the registry needs a server named 'main'")
    for name in servers:
        if not SERVER_NAME_RE.match(name):
            raise ValueError(f"invalid registry server name {name!r} (lowercase letters, digits, underscore)")


def encode_copy(*columns: np.ndarray) -> bytes:
    """PostgreSQL binary COPY of int4/int8 columns, built as one numpy record array (no per-row Python)."""
    fields: list[tuple[str, str]] = [("n", ">i2")]
    for k, col in enumerate(columns):
        if col.dtype not in (np.int32, np.int64):
            raise TypeError("binary COPY columns must be int32 or int64")
        fields += [(f"l{k}", ">i4"), (f"v{k}", ">i4" if col.dtype == np.int32 else ">i8")]
    rec = np.empty(len(columns[0]), dtype=np.dtype(fields))
    rec["n"] = len(columns)
    for k, col in enumerate(columns):
        rec[f"l{k}"] = col.dtype.itemsize
        rec[f"v{k}"] = col
    return b"PGCOPY\n\xff\r\n\x00" + b"\x00" * 8 + rec.tobytes() + b"\xff\xff"


def _refuse(keys: EventKeys, bad: np.ndarray, why: Any) -> None:
    """Raise InvalidEventIdError for the ids at positions ``bad`` (if any), showing the first five."""
    if len(bad):
        shown = keys.take(bad[:5]).to_ids()
        raise InvalidEventIdError([(int(p), i, why(p)) for p, i in zip(bad[:5].tolist(), shown, strict=True)], len(bad))


def dedup(keys: EventKeys) -> tuple[np.ndarray, np.ndarray]:
    """(positions of the distinct keys in key order, index of each input's distinct key)."""
    order = np.lexsort((keys.src, keys.ts_us))
    ts, src = keys.ts_us[order], keys.src[order]
    first = np.ones(len(order), dtype=bool)
    first[1:] = (ts[1:] != ts[:-1]) | (src[1:] != src[:-1])
    inverse = np.empty(len(order), dtype=np.int64)
    inverse[order] = np.cumsum(first) - 1
    return order[first], inverse


class IdRegistry:
    """Client of a sharded IdRegistry. Not thread-safe: use one per thread or process (it parallelises shards
    itself). Connections are kept per shard and reused across batches."""

    def __init__(self, servers: Mapping[str, str], options: RegistryOptions | None = None):
        _check_server_names(servers)
        self.servers = dict(servers)
        self.options = options or RegistryOptions()
        self._layout: ShardLayout | None = None
        self._width: int | None = None
        self._conns: dict[ShardRef, Any] = {}
        self._partitions: dict[ShardRef, set[int]] = {}
        # Shards whose last batch met ids already registered: their next batch skips the fast path.
        self._conflicted: dict[ShardRef, bool] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=self.options.max_parallel, thread_name_prefix="photon-reg")

    @classmethod
    def from_settings(cls, settings: Settings | None = None, **options: Any) -> IdRegistry:
        settings = settings or load_settings()
        options.setdefault("max_future_s", settings.max_future_s)
        options.setdefault("failover_s", settings.registry_failover_s)
        return cls(servers_from_settings(settings), RegistryOptions(**options))

    @property
    def main_dsn(self) -> str:
        return self.servers[MAIN]

    def __enter__(self) -> IdRegistry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()

    # -- configuration ---------------------------------------------------------------------------------------
    def layout(self, refresh: bool = False) -> ShardLayout:
        if self._layout is None or refresh:
            # A read, safe to repeat: a client that first needs it during a failover waits like a batch does.
            self._layout, self._width = across_failover(
                lambda: read_layout(self.main_dsn), budget_s=self.options.failover_s
            )
            unknown = {s for s in self._layout.placement.values() if s not in self.servers}
            if unknown:
                raise RegistryError(
                    f"the shard map places shards on {sorted(unknown)}, which this process has no DSN for: "
                    "set PHOTON_REGISTRY_SERVERS"
                )
        return self._layout

    @property
    def partition_width_us(self) -> int:
        self.layout()
        assert self._width is not None
        return self._width

    # -- register --------------------------------------------------------------------------------------------
    def register(
        self,
        ids: EventKeys | Iterable[object] | pa.Array,
        token: Token,
        *,
        times: Sequence[int] | np.ndarray | None = None,
        now_us: int | None = None,
    ) -> RegisterResult:
        """Register ids under ``token``; one :class:`Outcome` per input id. Invalid input raises before anything
        is written."""
        keys = ids if isinstance(ids, EventKeys) else EventKeys.from_ids(ids)
        self._validate(keys, times, now_us)
        if len(keys) == 0:
            return RegisterResult(keys, np.empty(0, dtype=np.int8))
        uniq, inverse = dedup(keys)
        ukeys = keys.take(uniq)
        outcomes = np.empty(len(ukeys), dtype=np.int8)
        todo = np.arange(len(ukeys))
        all_stats: list[ShardStats] = []
        for _ in range(3):  # a layout change between two reads is possible, three in a row is not
            groups = [(ref, todo[pos]) for ref, pos in self._groups(ukeys.take(todo))]
            self._connect_all([ref for ref, _ in groups])
            stats, failed = self._run_groups(
                groups, lambda ref, pos: self._register_shard(ref, ukeys.take(pos), token), outcomes
            )
            all_stats += stats
            stale = {ref: exc for ref, exc in failed.items() if isinstance(exc, StaleLayoutError)}
            if len(stale) < len(failed) or not stale or not self.options.follow_layout:
                break
            # Nothing was written on the refusing shards: route their ids again with the new layout.
            self.layout(refresh=True)
            todo = np.concatenate([pos for ref, pos in groups if ref in stale])
        if failed:
            if not all_stats and all(isinstance(e, StaleLayoutError) for e in failed.values()):
                raise next(iter(failed.values()))  # refused everywhere, nothing written: the plain refusal
            unsafe = [e for e in failed.values() if isinstance(e, UnsafeReplicationError)]
            if not all_stats and unsafe:
                raise unsafe[0]  # nothing written: the guard's one line, not a partial registration
            raise PartialRegistrationError([s.shard for s in all_stats], failed)
        return RegisterResult(keys, outcomes[inverse], all_stats)

    def lookup(self, ids: EventKeys | Iterable[object] | pa.Array) -> LookupResult:
        """Batched read of which ids are registered (and by which token). A hint for the dispatcher only:
        ``register`` alone decides."""
        keys = ids if isinstance(ids, EventKeys) else EventKeys.from_ids(ids)
        n = len(keys)
        registered = np.zeros(n, dtype=bool)
        tokens = np.zeros(n, dtype=np.int64)
        too_old = np.zeros(n, dtype=bool)
        if n == 0:
            return LookupResult(keys, registered, tokens, too_old)
        uniq, inverse = dedup(keys)
        ukeys = keys.take(uniq)
        groups = self._groups(ukeys)
        self._connect_all([ref for ref, _ in groups])
        packed = np.zeros(len(ukeys), dtype=np.int8)
        u_tokens = np.zeros(len(ukeys), dtype=np.int64)

        def one(ref: ShardRef, pos: np.ndarray) -> tuple[np.ndarray, ShardStats]:
            flags, toks, st = self._lookup_shard(ref, ukeys.take(pos))
            u_tokens[pos] = toks
            return flags, st

        _, failed = self._run_groups(groups, one, packed)
        if failed:
            raise next(iter(failed.values()))
        registered[:] = (packed & 1).astype(bool)[inverse]
        too_old[:] = (packed & 2).astype(bool)[inverse]
        tokens[:] = u_tokens[inverse]
        return LookupResult(keys, registered, tokens, too_old)

    # -- internals -------------------------------------------------------------------------------------------
    def _validate(self, keys: EventKeys, times: Sequence[int] | np.ndarray | None, now_us: int | None = None) -> None:
        if times is not None:
            t = np.asarray(times, dtype=np.int64)
            if t.shape != keys.ts_us.shape:
                raise ValueError(f"{len(t)} times for {len(keys)} ids")
            _refuse(
                keys,
                np.flatnonzero(t != keys.ts_us),
                lambda p: f"event time {int(t[p])} differs from the id's own timestamp",
            )
        # ``now_us``: the caller's "now" from the registry server's clock (a joiner's batch); else this host's.
        now = int(time.time() * 1e6) if now_us is None else now_us
        limit = now + int(self.options.max_future_s * 1e6)
        _refuse(
            keys,
            np.flatnonzero(keys.ts_us > limit),
            lambda p: f"timestamp more than {self.options.max_future_s:g}s in the future",
        )

    def _groups(self, ukeys: EventKeys) -> list[tuple[ShardRef, np.ndarray]]:
        versions, shards = self.layout().assign(ukeys)
        code = versions * 65_536 + shards
        order = np.argsort(code, kind="stable")  # stable: each group stays in key order (a consistent lock order)
        sorted_code = code[order]
        cuts = np.flatnonzero(np.diff(sorted_code)) + 1
        groups = []
        for pos in np.split(order, cuts):
            c = int(code[pos[0]])
            groups.append((ShardRef(c // 65_536, c % 65_536), pos))
        return groups

    def _run_groups(
        self,
        groups: list[tuple[ShardRef, np.ndarray]],
        fn: Any,
        out: np.ndarray,
    ) -> tuple[list[ShardStats], dict[ShardRef, BaseException]]:
        futures: list[tuple[ShardRef, np.ndarray, Future[Any]]] = [
            (ref, pos, self._pool.submit(fn, ref, pos)) for ref, pos in groups
        ]
        stats: list[ShardStats] = []
        failed: dict[ShardRef, BaseException] = {}
        for ref, pos, fut in futures:
            try:
                values, st = fut.result()
            except Exception as exc:  # collected: every shard's outcome is known before raising
                failed[ref] = exc
                continue
            out[pos] = values
            stats.append(st)
        return stats, failed

    def _retrying(self, attempts: int | None = None) -> Retrying:
        """Whole-transaction retries: a conflict (40001/40P01) up to ``attempts`` tries, a lost or unreachable
        server until ``failover_s`` has passed since the first try (at least ``attempts`` tries either way)."""
        limit = attempts or self.options.max_attempts

        def stop(state: RetryCallState) -> bool:
            exc = state.outcome.exception() if state.outcome is not None else None
            if exc is not None and is_server_lost(exc):
                return state.attempt_number >= limit and (state.seconds_since_start or 0.0) >= self.options.failover_s
            return state.attempt_number >= limit

        return Retrying(
            retry=retry_if_exception(lambda e: is_transient(e) or isinstance(e, RegistryUnavailableError)),
            wait=wait_random_exponential(multiplier=self.options.backoff_base_s, max=self.options.backoff_max_s),
            stop=stop,
            reraise=True,
        )

    def _connect_all(self, refs: list[ShardRef]) -> None:
        """Open every shard connection a batch needs before any transaction starts, so an unreachable server
        fails the batch with nothing written."""
        missing = [r for r in refs if r not in self._conns or self._conns[r].closed]
        if not missing:
            return
        futures = [self._pool.submit(self._open, r) for r in missing]
        errors = []
        for fut in futures:
            try:
                fut.result()
            except RegistryUnavailableError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def _open(self, ref: ShardRef) -> Any:
        for attempt in self._retrying(self.options.connect_attempts):
            with attempt:
                return self._conn(ref)
        raise AssertionError("unreachable")

    def _conn(self, ref: ShardRef) -> Any:
        conn = self._conns.get(ref)
        if conn is not None and not conn.closed:
            return conn
        server = self.layout().server_of(ref)
        conn = connect(self.servers[server], application_name=self.options.application_name)
        conn.set_session(isolation_level=ISOLATION_LEVEL_SERIALIZABLE, autocommit=False)
        with conn.cursor() as cur:
            cur.execute(q.CREATE_BATCH_TABLE)
        conn.commit()
        with self._lock:
            self._conns[ref] = conn
        return conn

    def _discard(self, ref: ShardRef, conn: Any, exc: BaseException) -> None:
        if conn is None:
            return
        if not is_connection_error(exc) and not conn.closed:
            try:
                conn.rollback()
                return
            except Exception:
                pass
        with self._lock:
            self._conns.pop(ref, None)
        with contextlib.suppress(Exception):
            conn.close()

    def _with_retries(self, ref: ShardRef, body: Any) -> tuple[Any, int]:
        attempts = 0
        for attempt in self._retrying():
            with attempt:
                attempts += 1
                conn = None
                try:
                    conn = self._conn(ref)
                    # A kept connection's server may have lost its synchronous standby since it was opened (Patroni
                    # outside strict mode then clears synchronous_standby_names): checked again, at most every few s.
                    check_replication(conn, self.servers[self.layout().server_of(ref)])
                    return body(conn), attempts
                except BaseException as exc:
                    self._discard(ref, conn, exc)
                    if attempts > 1 or is_transient(exc):
                        log.debug("shard %s attempt %d failed: %s", ref, attempts, exc)
                    raise
        raise AssertionError("unreachable")

    def _ensure_partitions(self, conn: Any, ref: ShardRef, ts_us: np.ndarray) -> int:
        width = self.partition_width_us
        starts = np.unique(ts_us // width * width)
        known = self._partitions.get(ref)
        if known is None:
            with conn.cursor() as cur:
                cur.execute(q.LIST_PARTITIONS, (q.qualified(ref),))
                known = {int(name.rsplit("_p", 1)[1]) * 1_000_000 for (name,) in cur.fetchall()}
                # Cached for the client's life: only partitions a standby holds (another client's creation whose
                # wait was cancelled is forgotten by a failover, and no insert would find its partition again).
                sync_barrier(cur)
            conn.commit()
            self._partitions[ref] = known
        missing = [int(s) for s in starts.tolist() if int(s) not in known]
        if not missing:
            return 0
        with conn.cursor() as cur:
            cur.execute(q.ENSURE_PARTITIONS, (ref.version, ref.shard_no, missing))
            made = int(cur.fetchone()[0])
        conn.commit()
        known.update(missing)
        return made

    def _register_shard(self, ref: ShardRef, keys: EventKeys, token: Token) -> tuple[np.ndarray, ShardStats]:
        t0 = time.perf_counter()
        made = 0

        def txn(conn: Any) -> tuple[np.ndarray, int]:
            nonlocal made
            made += self._ensure_partitions(conn, ref, keys.ts_us)
            n = len(keys)
            out = np.full(n, Outcome.TOO_OLD, dtype=np.int8)
            with conn.cursor() as cur:
                cur.execute(q.LOCK_LAYOUT_VERSION)
                enforced = cur.fetchone()
                if enforced is not None and int(enforced[0]) > self.layout().version:
                    raise StaleLayoutError(ref, self.layout().version, int(enforced[0]))
                cur.execute(q.LOCK_THRESHOLD, (ref.version, ref.shard_no))
                row = cur.fetchone()
                if row is None:
                    raise RegistryError(f"shard {ref} is not hosted on server {self.layout().server_of(ref)!r}")
                threshold = int(row[0])
                idx = np.flatnonzero(keys.ts_us >= threshold)
                inserted = 0
                if len(idx):
                    fast = None
                    if self.options.fast_path and not self._conflicted.get(ref, False):
                        fast = self._copy_all_new(cur, ref, keys, idx, token, threshold)
                    if fast is not None:
                        inserted = fast
                        out[idx] = Outcome.WON
                    else:
                        inserted = self._insert_conditionally(cur, ref, keys, idx, token, threshold, out)
                    self._conflicted[ref] = inserted < len(idx)
                if inserted == 0:
                    # Every answer here rests on rows other commits wrote (WON_AGAIN, LOST) or on the threshold
                    # (TOO_OLD); a commit that inserted rows waits for its standby anyway, and so for all of them.
                    sync_barrier(cur)
            conn.commit()
            return out, inserted

        (out, inserted), attempts = self._with_retries(ref, txn)
        return out, ShardStats(
            ref, self.layout().server_of(ref), len(keys), inserted, attempts, time.perf_counter() - t0, made
        )

    def _copy_all_new(
        self, cur: Any, ref: ShardRef, keys: EventKeys, idx: np.ndarray, token: Token, threshold: int
    ) -> int | None:
        """Fast path: COPY the eligible ids straight into the shard under a savepoint. Returns the rows inserted,
        or None if some id was already there (the savepoint is rolled back and released, leaving the transaction
        as it was before)."""
        tokens = np.full(len(idx), token.value, dtype=np.int64)
        payload = encode_copy(keys.ts_us[idx], keys.src[idx], tokens)
        cur.execute("SAVEPOINT photon_fast")
        try:
            cur.copy_expert(q.copy_into(ref, threshold), io.BytesIO(payload))
        except psycopg2.errors.UniqueViolation:
            cur.execute("ROLLBACK TO SAVEPOINT photon_fast")
            cur.execute("RELEASE SAVEPOINT photon_fast")
            return None
        copied = int(cur.rowcount)
        cur.execute("RELEASE SAVEPOINT photon_fast")
        if copied != len(idx):
            raise RegistryInvariantError(f"shard {ref}: {len(idx)} eligible ids, {copied} copied")
        return copied

    def _insert_conditionally(
        self,
        cur: Any,
        ref: ShardRef,
        keys: EventKeys,
        idx: np.ndarray,
        token: Token,
        threshold: int,
        out: np.ndarray,
    ) -> int:
        """Conditional path: binary COPY into the temp table, then the conditional INSERT; fills ``out`` for the
        eligible ids."""
        payload = encode_copy(idx.astype(np.int32), keys.ts_us[idx], keys.src[idx])
        cur.copy_expert(q.COPY_BATCH, io.BytesIO(payload))
        cur.execute(q.conditional_insert(ref), {"token": token.value, "threshold": threshold})
        rows = cur.fetchall()
        inserted = int(rows[0][1])
        prior = rows[1:]
        if inserted + len(prior) != len(idx):
            raise RegistryInvariantError(
                f"shard {ref}: {len(idx)} eligible, {inserted} inserted, {len(prior)} found before"
            )
        out[idx] = Outcome.WON
        for i, tok in prior:
            out[i] = Outcome.WON_AGAIN if tok == token.value else Outcome.LOST
        return inserted

    def _lookup_shard(self, ref: ShardRef, keys: EventKeys) -> tuple[np.ndarray, np.ndarray, ShardStats]:
        t0 = time.perf_counter()

        def txn(conn: Any) -> tuple[np.ndarray, np.ndarray]:
            flags = np.zeros(len(keys), dtype=np.int8)
            toks = np.zeros(len(keys), dtype=np.int64)
            with conn.cursor() as cur:
                cur.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
                cur.execute(q.READ_THRESHOLD, (ref.version, ref.shard_no))
                row = cur.fetchone()
                if row is None:
                    raise RegistryError(f"shard {ref} is not hosted on server {self.layout().server_of(ref)!r}")
                flags[keys.ts_us < int(row[0])] |= 2
                payload = encode_copy(np.arange(len(keys), dtype=np.int32), keys.ts_us, keys.src)
                cur.copy_expert(q.COPY_BATCH, io.BytesIO(payload))
                cur.execute(q.lookup_rows(ref))
                for i, tok in cur.fetchall():
                    flags[i] |= 1
                    toks[i] = tok or 0
                if flags.any():
                    # The dispatcher drops what it finds registered (or too old): only on a commit a standby holds,
                    # else a failover could forget the row after this pipeline skipped the click for good.
                    sync_barrier(cur)
            conn.commit()
            return flags, toks

        (flags, toks), attempts = self._with_retries(ref, txn)
        return (
            flags,
            toks,
            ShardStats(ref, self.layout().server_of(ref), len(keys), 0, attempts, time.perf_counter() - t0),
        )


NOT_INITIALISED = "the registry is not initialised: run `photon registry init`"


def _require_schema(cur: Any, dsn: str) -> None:
    cur.execute("SELECT to_regclass('photon.shard_config') IS NOT NULL")
    if not cur.fetchone()[0]:
        # Named: a command run from another folder starts (and finds empty) an embedded server of its own.
        raise RegistryError(f"{NOT_INITIALISED} (registry: {redact(dsn)})")


def require_initialised(main_dsn: str) -> None:
    """One clear ``RegistryError`` when ``photon registry init`` never ran on the main server, before a command's
    first query fails on a missing schema with a traceback. Reads only."""
    with autocommit(main_dsn) as conn, conn.cursor() as cur:
        _require_schema(cur, main_dsn)


def read_layout(main_dsn: str) -> tuple[ShardLayout, int]:
    with autocommit(main_dsn) as conn, conn.cursor() as cur:
        _require_schema(cur, main_dsn)
        cur.execute("SELECT version, valid_from_us, num_shards, state FROM photon.shard_config ORDER BY version")
        configs = [ShardConfig(int(v), int(f), int(n), str(s)) for v, f, n, s in cur.fetchall()]
        cur.execute("SELECT config_version, shard_no, server FROM photon.shard_map")
        placement = {ShardRef(int(v), int(s)): str(srv) for v, s, srv in cur.fetchall()}
        cur.execute("SELECT value FROM photon.registry_meta WHERE key = 'partition_width_us'")
        width = int(cur.fetchone()[0])
        # Routed with for the client's life: only a layout a standby holds (an activation whose wait was cancelled
        # is forgotten by a failover, and one id would go to two shards).
        sync_barrier(cur)
    if not configs:
        raise RegistryError("the registry has no shard configuration: run `photon registry init`")
    return ShardLayout(configs, placement), width
