"""The seal follows the configured clock skew (EVENTS.md, "Arrival partitions"): with PHOTON_MAX_CLOCK_SKEW_S raised,
a writer within that skew never puts a file into a partition that a reader judging by the registry server's clock
(itself within the skew) has already moved its mark past."""

from __future__ import annotations

import pytest

from photon.logs.layout import partition_of, sealed_before
from photon.settings import load_settings

US = 1_000_000


@pytest.mark.parametrize("skew_s", [10.0, 30.0, 120.0])
def test_a_writer_within_the_configured_skew_never_lands_behind_a_mark(
    monkeypatch: pytest.MonkeyPatch, skew_s: float
) -> None:
    monkeypatch.setenv("PHOTON_MAX_CLOCK_SKEW_S", str(skew_s))
    settings = load_settings()
    assert settings.max_clock_skew_s == skew_s
    seal_s = settings.seal_s
    # Worst case: the writer's clock is skew_s behind true time and the server's skew_s ahead. The writer reads its
    # clock, names the partition, and its file becomes visible `delay_s` later (a rename, a slow filesystem, a
    # paused process); a lease that listed just before that commits its mark from the server's clock then. Every
    # true moment of a few minutes, in steps of a quarter second.
    delay_s = 5.0
    t0 = 1_795_000_000 * US
    for step in range(0, 4 * 180):
        true = t0 + step * US // 4
        writer_partition = partition_of(true - int(skew_s * US))
        listed_at_server = true + int((delay_s + skew_s) * US)
        assert writer_partition >= sealed_before(listed_at_server, seal_s), (skew_s, step)
    # The door's bound follows the skew the same way: an event stamped by a writer skew_s ahead of true time is
    # up to 2 x skew_s ahead of a server skew_s behind.
    assert settings.max_future_s >= 2 * skew_s + delay_s


def test_an_explicit_future_bound_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHOTON_MAX_CLOCK_SKEW_S", "30")
    monkeypatch.setenv("PHOTON_MAX_FUTURE_S", "500")
    assert load_settings().max_future_s == 500.0
    monkeypatch.delenv("PHOTON_MAX_FUTURE_S")
    assert load_settings().max_future_s == 100.0  # 2 x 30 s + the 40 s margin
