"""The log layout (``docs/EVENTS.md``): closed log files partitioned by the minute they arrived in their replica,

    <logs>/<dc>/<kind>/<YYYYmmdd>/<HHMM>/<name>.jsonl

so a reader that has consumed everything up to a partition never lists it again: finding new files costs what
arrived since, never what arrived in all the months before. A file is named by its path relative to
``<logs>/<dc>/<kind>/`` (``20261122/0355/10.1.2.3-4711-1795320900.jsonl``) in the consumed-file records, the
manifest and quarantine records. Files directly in ``<kind>/`` (the layout before partitions) are still read; their
listing costs what the folder holds.

A writer puts a closed file under the minute it arrives by its own clock, off from true time by at most the maximum
clock skew; readers judge by the registry main server's clock (photon/registry/clock.py), off by at most as much. So
once the server's clock is ``seal_s`` = 2 x skew + margin (``settings.time_bound_s``; 60 s by default) past a
partition's end, no new file can land there: the partition is sealed, and a reader whose every file of it is consumed
moves past it for good.

The output side: ``<out>/<pipeline>/`` holds one pipeline's output and the ``_pipeline.json`` its joiner leaves there,
naming the data center whose logs it read (``data_center_of``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from photon.settings import MAX_CLOCK_SKEW_S, time_bound_s
from photon.storage import Entry, LocalStore, Store, as_store

US = 1_000_000
MINUTE_US = 60 * US
# A partition is sealed this long after its end, at the default skew (settings.Settings.seal_s for the configured one).
SEAL_S = time_bound_s(MAX_CLOCK_SKEW_S)
INPROGRESS = ".inprogress"


def partition_of(ts_us: int) -> str:
    """``YYYYmmdd/HHMM``: the UTC minute of ``ts_us``."""
    return datetime.fromtimestamp(ts_us // MINUTE_US * 60, tz=UTC).strftime("%Y%m%d/%H%M")


def partition_start_us(part: str) -> int:
    return int(datetime.strptime(part, "%Y%m%d/%H%M").replace(tzinfo=UTC).timestamp()) * US


def sealed_before(now_us: int, seal_s: float = SEAL_S) -> str:
    """The oldest partition that may still receive files at ``now_us`` (the registry server's clock): every older
    one is sealed."""
    return partition_of(now_us - int(seal_s * US))


def log_path(logs: Path, dc: str, kind: str, name: str, arrival_us: int) -> Path:
    """Where a closed file ``name`` that arrives at ``arrival_us`` goes."""
    return logs / dc / kind / partition_of(arrival_us) / name


def part_of_name(rel: str) -> str | None:
    """The partition of a relative file name, or None for a file directly in ``<kind>/``."""
    head, sep, _ = rel.rpartition("/")
    return head if sep else None


@dataclass(frozen=True)
class LogFile:
    rel: str  # path relative to <logs>/<dc>/<kind>/
    part: str | None  # its partition; None directly in <kind>/
    entry: Entry | None = None  # as listed from an object store (a folder's files are stat-ed by the caller)

    @property
    def name(self) -> str:
        return self.rel.rpartition("/")[2]


def _is_log(name: str) -> bool:
    return name.endswith(".jsonl") and not name.startswith(".")


def _is_day(name: str) -> bool:
    return len(name) == 8 and name.isdigit()


def _is_minute(name: str) -> bool:
    return len(name) == 4 and name.isdigit()


def list_closed(folder: Path | Store, since: str | None = None) -> Iterator[LogFile]:
    """Closed log files (``*.jsonl``) under ``folder`` = ``<logs>/<dc>/<kind>``: the flat ones, and those of every
    partition at or after ``since`` (all of them if None), oldest partition first. A folder's files are not stat-ed
    (a caller filters out what it has consumed first); an object store's come with their entries, listed from the
    mark on (``since`` sorts before every key of its partition and after every key of the ones before)."""
    if isinstance(folder, LocalStore):
        folder = folder.root
    if not isinstance(folder, Path):
        yield from (LogFile(e.key, None, e) for e in folder.files() if _is_log(e.key))
        for e in folder.listing(after=since):
            parts = e.key.split("/")
            day, minute, name = parts if len(parts) == 3 else ("", "", "")
            if _is_day(day) and _is_minute(minute) and _is_log(name):
                yield LogFile(e.key, f"{day}/{minute}", e)
        return
    try:
        top = list(os.scandir(folder))
    except FileNotFoundError:
        return
    since_day, _, since_minute = (since or "").partition("/")
    for entry in top:
        if entry.name.endswith(".jsonl") and not entry.name.startswith("."):
            yield LogFile(entry.name, None)
    for day in sorted(e.name for e in top if _is_day(e.name) and e.name >= since_day):
        try:
            minutes = sorted(m for m in os.listdir(folder / day) if _is_minute(m))
        except (FileNotFoundError, NotADirectoryError):  # gone, or a file named like a partition: no logs in it
            continue
        for minute in minutes:
            if day == since_day and minute < since_minute:
                continue
            part = f"{day}/{minute}"
            try:
                names = os.listdir(folder / part)
            except (FileNotFoundError, NotADirectoryError):
                continue
            for name in names:
                if name.endswith(".jsonl") and not name.startswith("."):
                    yield LogFile(f"{part}/{name}", part)


def now_us() -> int:
    return int(time.time() * US)


def data_center_of(out: Path | Store, pipeline: str) -> str:
    """The data center whose logs a pipeline read: from the ``_pipeline.json`` the joiner leaves in its folder (a
    backfill pipeline is named apart from its data center), else the folder's name. ``out``: a folder or a store."""
    try:
        return str(json.loads(as_store(out).get(f"{pipeline}/_pipeline.json"))["dc"])
    except FileNotFoundError:
        return pipeline
