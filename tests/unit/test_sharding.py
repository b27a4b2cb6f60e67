import numpy as np
import pytest

from photon.logs.ids import EventKeys
from photon.registry.sharding import ShardConfig, ShardLayout, ShardRef, _mix64_int, stable_hash, stable_hash_keys

# Pinned values: if these change, every existing registry would look for its ids in the wrong shard.
GOLDEN = {
    "10.1.2.3-4711-1763737200123456": 0x78E88D0436F500AF,
    "0.0.0.0-0-0": 0x48218226FF3CD4BF,
    "255.255.255.255-4294967295-1763737299999999": 0xF314BA8C2F834329,
}


def test_mixer_is_splitmix64() -> None:
    # splitmix64's first output for seed 0 (Steele, Lea, Flood 2014; Vigna's reference C code).
    assert _mix64_int(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF


def test_hash_is_pinned() -> None:
    got = {i: stable_hash(i) for i in GOLDEN}
    assert got == GOLDEN


def test_vectorised_hash_equals_reference() -> None:
    rng = np.random.default_rng(7)
    ids = [
        f"{a}.{b}.{c}.{d}-{p}-{t}"
        for a, b, c, d, p, t in zip(
            *(rng.integers(0, 256, 300) for _ in range(4)),
            rng.integers(0, 2**32, 300),
            rng.integers(0, 10**17, 300),
            strict=True,
        )
    ]
    vec = stable_hash_keys(EventKeys.from_ids(ids))
    assert [int(h) for h in vec] == [stable_hash(i) for i in ids]


def test_shards_are_balanced() -> None:
    rng = np.random.default_rng(1)
    n = 120_000
    ts = 1763737200000000 + np.arange(n, dtype=np.int64) * 17  # sequential timestamps, one server
    src = np.full(n, (10 << 56) | 4711, dtype=np.int64)
    layout = ShardLayout([ShardConfig(1, 0, 12)], {ShardRef(1, s): "main" for s in range(12)})
    _, shard = layout.assign(EventKeys(ts, src + rng.integers(0, 3, n)))
    counts = np.bincount(shard, minlength=12)
    assert counts.min() > 0.95 * n / 12 and counts.max() < 1.05 * n / 12


def test_config_in_force_at_the_ids_own_timestamp() -> None:
    layout = ShardLayout(
        [ShardConfig(1, 0, 4), ShardConfig(2, 1_000, 12), ShardConfig(3, 5_000, 1, "planned")],
        {**{ShardRef(1, s): "main" for s in range(4)}, **{ShardRef(2, s): "pg2" for s in range(12)}},
    )
    assert layout.config_at(999).version == 1
    assert layout.config_at(1_000).version == 2
    assert layout.config_at(10**15).version == 2  # a planned config is not in force
    keys = EventKeys.from_ids(["1.1.1.1-1-999", "1.1.1.1-1-1000"])
    versions, shards = layout.assign(keys)
    assert versions.tolist() == [1, 2]
    assert shards[0] == stable_hash("1.1.1.1-1-999") % 4
    assert shards[1] == stable_hash("1.1.1.1-1-1000") % 12
    assert layout.shard_of("1.1.1.1-1-1000") == ShardRef(2, int(shards[1]))
    assert layout.server_of(ShardRef(2, 0)) == "pg2"


def test_layout_rejects_incomplete_configuration() -> None:
    with pytest.raises(ValueError, match="no active"):
        ShardLayout([], {})
    with pytest.raises(ValueError, match="valid from 0"):
        ShardLayout([ShardConfig(1, 5, 1)], {ShardRef(1, 0): "main"})
    with pytest.raises(ValueError, match="no server"):
        ShardLayout([ShardConfig(1, 0, 2)], {ShardRef(1, 0): "main"})


def test_shard_table_names_are_checked() -> None:
    assert ShardRef(3, 11).table == "ids_c3_s11"
    with pytest.raises(ValueError):
        _ = ShardRef(0, 1).table
