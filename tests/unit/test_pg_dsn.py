"""DSN handling in photon/pg.py for multi-host DSNs (a client that follows a failover), the replication guard's mode
from the environment, and which failed connections are retried (a server away) and which fail at once (a wrong DSN);
none needs a server (a name lookup, a closed port)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import psycopg2.extensions
import pytest

from photon.pg import (
    RegistryDsnError,
    RegistryUnavailableError,
    across_failover,
    connect,
    dbname_of,
    redact,
    replication_mode,
    with_dbname,
    wrong_dsn_reason,
)

MULTI = (
    "host=pg1,pg2,pg3 port=5432,5433,5434 user=photon_joiner password=s3cret dbname=photon "
    "target_session_attrs=read-write"
)
MULTI_URI = "postgresql://photon_joiner:s3cret@pg1:5432,pg2:5433,pg3:5434/photon?target_session_attrs=read-write"


@pytest.mark.parametrize("dsn", [MULTI, MULTI_URI])
def test_multi_host_dsn_keeps_its_hosts(dsn: str) -> None:
    other = psycopg2.extensions.parse_dsn(with_dbname(dsn, "photon_t"))
    assert other["host"] == "pg1,pg2,pg3"
    assert other["port"] == "5432,5433,5434"
    assert other["target_session_attrs"] == "read-write"
    assert other["dbname"] == "photon_t" and dbname_of(dsn) == "photon"
    shown = redact(dsn)
    assert "s3cret" not in shown and "host=pg1,pg2,pg3" in shown and "port=5432,5433,5434" in shown


def test_replication_mode_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PHOTON_REGISTRY_REPLICATION", raising=False)
    monkeypatch.delenv("PHOTON_REGISTRY_DSN", raising=False)
    # A server named by an Airflow connection: guarded (the embedded server's starter sets "single" itself).
    assert replication_mode() == "required"
    monkeypatch.setenv("PHOTON_REGISTRY_DSN", MULTI)
    assert replication_mode() == "required"
    monkeypatch.setenv("PHOTON_REGISTRY_REPLICATION", "Single")
    assert replication_mode() == "single"
    monkeypatch.setenv("PHOTON_REGISTRY_REPLICATION", "async")
    with pytest.raises(ValueError, match="PHOTON_REGISTRY_REPLICATION='async'"):
        replication_mode()


# -- a wrong DSN fails at once, a server away is retried (issue 21) ------------------------------------------------
# libpq's own messages (libpq 17 against PostgreSQL 15-16), as a failed connection carries no SQLSTATE.
AT = 'connection to server at "127.0.0.1", port 5433 failed: '
REFUSED = AT + "Connection refused\n\tIs the server running on that host and accepting TCP/IP connections?\n"
UNKNOWN = 'could not translate host name "no-such-host.invalid" to address: Name or service not known\n'


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        (AT + 'FATAL:  password authentication failed for user "photon_pw"\n', "password authentication failed"),
        (AT + "fe_sendauth: no password supplied\n", "no password supplied"),
        (
            AT + 'FATAL:  pg_hba.conf rejects connection for host "127.0.0.1", user "u", database "d", no encryption\n',
            "pg_hba.conf rejects connection",
        ),
        (
            AT + 'FATAL:  no pg_hba.conf entry for host "10.0.0.9", user "u", database "d", SSL off\n',
            "no pg_hba.conf entry",
        ),
        (AT + 'FATAL:  role "nobody_here" does not exist\n', 'role "nobody_here" does not exist'),
        (AT + 'FATAL:  role "photon_joiner" is not permitted to log in\n', "not permitted to log in"),
        (AT + 'FATAL:  database "nodb" does not exist\n', 'database "nodb" does not exist'),
        (
            AT + 'FATAL:  permission denied for database "photon"\nDETAIL:  User does not have CONNECT privilege.\n',
            "permission denied for database",
        ),
        (UNKNOWN, "unknown host name no-such-host.invalid (Name or service not known)"),
        (UNKNOWN + UNKNOWN.replace("no-such-host", "other"), "no-such-host.invalid, other.invalid"),
        ('could not translate host name "pg9" to address: No address associated with hostname\n', "pg9"),
        # libpq stops at the first host that refuses the login: the hosts before it failed some other way.
        (REFUSED + AT + 'FATAL:  password authentication failed for user "photon_pw"\n', "password authentication"),
        (UNKNOWN + AT + 'FATAL:  database "nodb" does not exist\n', "nodb"),
        ('invalid integer value "abc" for connection option "port"\n', 'invalid integer value "abc"'),
        ('invalid target_session_attrs value: "rw"\n', "target_session_attrs"),
        ("could not match 3 port numbers to 2 hosts\n", "could not match 3 port numbers"),
    ],
)
def test_a_wrong_dsn_is_told_apart(message: str, reason: str) -> None:
    found = wrong_dsn_reason(message)
    assert found is not None and reason in found and "\n" not in found


@pytest.mark.parametrize(
    "message",
    [
        REFUSED,
        AT + "timeout expired\n",
        AT + "FATAL:  the database system is starting up\n",
        AT + "FATAL:  the database system is in recovery mode\n",
        AT + "FATAL:  the database system is shutting down\n",
        AT + "FATAL:  the database system is not yet accepting connections\nDETAIL:  Consistent recovery state has "
        "not been yet reached.\n",
        AT + "session is read-only\n",  # a standby found first (target_session_attrs=read-write)
        AT + "server is in hot standby mode\n",
        AT + "FATAL:  sorry, too many clients already\n",
        AT + "server closed the connection unexpectedly\n\tThis probably means the server terminated abnormally\n",
        'could not translate host name "pg1" to address: Temporary failure in name resolution\n',  # no DNS answer
        # One host of the list unknown (a node gone from DNS), another down or not yet promoted: a failover.
        UNKNOWN + REFUSED,
        REFUSED + UNKNOWN,
        UNKNOWN + AT + "session is read-only\n",
        "something libpq never said before\n",  # not recognised: retried, as every failure was before
    ],
)
def test_a_server_away_is_not_a_wrong_dsn(message: str) -> None:
    assert wrong_dsn_reason(message) is None


def failure_of(fn: Callable[[], object]) -> tuple[BaseException, float]:
    started = time.monotonic()
    try:
        fn()
    except Exception as exc:
        return exc, time.monotonic() - started
    raise AssertionError("no error")


@pytest.mark.parametrize(
    "dsn",
    [
        "host=no-such-host.invalid port=5432 user=photon password=s3cret dbname=photon connect_timeout=2",
        "host=no-such-host.invalid,other-host.invalid port=5432 user=photon password=s3cret dbname=photon",
        "postgresql://photon:s3cret@no-such-host.invalid:5432/photon?target_session_attrs=read-write",
    ],
)
def test_an_unknown_host_fails_at_once(dsn: str) -> None:
    # A real name lookup (.invalid never resolves, RFC 6761), under the whole default failover budget.
    exc, took = failure_of(lambda: across_failover(lambda: connect(dsn), budget_s=45))
    assert isinstance(exc, RegistryDsnError), exc
    assert took < 5, f"{took:.1f} s"
    text = str(exc)
    assert "no-such-host.invalid" in text and "unknown host name" in text and "s3cret" not in text
    assert "\n" not in text


def test_a_list_with_an_unknown_host_and_one_away_is_retried() -> None:
    # The other host is down (a closed port): a failover in progress, retried for the budget.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dsn = f"host=no-such-host.invalid,127.0.0.1 port={port},{port} user=photon dbname=photon connect_timeout=2"
    exc, took = failure_of(lambda: across_failover(lambda: connect(dsn), budget_s=1.5))
    assert isinstance(exc, RegistryUnavailableError), exc
    assert took >= 1.5


@pytest.mark.parametrize(
    "dsn",
    [
        "host=127.0.0.1 port password=s3cret",
        "postgresql://photon:s3cret@[::1/photon",  # libpq quotes the whole URI back
        "host=127.0.0.1 frobnicate=1 password='s3 cret'",
        "host=127.0.0.1 port=abc password=s3cret",
        "host=127.0.0.1 target_session_attrs=rw password=s3cret",
    ],
)
def test_an_unparsable_dsn_fails_at_once_without_its_password(dsn: str) -> None:
    exc, took = failure_of(lambda: across_failover(lambda: connect(dsn), budget_s=45))
    assert isinstance(exc, RegistryDsnError), exc
    assert took < 5
    text = str(exc)
    assert "s3cret" not in text and "s3 cret" not in text and "\n" not in text and "wrong registry DSN" in text


def test_the_failover_budget_runs_from_the_first_failure() -> None:
    # A long pass (a verifier's over a large registry) that loses its server after more than the budget of work is
    # still retried for the whole budget: the failover starts when the server is lost, not when the pass started.
    calls: list[float] = []

    def long_pass() -> str:
        calls.append(time.monotonic())
        if len(calls) == 1:
            time.sleep(0.6)  # work, then the server goes away
            raise RegistryUnavailableError("lost")
        return "done"

    assert across_failover(long_pass, budget_s=0.5) == "done"
    assert len(calls) == 2


def test_the_executors_registry_retries_a_failover_as_long_as_the_driver_is_told(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PHOTON_REGISTRY_FAILOVER_S reaches the registrations Spark's Python workers make (step 5), not only the
    driver's commits: before, the workers' IdRegistry had the 45 s default whatever the setting, so a slower
    failover failed the batch there. The driver passes its budget in the batch's task (a worker on another host
    may not share its environment), and RegistryOptions reads the setting by default."""
    from photon.joiner.tasks import _registry
    from photon.registry.client import RegistryOptions

    monkeypatch.setenv("PHOTON_REGISTRY_FAILOVER_S", "90")
    assert RegistryOptions().failover_s == 90.0
    monkeypatch.delenv("PHOTON_REGISTRY_FAILOVER_S")
    assert RegistryOptions().failover_s == 45.0
    servers = {"main": "host=127.0.0.1 port=1 dbname=x user=x"}
    assert _registry(servers, 20.0, 120.0).options.failover_s == 120.0
    assert _registry(servers, 20.0, 7.0).options.failover_s == 7.0
