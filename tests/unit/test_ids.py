import numpy as np
import pyarrow as pa
import pytest

from photon.logs.ids import EventKeys, InvalidEventIdError, format_id, parse_id


def test_round_trip_is_exact() -> None:
    ids = [
        "10.1.2.3-4711-1763737200123456",
        "0.0.0.0-0-0",
        "255.255.255.255-4294967295-999999999999999999",
        "192.168.0.1-1-1763737203000001",
    ]
    keys = EventKeys.from_ids(ids)
    assert keys.to_ids() == ids


def test_parse_matches_components() -> None:
    ts, src = parse_id("10.1.2.3-4711-1763737200123456")
    assert ts == 1763737200123456
    assert (src & 0xFFFFFFFFFFFFFFFF) >> 32 == (10 << 24) | (1 << 16) | (2 << 8) | 3
    assert src & 0xFFFFFFFF == 4711


def test_high_addresses_round_trip_through_signed_src() -> None:
    keys = EventKeys.from_ids(["200.1.1.1-7-5"])
    assert keys.src[0] < 0  # stored as a signed bigint
    assert format_id(int(keys.ts_us[0]), int(keys.src[0])) == "200.1.1.1-7-5"


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ("10.1.2-4711-1763737200123456", "canonical"),
        ("10.1.2.3-4711", "canonical"),
        ("010.1.2.3-4711-1763737200123456", "canonical"),  # leading zero: a second spelling of one id
        ("10.1.2.3-04711-1763737200123456", "canonical"),
        ("10.1.2.3-4711-01763737200123456", "canonical"),
        ("10.1.2.3--4711-1763737200123456", "canonical"),
        (" 10.1.2.3-4711-1763737200123456", "canonical"),
        ("10.1.2.3-4711-1763737200123456\n", "canonical"),
        ("10.1.2.3-4711-1763737200123456x", "canonical"),
        ("10.1.2.3-4711-17637372001234567890", "canonical"),  # beyond int64
        ("", "canonical"),
        ("256.1.2.3-4711-1763737200123456", "octet above 255"),
        ("10.1.2.3-4294967296-1763737200123456", "pid above"),
    ],
)
def test_malformed_ids_are_refused_with_a_reason(bad: str, reason: str) -> None:
    with pytest.raises(InvalidEventIdError) as err:
        EventKeys.from_ids(["10.1.2.3-1-1", bad])
    assert err.value.total == 1
    pos, value, why = err.value.problems[0]
    assert (pos, value) == (1, bad)
    assert reason in why


def test_non_strings_and_missing_values_are_refused() -> None:
    with pytest.raises(InvalidEventIdError, match="not a string"):
        EventKeys.from_ids(["10.1.2.3-1-1", 42, None])
    with pytest.raises(InvalidEventIdError, match="missing"):
        EventKeys.from_ids(pa.array(["10.1.2.3-1-1", None], pa.string()))


def test_error_counts_every_bad_id_but_shows_a_few() -> None:
    with pytest.raises(InvalidEventIdError) as err:
        EventKeys.from_ids([f"bad-{i}" for i in range(20)])
    assert err.value.total == 20
    assert "(+15 more)" in str(err.value)


def test_arrow_input_and_empty_input() -> None:
    keys = EventKeys.from_ids(pa.chunked_array([["1.2.3.4-5-6"], ["1.2.3.4-5-7"]]))
    assert keys.ts_us.tolist() == [6, 7]
    assert len(EventKeys.from_ids([])) == 0


def test_keys_must_be_int64_columns() -> None:
    with pytest.raises(TypeError):
        EventKeys(np.arange(3), np.arange(3).astype(np.int32))
