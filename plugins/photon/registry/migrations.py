"""Ordered schema migrations from ``sql/``, applied once each and recorded in ``photon.schema_migrations``."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from photon.pg import autocommit

SQL_DIR = Path(__file__).resolve().parents[3] / "sql"
_FILE_RE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
# One advisory lock id for "migrating this database": two `init`s at once apply each file exactly once.
_LOCK_ID = 0x50484F544F4E  # "PHOTON"


class MigrationError(RuntimeError):
    pass


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    path: Path

    @property
    def sql(self) -> str:
        return self.path.read_text(encoding="utf-8")

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()


def discover(sql_dir: Path = SQL_DIR) -> list[Migration]:
    found = []
    for path in sorted(sql_dir.glob("*.sql")):
        m = _FILE_RE.match(path.name)
        if not m:
            raise MigrationError(f"{path.name}: migration files are named NNNN_snake_case.sql")
        found.append(Migration(int(m.group(1)), m.group(2), path))
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise MigrationError(f"two migrations share a number in {sql_dir}")
    return found


def apply_migrations(dsn: str, sql_dir: Path = SQL_DIR) -> list[str]:
    """Apply every pending migration, each in its own transaction; return the names applied (empty: a no-op)."""
    migrations = discover(sql_dir)
    applied_now: list[str] = []
    # Not guarded: the admin migrates a server the guard would refuse (0011 is what lets the roles pass it).
    with autocommit(dsn, application_name="photon-migrate", guard=False) as conn, conn.cursor() as cur:
        cur.execute("SELECT pg_advisory_lock(%s)", (_LOCK_ID,))
        try:
            cur.execute("CREATE SCHEMA IF NOT EXISTS photon")
            cur.execute(
                "CREATE TABLE IF NOT EXISTS photon.schema_migrations ("
                " version integer PRIMARY KEY, name text NOT NULL, checksum text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now())"
            )
            cur.execute("SELECT version, name, checksum FROM photon.schema_migrations")
            done = {v: (n, c) for v, n, c in cur.fetchall()}
            for mig in migrations:
                if mig.version in done:
                    if done[mig.version][1] != mig.checksum:
                        raise MigrationError(
                            f"migration {mig.path.name} changed after it was applied; add a new migration instead"
                        )
                    continue
                conn.autocommit = False
                try:
                    cur.execute(mig.sql)
                    cur.execute(
                        "INSERT INTO photon.schema_migrations (version, name, checksum) VALUES (%s, %s, %s)",
                        (mig.version, mig.name, mig.checksum),
                    )
                    conn.commit()
                except Exception:
                    conn.rollback()
                    raise
                finally:
                    conn.autocommit = True
                applied_now.append(mig.path.name)
            unknown = sorted(set(done) - {m.version for m in migrations})
            if unknown:
                raise MigrationError(f"database has migrations {unknown} that this code does not know: upgrade it")
        finally:
            cur.execute("SELECT pg_advisory_unlock(%s)", (_LOCK_ID,))
    return applied_now


def applied(dsn: str) -> list[tuple[int, str]]:
    with autocommit(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT to_regclass('photon.schema_migrations') IS NOT NULL")
        if not cur.fetchone()[0]:
            return []
        cur.execute("SELECT version, name FROM photon.schema_migrations ORDER BY version")
        return [(int(v), str(n)) for v, n in cur.fetchall()]
