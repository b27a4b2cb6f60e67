"""PostgreSQL plumbing: DSNs, connections, the embedded server, and which errors are worth a retry."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import psycopg2
import psycopg2.errorcodes
import psycopg2.extensions
from psycopg2 import sql

log = logging.getLogger(__name__)

SERIALIZATION_FAILURE = psycopg2.errorcodes.SERIALIZATION_FAILURE  # 40001
DEADLOCK_DETECTED = psycopg2.errorcodes.DEADLOCK_DETECTED  # 40P01
RETRYABLE_CODES = frozenset({SERIALIZATION_FAILURE, DEADLOCK_DETECTED})
EMBEDDED_DATABASE = "photon"


class RegistryUnavailableError(RuntimeError):
    """A registry server could not be reached (after retries)."""


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


def is_transient(exc: BaseException) -> bool:
    return is_serialization_error(exc) or is_connection_error(exc)


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


def connect(
    dsn: str, *, application_name: str = "photon", connect_timeout: int = 5, statement_timeout_ms: int | None = None
) -> Any:
    """A connection to a registry server. ``statement_timeout_ms`` bounds each statement and each lock wait, for the
    calls that must never hold up their caller (a standby's announcement, a lease asking for its successor)."""
    extra = {}
    if statement_timeout_ms is not None:  # added to the DSN's own options, which a keyword would replace
        own = psycopg2.extensions.parse_dsn(dsn).get("options", "")
        timeouts = f"-c statement_timeout={statement_timeout_ms} -c lock_timeout={statement_timeout_ms}"
        extra["options"] = f"{own} {timeouts}".strip()
    try:
        return psycopg2.connect(dsn, application_name=application_name, connect_timeout=connect_timeout, **extra)
    except psycopg2.OperationalError as exc:
        raise RegistryUnavailableError(f"cannot reach registry server {redact(dsn)}: {str(exc).strip()}") from exc


@contextlib.contextmanager
def autocommit(dsn: str, **kwargs: Any) -> Iterator[Any]:
    conn = connect(dsn, **kwargs)
    conn.autocommit = True
    try:
        yield conn
    finally:
        conn.close()


def create_database(admin_dsn: str, dbname: str) -> str:
    with autocommit(admin_dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (dbname,))
        if cur.fetchone() is None:
            cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    return with_dbname(admin_dsn, dbname)


def drop_database(admin_dsn: str, dbname: str) -> None:
    with autocommit(admin_dsn) as conn, conn.cursor() as cur:
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
