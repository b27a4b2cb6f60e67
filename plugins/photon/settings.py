"""Settings from the environment (``PHOTON_*``), with defaults that run on a fresh machine."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

# Event time sanity, one bound for the whole project: server clocks are off by at most MAX_CLOCK_SKEW_S (EVENTS.md),
# and the host judging an event (a joiner's executor, the registry client) may itself be off by up to the margin.
# An event stamped further ahead than their sum is refused at the door (joiner) and by the registry alike.
MAX_CLOCK_SKEW_S = 10.0
FUTURE_MARGIN_S = 50.0
MAX_FUTURE_S = MAX_CLOCK_SKEW_S + FUTURE_MARGIN_S
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
    # Local state: the embedded PostgreSQL's data folder lives here.
    home: Path = Path(".photon")
    # Server clocks are off by at most this much (EVENTS.md).
    max_clock_skew_s: float = MAX_CLOCK_SKEW_S
    # Ids stamped further than this ahead of now are refused as implausible (a bad clock or a corrupt id).
    max_future_s: float = MAX_FUTURE_S


def load_settings() -> Settings:
    return Settings()
