"""PostgreSQL plumbing: DSNs, connections, the embedded server, and which errors are worth a retry."""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import logging
import os
import pwd
import re
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import psutil
import psycopg2
import psycopg2.errorcodes
import psycopg2.extensions
from psycopg2 import sql
from tenacity import RetryCallState, Retrying, retry_if_exception, wait_random_exponential

log = logging.getLogger(__name__)

SERIALIZATION_FAILURE = psycopg2.errorcodes.SERIALIZATION_FAILURE  # 40001
DEADLOCK_DETECTED = psycopg2.errorcodes.DEADLOCK_DETECTED  # 40P01
RETRYABLE_CODES = frozenset({SERIALIZATION_FAILURE, DEADLOCK_DETECTED})
EMBEDDED_DATABASE = "photon"


class RegistryUnavailableError(RuntimeError):
    """A registry server could not be reached (after retries)."""


class RegistryDsnError(ValueError):
    """A registry DSN that no retry can make work: a host name that does not exist, a login the server refuses
    (password, pg_hba.conf, a role that does not exist or may not log in), a database that does not exist, a DSN
    libpq cannot parse. Not retried, unlike RegistryUnavailableError: a setting is wrong, not a server away (a
    ValueError, so the command line shows it as one line)."""


class UnsafeReplicationError(RuntimeError):
    """A registry server would acknowledge a commit that no standby holds, and the deployment did not say it accepts
    a single server (PHOTON_REGISTRY_REPLICATION). Not retried: a setting is wrong, not a server away."""


class StandbyNotInSyncError(UnsafeReplicationError, RegistryUnavailableError):
    """The server names synchronous standbys but none streams in sync or quorum state: its commits would wait, never
    be acknowledged alone. Right after a failover this is the new primary until a standby has reconnected to it (a
    second or so), so writers retry it as they retry a server away, for the failover budget; a standby that never
    comes is then refused with the guard's one line."""


def is_serialization_error(exc: BaseException) -> bool:
    return isinstance(exc, psycopg2.Error) and getattr(exc, "pgcode", None) in RETRYABLE_CODES


def is_connection_error(exc: BaseException) -> bool:
    # OperationalError without a SQLSTATE is libpq losing the server; with one it is e.g. a cancelled statement.
    if isinstance(exc, psycopg2.InterfaceError):
        return True
    return isinstance(exc, psycopg2.OperationalError) and getattr(exc, "pgcode", None) in (
        None,
        "57P01",
        "57P02",
        "57P03",
        "08006",
        "08003",
    )


def is_server_lost(exc: BaseException) -> bool:
    """The registry server is lost or unreachable (a failover may bring it back), as opposed to a refused statement."""
    return is_connection_error(exc) or isinstance(exc, RegistryUnavailableError)


def is_transient(exc: BaseException) -> bool:
    return is_serialization_error(exc) or is_connection_error(exc)


# Why a connection failed for good, from libpq's message (a failed connection carries no SQLSTATE). libpq and the
# server speak English unless built or configured for another language; a message not recognised here is retried,
# as every failure was before. libpq gives up on a multi-host DSN's remaining hosts once a server refuses the login
# or the database (its documentation: "if authentication fails, the remaining hosts are not tried"), so one such
# refusal decides; a host name that does not resolve decides only when every host of the list failed so (libpq
# tried the next one, and a host that is down or not yet promoted is what a failover looks like).
_REFUSED_LOGIN = re.compile(
    r"(?:FATAL:\s+)?((?:\S+ )?authentication failed for user \"[^\"]*\""
    r"|no pg_hba\.conf entry for [^\n]*|pg_hba\.conf rejects connection for [^\n]*"
    r"|role \"[^\"]*\" does not exist|role \"[^\"]*\" is not permitted to log in"
    r"|database \"[^\"]*\" does not exist|permission denied for database \"[^\"]*\""
    r"|fe_sendauth: no password supplied)"
)
# getaddrinfo's EAI_NONAME and EAI_NODATA (glibc, musl, BSD wording); EAI_AGAIN ("Temporary failure in name
# resolution": no DNS server answered) is a network away, retried.
_UNKNOWN_HOST = re.compile(
    r'could not translate host name "([^"]*)" to address: (Name or service not known|No address associated with '
    r"hostname|Name does not resolve|nodename nor servname provided, or not known)"
)
_ATTEMPT = re.compile(r"^(?:connection to server |could not translate host name )", re.MULTILINE)
# Options libpq checks before it connects anywhere: a value it does not know, hosts and ports that do not pair up.
_BAD_OPTION = re.compile(r"^(invalid [^\n]*(?:value|option)[^\n]*|could not match \d+ [^\n]*)")


def wrong_dsn_reason(message: str) -> str | None:
    """The reason a failed connection will fail again however long it is retried (one clause, from libpq's message
    ``message``), or None when the server may be down, starting, in recovery, a standby, or mid-failover."""
    refused = _REFUSED_LOGIN.search(message)
    if refused is not None:
        return refused.group(1)
    starts = [m.start() for m in _ATTEMPT.finditer(message)]
    attempts = [message[a:b] for a, b in itertools.pairwise([*starts, len(message)])]  # one per host tried
    unknown = [_UNKNOWN_HOST.match(a) for a in attempts]
    if unknown and all(unknown):
        names = ", ".join(dict.fromkeys(m.group(1) for m in unknown if m is not None))
        why = ", ".join(dict.fromkeys(m.group(2) for m in unknown if m is not None))
        return f"unknown host name {names} ({why})"
    option = _BAD_OPTION.match(message.strip())
    return option.group(1) if option is not None else None


T = TypeVar("T")
FAILOVER_ENV = "PHOTON_REGISTRY_FAILOVER_S"  # photon/settings.py: registry_failover_s


def failover_s() -> float:
    """How long a write retries a lost server (PHOTON_REGISTRY_FAILOVER_S, default 45 s: Patroni's ttl of at least
    20 s plus the promotion); read from the environment, the foundation importing nothing of photon."""
    return float(os.environ.get(FAILOVER_ENV) or 45.0)


def across_failover(fn: Callable[[], T], *, budget_s: float | None = None) -> T:
    """Run ``fn`` (one whole transaction on its own connection) again while its server is lost or unreachable, for
    up to ``budget_s`` (default failover_s()): a multi-host DSN then finds the new primary. ``fn`` must be safe to
    run twice: a COMMIT whose answer was lost may have committed (each caller says why it is)."""
    budget = failover_s() if budget_s is None else budget_s
    lost_at: list[float] = []

    def stop(state: RetryCallState) -> bool:
        # From the first failure, not the first try (tenacity's stop_after_delay): a pass that loses its server
        # after minutes of work (a verifier's) gets the whole budget to find the new primary too.
        lost_at.append(time.monotonic())
        return lost_at[-1] - lost_at[0] >= budget

    retrying = Retrying(
        # A wrong DSN (RegistryDsnError) is neither: connect() tells it apart, and it fails at once.
        retry=retry_if_exception(is_server_lost),
        wait=wait_random_exponential(multiplier=0.05, max=1.0),
        stop=stop,
        reraise=True,
    )
    for attempt in retrying:
        with attempt:
            return fn()
    raise AssertionError("unreachable")


def with_dbname(dsn: str, dbname: str) -> str:
    return psycopg2.extensions.make_dsn(dsn, dbname=dbname)


def dbname_of(dsn: str) -> str:
    return str(psycopg2.extensions.parse_dsn(dsn).get("dbname", ""))


def redact(dsn: str) -> str:
    """The DSN without its password, for messages and logs."""
    try:
        params = psycopg2.extensions.parse_dsn(dsn)
    except psycopg2.ProgrammingError:
        return "<unparsable dsn>"
    if "password" in params:
        params["password"] = "***"
    return " ".join(f"{k}={v}" for k, v in params.items())


# The replication guard (issue 21). A registry that acknowledges a registration its standby does not hold can forget
# it in a failover, and the other pipeline then joins the click again. So before anything is written the server must
# show it waits for a standby: synchronous_commit not off/local, synchronous_standby_names set, and a standby streaming
# in sync or quorum state. PHOTON_REGISTRY_REPLICATION (photon/settings.py says why the defaults are what they are;
# read here from the environment because the foundation modules import nothing of photon) turns it off for a single
# server. Checked when a connection is made (every component connects through connect(), a lost connection is
# re-made through it) and again, at most every GUARD_RECHECK_S, on the connections a client keeps (check_replication).
# Standbys named but none in sync is a failover's moment as well as a standby gone: writers retry it for the failover
# budget (StandbyNotInSyncError is a RegistryUnavailableError too) before they give up with the same line.
REPLICATION_ENV = "PHOTON_REGISTRY_REPLICATION"
REPLICATION_MODES = ("required", "single")
GUARD_RECHECK_S = 5.0
_SAFE_COMMIT = ("on", "remote_apply", "remote_write")
_WAY_OUT = f"or set {REPLICATION_ENV}=single to accept a single server"


def replication_mode() -> str:
    """``required`` or ``single``: the environment's PHOTON_REGISTRY_REPLICATION, else ``required``. The embedded
    server sets ``single`` for the process that starts it and the ones it starts (EmbeddedPostgres.start): every
    server named otherwise (a DSN, an Airflow connection) is guarded unless the deployment says it is single."""
    mode = os.environ.get(REPLICATION_ENV, "").strip().lower()
    if not mode:
        return "required"
    if mode not in REPLICATION_MODES:
        raise ValueError(f"{REPLICATION_ENV}={mode!r}: expected one of {', '.join(REPLICATION_MODES)}")
    return mode


class CommitNotReplicatedError(psycopg2.OperationalError):
    """A COMMIT (or a statement in autocommit mode) came back with a warning that its wait for a standby was
    cancelled: committed on the primary, perhaps on no standby, so a failover may forget it. An unknown outcome,
    handled as a COMMIT whose answer was lost (no SQLSTATE: every retry policy here takes it for a lost connection,
    so the whole transaction runs again, re-reads, and rests its answer on a replicated commit: sync_barrier)."""


# PostgreSQL's syncrep.c: "canceling wait for synchronous replication due to user request" + "The transaction has
# already committed locally, but might not have been replicated to the standby." (English server messages:
# lc_messages = C on the registry's servers, as the local cluster and the compose file set it).
_UNREPLICATED_MARKERS = ("synchronous replication", "might not have been replicated")


def _unreplicated(notices: list[str], *, any_notice: bool) -> str | None:
    for notice in notices:
        if any_notice or notice.startswith("WARNING:") or any(m in notice for m in _UNREPLICATED_MARKERS):
            return notice.strip().replace("\n", " ")
    return None


class GuardedCursor(psycopg2.extensions.cursor):
    """In autocommit mode each statement is its own COMMIT: a warning that its wait for a standby was cancelled
    makes it an unknown outcome (CommitNotReplicatedError), as GuardedConnection.commit does."""

    def execute(self, query: Any, vars: Any = None) -> None:
        conn = self.connection
        if not conn.autocommit:
            super().execute(query, vars)
            return
        del conn.notices[:]
        super().execute(query, vars)
        warning = _unreplicated(conn.notices, any_notice=False)
        if warning is not None:
            raise CommitNotReplicatedError(f"statement committed on the primary only: {warning}")


class GuardedConnection(psycopg2.extensions.connection):
    """A connection that remembers when its server last passed the replication guard (the per-connection cache),
    and that refuses to call a commit acknowledged when the server says no standby may hold it."""

    guard_checked_at: float | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cursor_factory = GuardedCursor

    def commit(self) -> None:
        # The registry's own transactions emit nothing at COMMIT (no deferred triggers, no ON COMMIT notices), so
        # any notice there is taken as the cancelled wait for a standby, whatever language the server speaks.
        del self.notices[:]
        super().commit()
        warning = _unreplicated(self.notices, any_notice=True)
        if warning is not None:
            raise CommitNotReplicatedError(f"COMMIT acknowledged by the primary only: {warning}")


# A transaction that decides on rows other transactions wrote (an id found registered, a batch found committed) and
# writes nothing itself commits without waiting for a standby, so its answer could rest on a row a cancelled wait
# left visible on the primary alone. A WAL record of its own makes its COMMIT wait until a standby holds the WAL up
# to it, and so every commit it saw (a commit record precedes its visibility). On a server without synchronous
# standbys it writes nothing: there is no standby to wait for.
_SYNC_BARRIER = (
    "SELECT CASE WHEN current_setting('synchronous_standby_names') <> ''"
    " THEN pg_logical_emit_message(true, 'photon', 'sync barrier') END"
)


def sync_barrier(cur: Any) -> None:
    """Make the open transaction's COMMIT wait for a synchronous standby (see _SYNC_BARRIER)."""
    cur.execute(_SYNC_BARRIER)


_GUARD_SETTINGS = (
    "SELECT current_setting('synchronous_commit'), current_setting('synchronous_standby_names'),"
    " pg_is_in_recovery(), to_regprocedure('photon.replication_standbys()') IS NOT NULL,"
    " pg_has_role('pg_read_all_stats', 'USAGE'), current_user"
)
# What the function of sql/0011 returns: a role without pg_read_all_stats sees NULL sync_state in the view itself.
_GUARD_STANDBYS_FN = "SELECT application_name, state, sync_state FROM photon.replication_standbys()"
_GUARD_STANDBYS = "SELECT application_name, state, sync_state FROM pg_stat_replication"


def _replication_problem(conn: Any) -> tuple[str, type[UnsafeReplicationError]] | None:
    """Why this server could acknowledge a commit no standby holds (one clause) and the error to raise, or None if
    it cannot."""
    with conn.cursor() as cur:
        cur.execute(_GUARD_SETTINGS)
        commit, names, in_recovery, have_fn, read_stats, user = cur.fetchone()
        if in_recovery:
            return None  # a standby accepts no write at all (a multi-host DSN without target_session_attrs)
        if commit not in _SAFE_COMMIT:
            return (
                f"synchronous_commit = '{commit}' acknowledges a commit before a standby holds it: set it to 'on' "
                "(server, database and role settings)",
                UnsafeReplicationError,
            )
        if not names.strip():
            return (
                "synchronous_standby_names is empty, so commits are acknowledged with no standby holding them "
                "(asynchronous replication or a lone server): configure synchronous replication (Patroni: "
                "synchronous_mode: quorum)",
                UnsafeReplicationError,
            )
        if have_fn:
            cur.execute(_GUARD_STANDBYS_FN)
        elif read_stats:
            cur.execute(_GUARD_STANDBYS)
        else:
            return (
                f"role {user} cannot see which standbys are in sync (pg_stat_replication): run "
                "`photon registry init` as the admin (it creates photon.replication_standbys())",
                UnsafeReplicationError,
            )
        standbys = cur.fetchall()
    if any(state == "streaming" and sync in ("sync", "quorum") for _, state, sync in standbys):
        return None
    seen = ", ".join(f"{app} {state}/{sync}" for app, state, sync in standbys) or "none connected"
    return (
        f"synchronous_standby_names = '{names}' but no standby streams in sync or quorum state ({seen}): start or "
        "reconnect a synchronous standby",
        StandbyNotInSyncError,
    )


def check_replication(conn: Any, dsn: str, *, max_age_s: float | None = None) -> None:
    """Raise UnsafeReplicationError (one line: the setting, its value, the way out) unless the deployment accepts a
    single server or the server waits for a standby; a verdict younger than ``max_age_s`` on this connection is
    reused (default GUARD_RECHECK_S). Leaves the connection as it found it (no transaction open)."""
    if replication_mode() == "single":
        return
    checked = getattr(conn, "guard_checked_at", None)
    if checked is not None and time.monotonic() - checked < (GUARD_RECHECK_S if max_age_s is None else max_age_s):
        return
    was_idle = conn.get_transaction_status() == psycopg2.extensions.TRANSACTION_STATUS_IDLE
    try:
        problem = _replication_problem(conn)
    finally:
        if was_idle and not conn.autocommit:
            conn.rollback()
    if problem is not None:
        why, error = problem
        raise error(f"registry server {redact(dsn)} refused: {why}, {_WAY_OUT}")
    if isinstance(conn, GuardedConnection):
        conn.guard_checked_at = time.monotonic()


def connect(
    dsn: str,
    *,
    application_name: str = "photon",
    connect_timeout: int = 5,
    statement_timeout_ms: int | None = None,
    guard: bool = True,
) -> Any:
    """A connection to a registry server. ``statement_timeout_ms`` bounds each statement and each lock wait, for the
    calls that must never hold up their caller (a standby's announcement, a lease asking for its successor).
    ``guard``: refuse a server that would acknowledge a commit no standby holds (check_replication); off only for
    the admin's own work (databases, migrations) and read-only diagnostics."""
    try:
        # Added to the DSN's own options, which a keyword would replace. client_min_messages: the warning of a
        # cancelled wait for a standby is the only sign of it (GuardedConnection), and a role, database or server
        # setting quieter than WARNING would keep it from us; a startup option outranks them all.
        options = [psycopg2.extensions.parse_dsn(dsn).get("options", ""), "-c client_min_messages=warning"]
        if statement_timeout_ms is not None:
            options.append(f"-c statement_timeout={statement_timeout_ms} -c lock_timeout={statement_timeout_ms}")
        extra = {"options": " ".join(o for o in options if o)}
        conn = psycopg2.connect(
            dsn,
            application_name=application_name,
            connect_timeout=connect_timeout,
            connection_factory=GuardedConnection,
            **extra,
        )
    except psycopg2.ProgrammingError as exc:  # "invalid dsn": libpq cannot parse it (its message may quote it all)
        raise RegistryDsnError(f"wrong registry DSN {redact(dsn)}: {_masked(str(exc), dsn)} (not retried)") from None
    except psycopg2.OperationalError as exc:
        wrong = wrong_dsn_reason(str(exc))
        if wrong is not None:
            raise RegistryDsnError(f"wrong registry DSN {redact(dsn)}: {wrong} (not retried)") from exc
        raise RegistryUnavailableError(f"cannot reach registry server {redact(dsn)}: {str(exc).strip()}") from exc
    if guard:
        try:
            check_replication(conn, dsn)
        except BaseException:
            conn.close()
            raise
    return conn


# Where a DSN libpq cannot parse may hold its password: a keyword's value (quoted, or up to a blank: it may hold
# '&'), a URI's query parameter, a URI's user:password@.
_SECRETS = (
    re.compile(r"password\s*=\s*'((?:[^'\\]|\\.)*)'"),
    re.compile(r"password\s*=\s*([^\s']+)"),
    re.compile(r"password=([^\s&']+)"),
    re.compile(r"://[^:/@\s]*:([^@/\s]+)@"),
)


def _masked(message: str, dsn: str) -> str:
    """libpq's complaint about a DSN it cannot parse, on one line, with whatever looks like the DSN's password
    masked: the complaint quotes pieces of the DSN (a URI's, all of it)."""
    text = " ".join(message.split())
    for secret in sorted({m for rx in _SECRETS for m in rx.findall(dsn) if m}, key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


@contextlib.contextmanager
def autocommit(dsn: str, **kwargs: Any) -> Iterator[Any]:
    conn = connect(dsn, **kwargs)
    conn.autocommit = True
    try:
        yield conn
    finally:
        conn.close()


def create_database(admin_dsn: str, dbname: str) -> str:
    with autocommit(admin_dsn, guard=False) as conn, conn.cursor() as cur:
        cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (dbname,))
        if cur.fetchone() is None:
            cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    return with_dbname(admin_dsn, dbname)


def drop_database(admin_dsn: str, dbname: str) -> None:
    with autocommit(admin_dsn, guard=False) as conn, conn.cursor() as cur:
        cur.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname)))


# Settings for the embedded server: durable (fsync and synchronous_commit stay on), sized for registry batches.
_EMBEDDED_TUNING = {
    "max_wal_size": "4GB",
    "checkpoint_timeout": "15min",
    "shared_buffers": "256MB",
    "wal_buffers": "32MB",
    "temp_buffers": "64MB",
    # Large SERIALIZABLE batches take many predicate locks before they are promoted to relation locks.
    "max_pred_locks_per_transaction": "256",
    "max_connections": "200",
}


# PostgreSQL and Patroni refuse to run as root; as root, servers run as this user (the pgserver wheel's own too).
SERVER_USER = "pgserver"
_USERADD_LOCK = Path(tempfile.gettempdir()) / "photon-useradd.lock"


def server_user(name: str = SERVER_USER) -> pwd.struct_passwd | None:
    """The user PostgreSQL servers run as: ``name`` when we are root (created if missing), else None (ourselves).

    One process at a time creates it: ``useradd`` run by several processes at once writes /etc/passwd from what each
    read, so a later one may drop an earlier one's entry, and the earlier process keep a uid nobody has (a test
    run's workers did, each then failing with "Permission denied" on the folders it had given that uid)."""
    if os.geteuid() != 0:
        return None
    with contextlib.suppress(KeyError):
        return pwd.getpwnam(name)
    with open(_USERADD_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)  # made while we waited
        subprocess.run(["useradd", "--system", "--no-create-home", name], check=True, capture_output=True)
        return pwd.getpwnam(name)


class EmbeddedPostgres:
    """A PostgreSQL in a local folder (the pgserver wheel's binaries), shared by every process that uses the folder.

    pgserver counts the processes holding the server and stops it when the last one exits. A process killed with
    SIGKILL never says goodbye, so dead holders are dropped from pgserver's list before attaching.
    """

    def __init__(self, folder: Path, *, cleanup_mode: str | None = "stop"):
        self.folder = folder.resolve()
        self.cleanup_mode = cleanup_mode
        self._server: Any = None

    def start(self) -> str:
        with warnings.catch_warnings():
            # platformdirs warns when XDG_RUNTIME_DIR is unset (CI, containers); pgserver then uses /tmp.
            warnings.simplefilter("ignore")
            import pgserver  # imported lazily: only machines without a DSN need it

        server_user()  # pgserver would create it without a lock, racing other processes (see server_user)
        self.folder.parent.mkdir(parents=True, exist_ok=True)
        fresh = not (self.folder / "PG_VERSION").exists()
        with pgserver.PostgresServer._lock:
            _prune_dead_holders(self.folder)
        try:
            server = pgserver.get_server(self.folder, cleanup_mode=self.cleanup_mode)
        except PermissionError as exc:
            raise RegistryUnavailableError(
                f"the embedded PostgreSQL could not start: {exc}. As root, pgserver runs the server as the user "
                "'pgserver', which must be able to reach the Python environment's files: keep the environment "
                "outside a private home (the Makefile uses /var/tmp/photon/venvs for root), or set "
                "PHOTON_REGISTRY_DSN to a PostgreSQL server."
            ) from exc
        if fresh:
            for name, value in _EMBEDDED_TUNING.items():
                server.psql(f"ALTER SYSTEM SET {name} = '{value}';")
            # Restart to apply what needs one; we are the only holder of a server we just created.
            server.cleanup()
            server = pgserver.get_server(self.folder, cleanup_mode=self.cleanup_mode)
        self._server = server
        # A lone server by construction: this process and the ones it starts with this server's DSN (a joiner, a
        # Spark job, a benchmark's workers) accept it as one, unless the environment already says otherwise.
        os.environ.setdefault(REPLICATION_ENV, "single")
        admin = server.get_uri()
        create_database(admin, EMBEDDED_DATABASE)
        return with_dbname(admin, EMBEDDED_DATABASE)

    @property
    def admin_dsn(self) -> str:
        return str(self._server.get_uri())

    def stop(self) -> None:
        if self._server is not None:
            self._server.cleanup()
            self._server = None


def _prune_dead_holders(folder: Path) -> None:
    path = folder / ".handle_pids.json"
    if not path.exists():
        return
    try:
        pids = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    alive = [p for p in pids if isinstance(p, int) and (p == os.getpid() or psutil.pid_exists(p))]
    if alive != pids:
        path.write_text(json.dumps(alive))


_embedded: EmbeddedPostgres | None = None


def embedded_dsn(home: Path) -> str:
    """Start (or attach to) the embedded registry server under ``home`` and return its DSN."""
    global _embedded
    if _embedded is None:
        _embedded = EmbeddedPostgres(home / "postgres")
        return _embedded.start()
    return with_dbname(_embedded.admin_dsn, EMBEDDED_DATABASE)
