"""``IdRegistryHook``: the registry's servers from the ``photon_registry`` Airflow connection (conn type postgres).

The connection names the ``main`` server; more servers (for shards placed elsewhere) go in its extra as
``{"servers": {"pg2": "host=... dbname=..."}}``. The hook only builds DSNs and hands out the core package's
clients; the operators that run Spark jobs get the DSNs from it at execution time, never at parse time.

Each component runs as its own least-privilege login (a LOGIN role holding one of the NOLOGIN roles the migrations
grant to: ``photon_joiner``, ``photon_verifier``, ``photon_gc``, ``photon_reshard``), through the connection
``photon_registry_<component>``; its extra names that login's DSNs for the other servers. Where a component's
connection is not defined the hook falls back to ``photon_registry`` itself, with a warning: then the component
runs with that login's rights (the owner's, as ``photon airflow`` sets it up on a laptop). Only ``init`` (the
migrations) needs the owner.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from airflow.sdk import BaseHook
from airflow.sdk.exceptions import AirflowNotFoundException

from photon.registry.admin import COMPONENT_ROLES, init_registry, status

if TYPE_CHECKING:
    from photon.storage import Store


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
    # target_session_attrs: a host list (host "pg1,pg2,pg3") reaches whichever node is the primary.
    for key in ("sslmode", "sslrootcert", "connect_timeout", "application_name", "target_session_attrs"):
        if key in extra:
            parts[key] = extra[key]

    def quote(v: Any) -> str:
        text = str(v).replace("\\", "\\\\").replace("'", "\\'")
        return f"'{text}'"

    return " ".join(f"{k}={quote(v)}" for k, v in parts.items() if v not in (None, ""))


Component = Literal["joiner", "verifier", "gc", "reshard"]


def component_conn_id(conn_id: str, component: str) -> str:
    """The connection a component uses: ``photon_registry`` + ``_gc`` -> ``photon_registry_gc``."""
    if component not in COMPONENT_ROLES:
        raise ValueError(f"unknown registry component {component!r}: one of {sorted(COMPONENT_ROLES)}")
    return f"{conn_id}_{component}"


class IdRegistryHook(BaseHook):
    """The Photon IdRegistry on PostgreSQL, through the ``photon_registry`` connection, or with ``component``
    through that component's own connection (``photon_registry_<component>``), falling back to ``photon_registry``
    where it is not defined."""

    conn_name_attr = "photon_registry_conn_id"
    default_conn_name = "photon_registry"
    conn_type = "postgres"
    hook_name = "Photon IdRegistry"

    def __init__(
        self, photon_registry_conn_id: str = default_conn_name, component: Component | None = None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        if component is not None:
            component_conn_id(photon_registry_conn_id, component)  # refuse an unknown component at once
        self.photon_registry_conn_id = photon_registry_conn_id
        self.component = component

    def connection(self) -> Any:
        """The Airflow connection this hook's component uses (read at call time, never cached)."""
        if self.component is None:
            return self.get_connection(self.photon_registry_conn_id)
        conn_id = component_conn_id(self.photon_registry_conn_id, self.component)
        try:
            return self.get_connection(conn_id)
        except AirflowNotFoundException:
            self.log.warning(
                "connection %s is not defined: the %s runs as %s's login, not as a login holding only %s",
                conn_id,
                self.component,
                self.photon_registry_conn_id,
                COMPONENT_ROLES[self.component],
            )
            return self.get_connection(self.photon_registry_conn_id)

    def servers(self) -> dict[str, str]:
        """Server name -> DSN: ``main`` from the connection, others from its extra's ``servers``."""
        conn = self.connection()
        servers = {"main": dsn_from_connection(conn)}
        more: Mapping[str, str] = (conn.extra_dejson or {}).get("servers", {})
        if "main" in more:
            raise ValueError(f"connection {conn.conn_id}: extra 'servers' cannot redefine 'main'")
        servers.update(more)
        return servers

    def environment(self) -> dict[str, str]:
        """What a Spark job needs to reach the registry (``photon.settings`` reads these)."""
        import json

        servers = self.servers()
        from photon.pg import REPLICATION_ENV, replication_mode

        # The deployment's replication rule as this process has it: a job handed a DSN would otherwise take the
        # DSN default (required), also for the embedded server.
        env = {"PHOTON_REGISTRY_DSN": servers.pop("main"), REPLICATION_ENV: replication_mode()}
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


class ObjectStoreHook(BaseHook):
    """The S3-compatible store the logs and the output are on (``s3://`` Variables), through the ``photon_storage``
    connection, of Amazon's type ``aws`` and read as Amazon's provider reads it: login the access key id, password
    the secret access key, extra ``endpoint_url`` and ``region_name``. Where it is not defined, nothing: the
    worker's own ``AWS_*`` variables (or an instance role) apply. The secret reaches a job through its environment
    only, never its command line or its Spark configuration. (A cluster's executors read the store with their
    workers' own environment.)"""

    conn_name_attr = "photon_storage_conn_id"
    default_conn_name = "photon_storage"
    conn_type = "aws"
    hook_name = "Photon object store"

    def __init__(self, photon_storage_conn_id: str = default_conn_name, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.photon_storage_conn_id = photon_storage_conn_id

    def options(self) -> dict[str, str]:
        """The store's options for ``photon.storage.open_store`` (read at call time); {} without the connection."""
        try:
            conn = self.get_connection(self.photon_storage_conn_id)
        except AirflowNotFoundException:
            return {}
        extra = conn.extra_dejson or {}
        found = {
            "aws_access_key_id": conn.login,
            "aws_secret_access_key": conn.password,
            "aws_endpoint_url": extra.get("endpoint_url") or conn.host,
            "aws_region": extra.get("region_name"),
        }
        return {k: str(v) for k, v in found.items() if v}

    def open(self, where: str) -> Store:
        """The store ``where`` names (a folder, or an ``s3://`` URL reached with this connection's options)."""
        from photon.storage import open_store

        return open_store(where, self.options() if where.startswith("s3://") else None)

    def environment(self) -> dict[str, str]:
        """The same as the standard AWS variables, for a job's environment."""
        env = {k.upper(): v for k, v in self.options().items()}
        if env.get("AWS_ENDPOINT_URL", "").startswith("http://"):
            env["AWS_ALLOW_HTTP"] = "true"
        return env
