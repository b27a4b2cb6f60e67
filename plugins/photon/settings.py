"""Settings from the environment (``PHOTON_*``), with defaults that run on a fresh machine."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# Time, one bound for the whole project: every clock (log writers, the registry's main server, any host that acts)
# is off from true time by at most MAX_CLOCK_SKEW_S (EVENTS.md). Decisions follow the main server's clock
# (photon/registry/clock.py), so two clocks meet in each of them, a writer's and the server's, up to twice the skew
# apart; the margin covers what the clocks do not: a writer's delay between reading its clock and its file becoming
# visible, the offset's measurement error (half a round trip), a batch's length. An event stamped further ahead of
# the server's clock than 2 x skew + margin is refused at the door (joiner) and by the registry alike, and a log
# partition is sealed that long after its end (layout.py). The defaults keep the 60 s both had before.
MAX_CLOCK_SKEW_S = 10.0
TIME_MARGIN_S = 40.0


def time_bound_s(max_clock_skew_s: float) -> float:
    """How far a writer's clock may be ahead of the server's, plus the margin: the seal and the future bound."""
    return 2 * max_clock_skew_s + TIME_MARGIN_S


MAX_FUTURE_S = time_bound_s(MAX_CLOCK_SKEW_S)
# Nothing this project joins was logged before this (2010-01-01T00:00:00Z): an older stamp is a broken clock or
# a corrupt line, not history.
PLAUSIBLE_FROM_US = 1_262_304_000_000_000


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PHOTON_", extra="ignore")

    # The registry's main server (config, shard map, owners, and shards placed on "main"). Unset: embedded PostgreSQL.
    registry_dsn: str | None = None
    # Further registry servers by name, as JSON: {"pg2": "host=... dbname=..."}. Names go in the shard map, DSNs
    # (which may hold secrets) stay out of the database.
    registry_servers: dict[str, str] = Field(default_factory=dict)
    # Does each registry server have to wait for a synchronous standby before it acknowledges a commit (the guard
    # in photon/pg.py, read there from PHOTON_REGISTRY_REPLICATION)? "required": refuse to write otherwise; "single":
    # the deployment accepts one server, whose lost disk loses registrations. Unset: "single" for the embedded server
    # (one server by construction: starting it sets "single"), "required" for any server named otherwise, by
    # PHOTON_REGISTRY_DSN or an Airflow connection. That default breaks an existing
    # single-server deployment, on purpose and loudly: one line at the first write, naming this setting. The quiet
    # alternative is the failure issue 21 is about: asynchronous replication with failover forgets acknowledged
    # registrations and a click is joined twice, with nothing in any log. Saying "single" is one line of config.
    registry_replication: Literal["required", "single"] | None = None
    # How long a write keeps retrying a lost server (whole transactions, a multi-host DSN finding the new primary):
    # a failover takes Patroni's ttl (20 s at least) plus the promotion, so 45 s.
    registry_failover_s: float = 45.0
    # How long a request to an object store is retried (a throttled store, one restarting, a dropped connection)
    # before the work fails and runs again: a batch, a lease start. Within the registry's failover budget; the
    # client's own default (3 minutes) would hold a lease that long on a store that is gone.
    storage_retry_s: float = Field(default=30.0, gt=0, le=300)
    # On an object store, a batch with at least this many MiB of query files first finds its clicks' query ids (a
    # short Spark job over its click files), so that its own queries travel to their clicks through the shuffle
    # instead of being read back from objects another worker parsed. 0: every batch with clicks. Below it (a live
    # batch) the extra job costs more than it saves on a store beside the executors; a store with slower requests
    # gains at smaller batches.
    ship_queries_from_mib: float = Field(default=128.0, ge=0)
    # The key and secret `photon storage up` serves (both or neither): a deployment's S3 server whose other services
    # are given the same (the compose file's). Unset: made on its first start, kept in its folder (mode 600).
    storage_access_key: SecretStr | None = None
    storage_secret_key: SecretStr | None = None
    # Local state: the embedded PostgreSQL's data folder lives here.
    home: Path = Path(".photon")
    # Server clocks are off by at most this much (EVENTS.md).
    max_clock_skew_s: float = MAX_CLOCK_SKEW_S
    # Ids stamped further than this ahead of now are refused as implausible (a bad clock or a corrupt id). Unset:
    # 2 x max_clock_skew_s + TIME_MARGIN_S, so raising the skew raises it too.
    max_future_s: float = MAX_FUTURE_S

    @model_validator(mode="after")
    def _future_follows_skew(self) -> Settings:
        if "max_future_s" not in self.model_fields_set:
            self.max_future_s = time_bound_s(self.max_clock_skew_s)
        return self

    @property
    def seal_s(self) -> float:
        """A log partition is sealed this long after its end by the server's clock (layout.py)."""
        return time_bound_s(self.max_clock_skew_s)


def load_settings() -> Settings:
    return Settings()
