"""`photon demo --registry-race` races in a registry database of its own, created and dropped on the registry's
server: it wrote 200,000 synthetic ids (owners `dc-a`, `dc-b`) into the project's registry, where `photon verify`
then counted them in flight, and with PHOTON_REGISTRY_DSN set it would have written them into production."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg2.extensions
import pytest
from psycopg2 import sql

from photon.pg import autocommit, create_database, drop_database, with_dbname
from photon.registry.admin import init_registry

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def login(pg_admin_dsn: str) -> Iterator[Callable[[str, bool], str]]:
    """``login(dsn, createdb)``: ``dsn`` reached as a fresh login that may (or may not) create databases, and nothing
    more: the least the race needs."""
    made: list[str] = []

    def make(dsn: str, createdb: bool) -> str:
        name, password = f"photon_t_{uuid.uuid4().hex[:10]}_race", uuid.uuid4().hex
        verb = "CREATEDB" if createdb else "NOCREATEDB"
        with autocommit(pg_admin_dsn) as conn, conn.cursor() as cur:
            cur.execute(
                sql.SQL("CREATE ROLE {} LOGIN NOSUPERUSER NOCREATEROLE " + verb + " PASSWORD %s").format(
                    sql.Identifier(name)
                ),
                (password,),
            )
        made.append(name)
        return psycopg2.extensions.make_dsn(dsn, user=name, password=password)

    yield make
    with autocommit(pg_admin_dsn) as conn, conn.cursor() as cur:
        for name in made:
            cur.execute("SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity WHERE usename = %s", (name,))
            cur.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


def _race(dsn: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PHOTON_REGISTRY_DSN": dsn, "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}"}
    cmd = [sys.executable, "-m", "photon", "demo", "--registry-race"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def _registry_rows(dsn: str) -> tuple[int, int]:
    """Owners and registered ids in the registry database ``dsn`` names."""
    with autocommit(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM photon.owners")
        owners = int(cur.fetchone()[0])
        cur.execute("SELECT table_name FROM information_schema.tables WHERE table_schema = 'photon'")
        ids = 0
        for (table,) in cur.fetchall():
            if re.fullmatch(r"ids_c\d+_s\d+", table):
                cur.execute(sql.SQL("SELECT count(*) FROM photon.{}").format(sql.Identifier(table)))
                ids += int(cur.fetchone()[0])
    return owners, ids


@pytest.fixture
def owned_registry(make_db: Callable[[], str], pg_admin_dsn: str, login: Callable[[str, bool], str]) -> Iterator[str]:
    """A registry database owned by a login that may create databases (no superuser): the login `photon registry
    init` ran as, which the old race wrote its ids into."""
    init_registry({"main": make_db()}, num_shards=1)  # the server's photon roles, as after any registry init
    owner = login(with_dbname(pg_admin_dsn, "postgres"), True)
    name = f"photon_t_{uuid.uuid4().hex[:12]}"
    dsn = create_database(owner, name)
    try:
        init_registry({"main": dsn}, num_shards=4)
        yield dsn
    finally:
        drop_database(pg_admin_dsn, name)


def test_the_race_leaves_the_named_registry_as_it_was_and_drops_its_own(
    owned_registry: str, pg_admin_dsn: str, login_as: Callable[[str, str], str], tmp_path: Path
) -> None:
    registry = owned_registry
    before = _registry_rows(registry)
    result = _race(registry)
    assert result.returncode == 0, result.stdout + result.stderr
    # The named registry: no owner, no id, nothing in flight for the verifier (it reported 200,000).
    assert _registry_rows(registry) == before == (0, 0)
    assert "->  OK" in result.stdout, result.stdout
    scratch = re.search(r"in a database of its own, (photon_race_\w+) ", result.stdout)
    assert scratch, result.stdout
    (tmp_path / "logs").mkdir()
    (tmp_path / "out").mkdir()
    env = {
        **os.environ,
        "PHOTON_REGISTRY_DSN": login_as(registry, "photon_verifier"),
        "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}",
    }
    cmd = [sys.executable, "-m", "photon", "verify", "--dry-run", "--logs", str(tmp_path / "logs")]
    verify = subprocess.run(
        [*cmd, "--out", str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=120
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "checked 0 registry rows with tokens" in verify.stdout and " 0 in flight" in verify.stdout, verify.stdout
    # Its own database is gone.
    with autocommit(pg_admin_dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_database WHERE datname = %s", (scratch.group(1),))
        assert cur.fetchone()[0] == 0


def test_a_login_that_may_not_create_databases_is_refused_in_one_line(
    make_db: Callable[[], str], login: Callable[[str, bool], str]
) -> None:
    registry = make_db()
    init_registry({"main": registry}, num_shards=4)
    result = _race(login(registry, False))
    assert result.returncode == 2, result.stdout + result.stderr
    err = result.stderr.strip().splitlines()
    assert len(err) == 1 and "may not create databases (CREATEDB)" in err[0], result.stderr
    assert "never writes into the named database" in err[0]
    assert _registry_rows(registry) == (0, 0)
