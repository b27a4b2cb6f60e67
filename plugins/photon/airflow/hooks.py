"""``IdRegistryHook``: the registry's servers from the ``photon_registry`` Airflow connection (conn type postgres).

The connection names the ``main`` server; more servers (for shards placed elsewhere) go in its extra as
``{"servers": {"pg2": "host=... dbname=..."}}``. The hook only builds DSNs and hands out the core package's
clients; the operators that run Spark jobs get the DSNs from it at execution time, never at parse time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from airflow.sdk import BaseHook

from photon.registry_admin import init_registry, status


def dsn_from_connection(conn: Any) -> str:
    """A libpq DSN from an Airflow connection (host, port, login, password, schema = database, extra options)."""
    parts = {
        "host": conn.host or "127.0.0.1",
        "port": conn.port,
        "user": conn.login,
        "password": conn.password,
        "dbname": conn.schema or "postgres",
    }
    extra = conn.extra_dejson or {}
    for key in ("sslmode", "sslrootcert", "connect_timeout", "application_name"):
        if key in extra:
            parts[key] = extra[key]

    def quote(v: Any) -> str:
        text = str(v).replace("\\", "\\\\").replace("'", "\\'")
        return f"'{text}'"

    return " ".join(f"{k}={quote(v)}" for k, v in parts.items() if v not in (None, ""))


class IdRegistryHook(BaseHook):
    """The Photon IdRegistry on PostgreSQL, through the ``photon_registry`` connection."""

    conn_name_attr = "photon_registry_conn_id"
    default_conn_name = "photon_registry"
    conn_type = "postgres"
    hook_name = "Photon IdRegistry"

    def __init__(self, photon_registry_conn_id: str = default_conn_name, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.photon_registry_conn_id = photon_registry_conn_id

    def servers(self) -> dict[str, str]:
        """Server name -> DSN: ``main`` from the connection, others from its extra's ``servers``."""
        conn = self.get_connection(self.photon_registry_conn_id)
        servers = {"main": dsn_from_connection(conn)}
        more: Mapping[str, str] = (conn.extra_dejson or {}).get("servers", {})
        if "main" in more:
            raise ValueError(f"connection {self.photon_registry_conn_id}: extra 'servers' cannot redefine 'main'")
        servers.update(more)
        return servers

    def environment(self) -> dict[str, str]:
        """What a Spark job needs to reach the registry (``photon.settings`` reads these)."""
        import json

        servers = self.servers()
        env = {"PHOTON_REGISTRY_DSN": servers.pop("main")}
        if servers:
            env["PHOTON_REGISTRY_SERVERS"] = json.dumps(servers)
        return env

    def init(self, num_shards: int = 4) -> Any:
        return init_registry(self.servers(), num_shards=num_shards)

    def status(self) -> dict[str, Any]:
        return status(self.servers())

    def test_connection(self) -> tuple[bool, str]:
        from photon.pg import connect

        try:
            conn = connect(self.servers()["main"])
        except Exception as exc:  # the UI's "Test" button shows the message
            return False, str(exc)
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT version()")
                return True, str(cur.fetchone()[0])
        finally:
            conn.close()
