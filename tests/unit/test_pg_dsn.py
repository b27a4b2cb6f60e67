"""DSN handling in photon/pg.py for multi-host DSNs (a client that follows a failover), and the replication guard's
mode from the environment."""

from __future__ import annotations

import psycopg2.extensions
import pytest

from photon.pg import dbname_of, redact, replication_mode, with_dbname

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
