"""Settings from the environment (``PHOTON_*``), with defaults that run on a fresh machine."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


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
    max_clock_skew_s: float = 10.0
    # Ids stamped further than this ahead of now are refused as implausible (a bad clock or a corrupt id).
    max_future_s: float = 86_400.0


def load_settings() -> Settings:
    return Settings()
