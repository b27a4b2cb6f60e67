"""Timestamp-based sharding (Photon section 3.2.3) with a hash that is stable everywhere.

``shard = stable_hash(id) mod n`` where ``n`` comes from the shard configuration in force at the id's own timestamp.
The hash is splitmix64's finaliser over the id's compact key (a bijection of the id, see ``ids.py``): plain integer
arithmetic, the same on every process, machine and Python version; never Python's salted ``hash()``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from photon.logs.ids import EventKeys, parse_id

_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MASK = 0xFFFFFFFFFFFFFFFF
SHARD_TABLE_RE = re.compile(r"^ids_c[1-9][0-9]{0,8}_s(0|[1-9][0-9]{0,4})$")
SERVER_NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,30}$")


def _mix64(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * _C1
    z = (z ^ (z >> np.uint64(27))) * _C2
    return z ^ (z >> np.uint64(31))


def stable_hash_keys(keys: EventKeys) -> np.ndarray:
    """uint64 hash of every key (vectorised; wraps modulo 2**64 by design)."""
    with np.errstate(over="ignore"):
        src_mixed = _mix64(keys.src.view(np.uint64) + _GOLDEN)
        return _mix64(keys.ts_us.view(np.uint64) ^ src_mixed)


def _mix64_int(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def stable_hash(event_id: str) -> int:
    """Pure-Python reference of :func:`stable_hash_keys` for one id."""
    ts_us, src = parse_id(event_id)
    src_mixed = _mix64_int(((src & _MASK) + 0x9E3779B97F4A7C15) & _MASK)
    return _mix64_int((ts_us & _MASK) ^ src_mixed)


@dataclass(frozen=True, order=True)
class ShardRef:
    """One shard: shard ``shard_no`` of configuration ``version``."""

    version: int
    shard_no: int

    @property
    def table(self) -> str:
        name = f"ids_c{self.version}_s{self.shard_no}"
        if not SHARD_TABLE_RE.match(name):
            raise ValueError(f"invalid shard {self}")
        return name

    def __str__(self) -> str:
        return f"c{self.version}/s{self.shard_no}"


@dataclass(frozen=True)
class ShardConfig:
    version: int
    valid_from_us: int
    num_shards: int
    state: str = "active"


class ShardLayout:
    """The active shard configurations and the shard -> server map, as read from the registry."""

    def __init__(self, configs: Iterable[ShardConfig], placement: Mapping[ShardRef, str]):
        active = sorted((c for c in configs if c.state == "active"), key=lambda c: c.valid_from_us)
        if not active:
            raise ValueError("no active shard configuration: run `photon registry init`")
        if active[0].valid_from_us != 0:
            raise ValueError("the first active shard configuration must be valid from 0")
        if len({c.valid_from_us for c in active}) != len(active):
            raise ValueError("two active shard configurations start at the same time")
        self.configs: list[ShardConfig] = active
        self.placement: dict[ShardRef, str] = dict(placement)
        for cfg in active:
            for shard_no in range(cfg.num_shards):
                if ShardRef(cfg.version, shard_no) not in self.placement:
                    raise ValueError(f"shard {cfg.version}/{shard_no} has no server in the shard map")
        self._starts = np.array([c.valid_from_us for c in active], dtype=np.int64)
        self._versions = np.array([c.version for c in active], dtype=np.int64)
        self._counts = np.array([c.num_shards for c in active], dtype=np.uint64)

    @property
    def version(self) -> int:
        """The newest active configuration: a server refuses a client whose layout is older than its own."""
        return max(c.version for c in self.configs)

    def config_at(self, ts_us: int) -> ShardConfig:
        idx = int(np.searchsorted(self._starts, ts_us, side="right")) - 1
        return self.configs[max(idx, 0)]

    def assign(self, keys: EventKeys) -> tuple[np.ndarray, np.ndarray]:
        """(config version, shard number) of every key: the config in force at the key's own timestamp."""
        idx = np.searchsorted(self._starts, keys.ts_us, side="right") - 1
        np.maximum(idx, 0, out=idx)
        shard = (stable_hash_keys(keys) % self._counts[idx]).astype(np.int64)
        return self._versions[idx], shard

    def shard_of(self, event_id: str) -> ShardRef:
        ts_us, _ = parse_id(event_id)
        cfg = self.config_at(ts_us)
        return ShardRef(cfg.version, stable_hash(event_id) % cfg.num_shards)

    def server_of(self, shard: ShardRef) -> str:
        return self.placement[shard]

    def shards(self) -> list[ShardRef]:
        return sorted(self.placement)
