"""One clock for decisions that must agree across hosts: the registry main server's.

Which log partitions are sealed (and so the listing marks a pipeline commits, which never move back), a retry's due
time, when a click was first seen, when it is given up as unjoinable, whether an event is stamped too far ahead, the
partition a recovered file lands in: another host or a later lease relies on each of them, so none may follow the
clock of whichever host happens to run the job (GC's thresholds follow the server's clock for the same reason).

Protocol. :meth:`ServerClock.measure` asks the server for its clock a few times on one connection and keeps the
sample with the smallest round trip, taking the server's reading as the midpoint of that round trip: the offset
(server minus this host) is then known to within half of it. :meth:`ServerClock.now_us` is the server's reading
plus the time elapsed since on this host's steady clock (CLOCK_BOOTTIME): a step of this host's wall clock between
two measurements (NTP, ``date -s``) does not move it, and the next measurement sees the step. A joiner measures at
its lease start, before Spark starts, and again every heartbeat period between batches; :meth:`ServerClock.check` raises
:class:`ClockSkewError` (one line: how far off, which bound, what to fix) once the offset exceeds ``max_skew_s``: the
lease does not start, or stops after its current batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from photon.pg import autocommit

US = 1_000_000
# Steady time for "since the last measurement": unlike the wall clock never stepped, and unlike CLOCK_MONOTONIC it
# keeps counting while the machine is suspended (a resumed VM would otherwise take the server's clock to be behind).
_STEADY = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)


def _steady_us() -> int:
    return time.clock_gettime_ns(_STEADY) // 1000


SAMPLES = 5
# The server's clock, in epoch microseconds, without needing any function of the photon schema (any role may ask).
CLOCK_SQL = "SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint"


class ClockSkewError(RuntimeError):
    """This host's clock is further from the registry server's than the configured maximum clock skew."""


@dataclass(frozen=True)
class Offset:
    offset_us: int  # server minus this host
    rtt_us: int  # round trip of the sample it came from: the offset is known to within half of it
    server_us: int = 0  # the server's reading, taken as the round trip's midpoint ...
    mono_us: int = 0  # ... which this host's steady clock (_STEADY) read as this (0: never measured)


def measure_offset(dsn: str, samples: int = SAMPLES) -> Offset:
    """The offset of the server's clock to this host's (server - host), from the sample with the smallest round
    trip of ``samples`` on one connection."""
    best: Offset | None = None
    with autocommit(dsn, application_name="photon-clock") as conn, conn.cursor() as cur:
        for _ in range(max(1, samples)):
            mono_before, before = _steady_us(), time.time_ns() // 1000
            cur.execute(CLOCK_SQL)
            server = int(cur.fetchone()[0])
            after, mono_after = time.time_ns() // 1000, _steady_us()
            mid = (mono_before + mono_after) // 2
            sample = Offset(server - (before + after) // 2, mono_after - mono_before, server, mid)
            if best is None or sample.rtt_us < best.rtt_us:
                best = sample
    assert best is not None
    return best


def skew_message(offset_us: int, max_skew_s: float, who: str = "this host") -> str:
    ahead = offset_us < 0  # the server is behind this host: this host is ahead
    return (
        f"{who}'s clock is {abs(offset_us) / US:.1f} s {'ahead of' if ahead else 'behind'} the registry main "
        f"server's, more than PHOTON_MAX_CLOCK_SKEW_S={max_skew_s:g} s allows: sealed partitions, retry deadlines "
        "and unjoinable decisions would be wrong; synchronise this host's clock (NTP: chrony, systemd-timesyncd) "
        "or the registry server's, then retry"
    )


class ServerClock:
    """The registry main server's clock, read through this host's clock plus a measured offset."""

    def __init__(self, dsn: str, max_skew_s: float, offset: Offset | None = None):
        self.dsn, self.max_skew_s = dsn, max_skew_s
        self.offset = measure_offset(dsn) if offset is None else offset
        self.measured_at = time.monotonic()

    @classmethod
    def assumed(cls, offset_us: int = 0, max_skew_s: float = 10.0) -> ServerClock:
        """A clock taken to be ``offset_us`` from this host's, never measured: for code paths tested without a
        registry (a lease start measures it anyway, and needs one)."""
        return cls("", max_skew_s, Offset(offset_us, 0))

    def measure(self) -> Offset:
        self.offset = measure_offset(self.dsn)
        self.measured_at = time.monotonic()
        return self.offset

    def now_us(self) -> int:
        """The server's clock now: its last reading plus the steady time since (never this host's wall clock,
        which may have been stepped since); an assumed clock, never measured, is this host's plus the offset."""
        if not self.offset.mono_us:
            return time.time_ns() // 1000 + self.offset.offset_us
        return self.offset.server_us + _steady_us() - self.offset.mono_us

    def check(self) -> None:
        """Raise :class:`ClockSkewError` if the last measured offset exceeds the bound (the half round trip it may
        be off by counts in the host's favour: only a host surely off is refused), or if that half round trip itself
        exceeds it: a one-way delay puts the whole error on one side, so ``now_us`` may be that far from the server's
        clock whatever this host's clock is."""
        if abs(self.offset.offset_us) - self.offset.rtt_us // 2 > self.max_skew_s * US:
            raise ClockSkewError(skew_message(self.offset.offset_us, self.max_skew_s))
        if self.offset.rtt_us // 2 > self.max_skew_s * US:
            raise ClockSkewError(
                f"the registry main server's clock cannot be read to within PHOTON_MAX_CLOCK_SKEW_S="
                f"{self.max_skew_s:g} s from this host: its fastest of {SAMPLES} round trips took "
                f"{self.offset.rtt_us / US:.1f} s; sealed partitions and deadlines would be off by up to half of it; "
                "fix the link to the registry (or its load), then retry"
            )
