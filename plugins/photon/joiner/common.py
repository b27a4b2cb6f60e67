"""What the joiner's parts share: its settings, its constants (the reasons it writes, the counts a batch reports),
the result of a batch, the name of a batch's files and the tests' crash points. Imports no other part."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from photon.settings import MAX_CLOCK_SKEW_S, MAX_FUTURE_S, time_bound_s

US = 1_000_000

SETTLE_S = 5.0  # see JoinSettings.settle_s
READ_MARKERS = "_read"  # under a batch's stage: per stage-1 task, the files it left for later and the sizes it read
HOLD_POLL_S = 0.25  # while a lease holds on for a starting standby, how often it asks whether it is ready
SUCCESSOR_WAIT_S = 1.5  # ...and how long it waits for an answer (the registry answers in milliseconds)

REASON_TOO_LATE = "query not found within the maximum join delay"
REASON_GC = "older than the registry's garbage-collection threshold"
REASON_LOG_GONE = (
    "its query was stored, but its line in the query logs no longer reads back (log file removed or changed): keep "
    "query logs as long as the registry's retention"
)
RECOVER_RETRIES = (
    "It was synced before its batch committed, so it was damaged since. Restore it from a backup of the output "
    "folder, or move it aside (mv FILE FILE.corrupt): the pipeline then goes on, and the clicks that were waiting in "
    "it get no outcome from this pipeline (the other data center's can still join them; `photon audit` lists any "
    "click left without an outcome)."
)
REASON_BEFORE = "stamped before 2010-01-01: not a plausible time"
JOIN_COUNTS = (
    "clicks",
    "retries_in",
    "prefiltered",
    "cache_lookups",
    "cache_hits",
    "joined",
    "won_again",
    "wasted",
    "unjoinable",
    "retried",
    "registry_txns",
    "registry_rows",
    "registry_retries",
)
RECOVERED_PREFIX = "recovered-"  # the verifier's re-dispatched clicks: taken first, their deadline from then
AS_IT_IS = (-1, "")  # ``read_whole``'s ``settled_as`` for a file still changing past the seal bound: read as it is

# Where a new live pipeline starts reading (README, "Where a live pipeline starts"): every file in the logs, the
# registry server's clock when the pipeline is created, or a time in epoch microseconds.
BEGINNING: Literal["beginning"] = "beginning"
NOW: Literal["now"] = "now"
Start = Literal["beginning", "now"] | int


@dataclass(frozen=True)
class JoinSettings:
    max_join_delay_s: float = 120.0
    trigger_interval_s: float = 1.0
    retry_base_s: float = 1.0  # first retry after this long, doubling up to retry_max_s
    retry_max_s: float = 16.0
    bucket_s: int = 10  # EventStore time bucket: a lookup hashes the ids of the buckets its clicks need
    cache_buckets: int = 180  # buckets of queries kept in each Python worker (the CacheEventStore): 30 minutes...
    cache_max_rows: int = 20_000_000  # ...or fewer indexed queries (about 60 bytes each), about a gigabyte
    max_click_files: int = 2_000  # per batch; every new query file is always taken (the EventStore comes first)
    adapter: str = "photon.joiner.adapter:default_adapter"
    parallelism: int | None = None  # tasks per stage; None: the session's default parallelism (its cores)
    # A backfill's window: only click files whose first event is stamped in [window_start_us, window_end_us), and
    # query files from max_join_delay_s + window_margin_s before it to window_margin_s after it, so the window's
    # clicks find their queries. The margin must exceed the time one log file spans. None: every file.
    window_start_us: int | None = None
    window_end_us: int | None = None
    window_margin_s: float = 120.0
    # A live joiner heartbeats this often, idle or not; the verifier's grace period must be several times longer.
    heartbeat_s: float = 5.0
    # An event stamped further ahead of the registry server's clock is decided at the door (a click: unjoinable/, a
    # query: quarantine/), and the registry refuses such ids with the same bound: twice the skew plus a margin.
    max_future_s: float = MAX_FUTURE_S
    # Every clock is off from true time by at most this much (EVENTS.md): a lease whose host is further from the
    # registry server's refuses to run; the seal follows it (settings.time_bound_s).
    max_clock_skew_s: float = MAX_CLOCK_SKEW_S
    # Where a new live pipeline starts reading (``Start``). Recorded in the registry when the pipeline is created and
    # read back by every lease after: a pipeline's start never moves. A backfill's window is its range instead.
    start: Start = BEGINNING

    @property
    def seal_s(self) -> float:
        return time_bound_s(self.max_clock_skew_s)

    # A closed file that is empty or whose last byte is not a newline is taken only once it has not changed for this
    # long (a copy still being written, EVENTS.md "Closed files"); a whole file is taken at once.
    settle_s: float = SETTLE_S


@dataclass
class BatchResult:
    batch_seq: int
    metrics: dict[str, Any] = field(default_factory=dict)


def _maybe_crash(point: str, batch_seq: int, lease_batch: int) -> None:
    """Fault injection for tests: PHOTON_CRASH_AT=<point>@<batch> kills this process with SIGKILL right there;
    ``<point>@+<n>`` at the lease's n-th batch; ``...:SIGTERM`` (or another signal's name) sends that signal instead,
    as an operator's stop would land mid-batch (``:group-SIGTERM``: to the whole process group, Spark's JVM too, as
    systemd stops a service); several, comma-separated."""
    for spec in os.environ.get("PHOTON_CRASH_AT", "").split(","):
        where, _, name = spec.partition(":")
        if where in (f"{point}@{batch_seq}", f"{point}@+{lease_batch}"):
            print(f"PHOTON_CRASH_AT: killed at {point} in batch {batch_seq} ({spec})", file=sys.stderr, flush=True)
            if name.startswith("group-"):
                os.killpg(os.getpgrp(), signal.Signals[name.removeprefix("group-")])
            else:
                os.kill(os.getpid(), signal.Signals[name] if name else signal.SIGKILL)


def batch_tag(batch: int, epoch: int) -> str:
    """The name a batch's staged files start with: its number and the epoch of the lease that ran it."""
    return f"b{batch:010d}-e{epoch}"


def epoch_of_tag(name: str) -> int | None:
    """The lease epoch a ``batch_tag`` names, or None if ``name`` is not one."""
    m = re.fullmatch(r"b\d{10}-e(\d+)", name)
    return int(m.group(1)) if m else None


def _fingerprint() -> str:
    """The photon package's source as this process loaded it: its files' names and contents, hashed (about 2 ms)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(f"{f.relative_to(root)}\n".encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


# Taken at import: a Python worker that a Spark Connect server keeps alive keeps the code it imported, whatever
# the files became since.
CODE_FINGERPRINT = _fingerprint()


class CodeMismatchError(RuntimeError):
    pass


def code_fingerprint(adapter: str) -> str:
    """The code a batch's tasks run: the photon package (``CODE_FINGERPRINT``) and, for an adapter outside it, the
    adapter module's source as this process finds it (a Spark Connect server's workers import the adapter from their
    own path)."""
    module = adapter.partition(":")[0]
    if module == "photon" or module.startswith("photon."):
        return CODE_FINGERPRINT
    import importlib

    path = getattr(importlib.import_module(module), "__file__", None)
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16] if path else "no-source"
    return f"{CODE_FINGERPRINT}+{module}:{digest}"


def check_code(driver_fingerprint: str, adapter: str) -> None:
    """Refuse to run a batch's task with other code than its driver's (``code_fingerprint``): a long-lived Spark
    Connect server's Python workers imported the package when they started, and import the adapter from the
    server's path."""
    if driver_fingerprint and driver_fingerprint != (mine := code_fingerprint(adapter)):
        raise CodeMismatchError(
            f"this Spark worker runs other code ({mine}) than the joiner that sent the task ({driver_fingerprint}): "
            "the photon package or the adapter differ from the server's (or changed since it started); restart it "
            "(photon spark-connect) from the joiner's checkout, with the adapter on its PYTHONPATH"
        )
