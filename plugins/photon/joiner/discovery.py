"""Which log files a batch takes: listing the new closed files from the pipeline's marks on, waiting for a copy still
being written to settle, noticing a consumed file that changed, moving the listing marks past sealed partitions, a
backfill's window and where a live pipeline starts. Driver side; one ``Discovery`` per joiner, kept across its
leases.

Where a live pipeline starts (README, "Where a live pipeline starts"): a pipeline created with a start ``S`` takes
every click file that arrived in ``partition_of(S)`` or later, whatever its events' time (a replica catching up, a
recovered file: the rules for late files hold as before), and a click file that arrived earlier only if its first
event is stamped at or after ``S``. Every other click file is history, a backfill's: its first event lies before
``S``, in an hour that starts before ``S``, and a backfill of that hour lists the partition it arrived in. So each
click file belongs to the live pipeline or to the backfill of one hour, and a file in both (a late arrival) is let
into the output once by the registry. Its queries: those that arrived from the start on it consumes itself, those
before come from the data center's shared query index (``query_index``), as a backfill's do.
"""

from __future__ import annotations

import contextlib
import json
import logging
import stat
import time
from collections.abc import Callable
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

from photon.joiner.common import AS_IT_IS, RECOVERED_PREFIX, US, JoinSettings
from photon.joiner.tasks import ends_whole
from photon.logs.layout import (
    MINUTE_US,
    LogFile,
    list_closed,
    part_of_name,
    partition_of,
    partition_start_us,
    sealed_before,
)
from photon.logs.schemas import RAW_CAP_BYTES
from photon.registry.clock import ServerClock
from photon.storage import Entry, LocalStore, NotFoundError, Store, locate

log = logging.getLogger(__name__)


class Discovery:
    def __init__(self, logs: Path | Store, dc: str, pipeline: str, settings: JoinSettings, clock: ServerClock):
        """Lists ``<logs>/<dc>`` (a folder or an object store), for pipeline ``pipeline`` (its name in logs), by the
        registry server's ``clock``."""
        self.store = logs if not isinstance(logs, Path) else LocalStore(logs)
        self.dc, self.pipeline, self.s, self.clock = dc, pipeline, settings, clock
        self.kinds = {kind: self.store.child(f"{dc}/{kind}") for kind in ("queries", "clicks")}
        self.consumed: set[tuple[str, str]] = set()
        # Per kind, the oldest log partition still to list (layout.py); None: every partition.
        self.marks: dict[str, str | None] = {"queries": None, "clicks": None}
        self.next_marks: dict[str, str | None] = dict(self.marks)  # the marks the next batch commits
        self.start_us: int | None = None  # where this live pipeline started (None: the beginning of the logs)
        self._first_ts: dict[tuple[str, str], int] = {}
        # (kind, file) -> (size, etag, inode) as this lease's batches read it: a consumed file that changes after is
        # reported once (``changed``, quarantined by the next batch), never silently left half read.
        self._read_sizes: dict[tuple[str, str], tuple[Any, ...]] = {}
        self.changed: list[dict[str, Any]] = []
        # Files seen torn or empty: (size, etag, monotonic time seen so since, first seen changing), and those seen
        # settle (``_settled``)
        self._seen: dict[tuple[str, str], tuple[int, str, float, float]] = {}
        self.settled_as: dict[tuple[str, str], tuple[int, str]] = {}
        self._not_files: set[tuple[str, str]] = set()
        self.sizes: dict[tuple[str, str], int] = {}  # the files the last listing found new: their sizes then
        self._whole: dict[tuple[str, str], str] = {}  # listed, not consumed, seen whole: its etag then

    def restart(
        self, marks: dict[str, str | None], consumed: set[tuple[str, str]], start_us: int | None = None
    ) -> None:
        """At a lease's start: the marks and consumed files as committed (or where a new pipeline starts), and the
        start the pipeline was created with."""
        self.marks = marks
        self.next_marks = dict(self.marks)
        self.consumed = consumed
        self.start_us = None if self.s.window_start_us is not None else start_us

    def first_marks(self, start_us: int | None, now_us: int) -> dict[str, str | None]:
        """Where a new pipeline starts listing: for a backfill window the partitions its files can have arrived in (a
        file arrives after its first event, give or take the clock skew); for a live pipeline, from its start
        (``start_marks``) by the registry server's clock ``now_us``."""
        s = self.s
        if s.window_start_us is None:
            return start_marks(start_us, now_us, s.seal_s)
        seal = int(self.s.seal_s * US)
        first_query = s.window_start_us - int((s.max_join_delay_s + s.window_margin_s) * US)
        return {"queries": partition_of(first_query - seal), "clicks": partition_of(s.window_start_us - seal)}

    def new_files(self) -> tuple[list[str], list[str]]:
        """New closed files, oldest arrival first, and the verifier's re-dispatched clicks before any other: under a
        backlog bigger than ``max_click_files`` no file waits behind later ones, whatever its name. Only partitions
        from the pipeline's mark on are listed; the marks the batch will commit move past partitions that are
        sealed and left with nothing to consume."""
        sealed = sealed_before(self.clock.now_us(), self.s.seal_s)  # the server's clock: marks never move back

        seen: dict[tuple[str, str], tuple[int, str, float, float]] = {}
        whole: dict[tuple[str, str], str] = {}
        sizes: dict[tuple[str, str], int] = {}
        self.settled_as = {}

        def listing(kind: str, cap: int | None) -> list[str]:
            store = self.kinds[kind]
            new, settling = [], []
            for f in list_closed(store, self.marks[kind]):
                if (kind, f.rel) in self.consumed:
                    self._check_consumed(kind, store, f)
                    continue
                entry = f.entry
                try:
                    if entry is None:  # a folder's file, stat-ed only now (a backlog's listing is mostly consumed)
                        assert isinstance(store, LocalStore)  # only a folder's listing leaves entries out
                        st = store.stat(f.rel)
                        if not stat.S_ISREG(st.st_mode):  # a directory named like a log file: not one, never read
                            if (kind, f.rel) not in self._not_files:
                                self._not_files.add((kind, f.rel))
                                log.error("%s: %s/%s is not a regular file: skipped", self.pipeline, kind, f.rel)
                            continue
                        entry = LocalStore.entry_of(f.rel, st)
                    if not store.atomic and not self._settled(kind, store, entry, seen, whole):
                        settling.append(f.rel)  # a copy still being written: no batch for it yet
                        continue
                except FileNotFoundError:  # gone since it was listed
                    continue
                except OSError as exc:  # unreadable now (permissions, a stale NFS handle): held, said
                    log.error("%s: %s/%s cannot be read yet: %s", self.pipeline, kind, f.rel, exc)
                    settling.append(f.rel)
                    continue
                new.append((not f.name.startswith(RECOVERED_PREFIX), entry.modified_us, f.rel))
                sizes[(kind, f.rel)] = entry.size
            mine = [n for _, _, n in sorted(new) if self._in_window(kind, n)]
            chosen = mine[:cap] if cap is not None else mine
            taken = set(chosen)
            # A live pipeline's history before its start is never its own (a closed file's first event never
            # changes): it does not hold the mark back, or every trigger would list from there for good. A backfill's
            # files outside its window do, as before: its re-run lists its window's whole arrival range again.
            held = [n for _, _, n in new] if self.s.window_start_us is not None else mine
            left = [p for n in held if n not in taken and (p := part_of_name(n)) is not None]
            left += [p for n in settling if (p := part_of_name(n)) is not None]
            mark = min([*left, sealed])
            # Never back: the lease before found everything behind its mark sealed and consumed, and this lease
            # loaded no consumed-file record from there (a host whose clock is behind would list it again).
            self.next_marks[kind] = mark if self.marks[kind] is None else max(mark, self.marks[kind] or "")
            return chosen

        found = listing("queries", None), listing("clicks", self.s.max_click_files)
        self._seen, self._whole = seen, whole  # only files listed now: bounded by them, not every file ever listed
        self.sizes = sizes
        return found

    def _settled(self, kind: str, store: Store, e: Entry, seen: dict[Any, Any], whole: dict[Any, Any]) -> bool:
        """Whether a listed file of a folder may be read now: it ends with a newline (whole: at once), or this lease
        has seen it with the same size and tag (inode, size, mtime) for ``settle_s`` by its own monotonic clock (an
        empty or torn-tailed file: a copy still being written, or a crashed writer's). Never by the mtime's age: the
        file server's clock may be the maximum skew off this host's, either way, or set by ``touch -d``. A settled
        torn file is read only as seen (``_Task.settled``). One still changing after the seal bound (``seal_s``, 60
        s) since first seen so is taken as it is then, with a logged error: waiting longer would hold the listing
        mark back for good (every batch listing every partition since); what it gains after is reported as a
        consumed file's change. (An object store's objects appear whole: never asked.)"""
        key = (kind, e.key)
        if self._whole.get(key) == e.etag or ends_whole(store, e):
            whole[key] = e.etag  # not opened again while it stays so (a backlog is listed at every batch)
            return True
        now = time.monotonic()
        size, etag, since, first = self._seen.get(key, (-1, "", now, now))
        if (size, etag) != (e.size, e.etag):
            since = now
        overdue = now - first >= self.s.seal_s
        if now - since >= self.s.settle_s or overdue:
            if overdue and now - since < self.s.settle_s:
                log.error(
                    "%s: %s/%s still changing %.0f s after it was first listed (%d bytes now): taken as it is; a "
                    "closed file must be renamed into place whole (EVENTS.md)",
                    self.pipeline, kind, e.key, now - first, e.size,
                )  # fmt: skip
            self.settled_as[key] = AS_IT_IS if overdue else (e.size, e.etag)
        seen[key] = (e.size, e.etag, since, first)  # kept while listed (taken, not consumed yet)
        return key in self.settled_as

    def _check_consumed(self, kind: str, store: Store, f: LogFile) -> None:
        """A file this lease consumed must never change (EVENTS.md). If it did (appended in place, a copy that paused
        at a line's end, a replica re-shipped, an object put again under its key: another ETag), say so once: a
        logged error now, and a quarantine record naming the file and the bytes never read, written by the next
        batch."""
        rel = f.rel
        seen = self._read_sizes.get((kind, rel))
        if seen is None:
            return
        try:
            # A folder's entry stat-ed whatever it is now: a named pipe or a directory in its place is a change too.
            e = f.entry or (
                LocalStore.entry_of(rel, store.stat(rel)) if isinstance(store, LocalStore) else store.head(rel)
            )
        except FileNotFoundError:
            return
        except OSError as exc:
            log.error("%s: %s/%s cannot be checked: %s", self.pipeline, kind, rel, exc)
            return
        if e is None or (e.size, e.etag, e.inode) == seen:
            return
        del self._read_sizes[(kind, rel)]  # reported once
        size = seen[0]
        raw = b""
        if store.atomic or e.inode != seen[2]:  # another file renamed into its place (another object): none read
            with contextlib.suppress(OSError):
                raw = store.get_ranges(rel, [(0, RAW_CAP_BYTES)])[0]
            size = 0
            what = f"replaced by another file after it was consumed (its {e.size} bytes never read)"
        elif e.size > size:
            with contextlib.suppress(OSError):
                raw = store.get_ranges(rel, [(size, size + RAW_CAP_BYTES)])[0]
            what = f"{e.size - size} bytes appended after it was consumed (bytes {size}..{e.size} never read)"
        else:
            what = f"rewritten after it was consumed ({size} bytes read, {e.size} bytes now; the change not read)"
        reason = f"closed file changed: {what}; writers must rename a file into place whole (EVENTS.md)"
        log.error("%s: %s/%s: %s", self.pipeline, kind, rel, reason)
        self.changed.append(
            {"kind": kind, "file": rel, "line": 0, "raw": raw, "raw_bytes": max(0, e.size - size), "reason": reason}
        )

    def _behind_marks(self, kind: str, rel: str) -> bool:
        """A log file in a partition behind its kind's mark: it is never listed again."""
        part, mark = part_of_name(rel), self.marks.get(kind)
        return part is not None and mark is not None and part < mark

    def _in_window(self, kind: str, rel: str) -> bool:
        """Whether a listed file is this pipeline's: in a backfill's window, or not history before a live pipeline's
        start (``is_after_start``)."""
        s = self.s
        try:
            if s.window_start_us is None or s.window_end_us is None:
                if self.start_us is None or kind != "clicks":
                    return True
                return is_after_start(rel, self.start_us, lambda: self._first_event(kind, rel))
            start, end = s.window_start_us, s.window_end_us
            if kind == "queries":
                start -= int((s.max_join_delay_s + s.window_margin_s) * US)
                end += int(s.window_margin_s * US)
            return start <= self._first_event(kind, rel) < end
        except OSError:  # gone or unreadable since it was listed: the batch's reading decides (and says)
            return True

    def _first_event(self, kind: str, rel: str) -> int:
        if (kind, rel) not in self._first_ts:
            self._first_ts[(kind, rel)] = first_event_us(self.kinds[kind], rel)
        return self._first_ts[(kind, rel)]

    def committed(
        self,
        files: list[tuple[str, str]],
        read: dict[tuple[str, str], tuple[int, ...]],
        reported: int,
        marks: dict[str, str | None],
    ) -> None:
        """After a batch committed (and published) ``files`` as read (``read``), the first ``reported`` changed files
        and ``marks``: they are consumed, and what is behind the marks is forgotten (it is never listed again)."""
        self.consumed.update(files)
        self._read_sizes.update({f: read[f] for f in files if f in read})
        del self.changed[:reported]
        if marks != self.marks:
            self.marks = marks
            self.consumed = {
                (kind, n)
                for kind, n in self.consumed
                if (p := part_of_name(n)) is None or (m := marks[kind]) is None or p >= m
            }
            self._first_ts = {f: ts for f, ts in self._first_ts.items() if not self._behind_marks(*f)}
            self._read_sizes = {f: v for f, v in self._read_sizes.items() if f in self.consumed}


def start_marks(start_us: int | None, now_us: int, seal_s: float) -> dict[str, str | None]:
    """Where a new live pipeline that started at ``start_us`` (None: the beginning of the logs) lists from, by the
    registry server's clock ``now_us``. Clicks: from the partition a file whose first event is at the start can have
    arrived in (``seal_s`` before it: a file arrives after its events, give or take the clock skew), so that such a
    file that arrived a little before the start is found (``is_after_start``). Queries: from there too, or from the
    oldest partition not sealed yet if that is earlier (a start in the future or in the last minute): every older
    query partition is sealed, hence complete in the shared query index (``query_index_range``), and every later
    one is consumed by the pipeline itself."""
    if start_us is None:
        return {"queries": None, "clicks": None}
    clicks = partition_of(start_us - int(seal_s * US))
    return {"queries": min(clicks, sealed_before(now_us, seal_s)), "clicks": clicks}


def query_index_range(start_us: int, seal_s: float) -> str:
    """The last query partition (inclusive) that a live pipeline started at ``start_us`` looks up in the shared query
    index rather than consuming: the one before its click mark (``start_marks``)."""
    return partition_of(partition_start_us(partition_of(start_us - int(seal_s * US))) - MINUTE_US)


def is_after_start(rel: str, start_us: int, first_event: Callable[[], int]) -> bool:
    """Whether click file ``rel`` (``<YYYYmmdd>/<HHMM>/<name>``) belongs to a live pipeline started at ``start_us``,
    not to the backfills of the history before it: it arrived in the start's partition or later (a late file
    included), or its first event (``first_event()``, read only then) is stamped at or after the start. A file
    directly in ``clicks/`` (no partition) goes by its first event."""
    part = part_of_name(rel)
    return (part is not None and part >= partition_of(start_us)) or first_event() >= start_us


def oldest_partition(folder: Path | Store) -> str | None:
    """The oldest partition of ``folder`` (``<logs>/<dc>/<kind>``) holding a closed file; None if there is none."""
    for f in list_closed(folder):
        if f.part is not None:
            return f.part
    return None


def history_left(
    cur: Any,
    folder: Path | Store,
    start_us: int,
    pipelines: list[str],
    seal_s: float,
    *,
    since: str | None = None,
    cap: int = 1_000,
) -> dict[str, Any]:
    """The history before a live pipeline's start that no pipeline has consumed: the click files of ``folder``
    (``<logs>/<dc>/clicks``) that are not the live pipeline's (``is_after_start``) and are in no consumed-file record
    of ``pipelines`` (every pipeline of the data center: the live one, its backfills), from partition ``since`` on
    (the registry's horizon: GC forgets older records, and their clicks are past the registry's memory). Each is a
    click file nobody joined yet: the backfill of the hour of its first event has not run (or not since it arrived).
    Reads the first event of at most ``cap`` of them, to name their hours (UTC, ``YYYY-mm-ddTHH``). ``cur``: a
    cursor on the registry's main server."""
    start_part = partition_of(start_us)
    listed_from = start_marks(start_us, start_us, seal_s)["clicks"] or ""  # the live pipeline lists from here
    listed = []
    for f in list_closed(folder, since):
        if f.part is not None and f.part >= start_part:
            break  # partitions come oldest first: from here on every file is the live pipeline's
        listed.append(f.rel)
    cur.execute(
        "SELECT DISTINCT name FROM photon.consumed_files WHERE kind = 'clicks' AND pipeline = ANY(%s)"
        " AND (part IS NULL OR (part < %s AND (%s::text IS NULL OR part >= %s)))",
        (pipelines, start_part, since, since),
    )
    consumed = {str(n) for (n,) in cur.fetchall()}
    left = []
    for rel in listed:
        if rel in consumed:
            continue
        part = part_of_name(rel)
        if part is not None and part < listed_from:  # never listed by the live pipeline: history, unread
            left.append(rel)
            continue
        try:
            if not is_after_start(rel, start_us, partial(first_event_us, folder, rel)):
                left.append(rel)
        except OSError:  # gone since it was listed: nothing to join
            continue
    hours: set[str] = set()
    for rel in left[:cap]:
        with contextlib.suppress(OSError):
            hours.add(datetime.fromtimestamp(first_event_us(folder, rel) // US, tz=UTC).strftime("%Y-%m-%dT%H"))
    return {
        "start_us": start_us,
        "since": since,
        "files": len(left),
        "hours": sorted(hours),
        "unread": max(0, len(left) - cap),  # files beyond the cap, whose hours are not named
        "last_partition": part_of_name(left[-1]) if left else None,
    }


def _marks_before(marks: dict[str, str | None], skipped: set[tuple[str, str]]) -> dict[str, str | None]:
    """Listing marks that stay at or before every partition holding a file left for later, so it is listed again."""
    for kind, name in skipped:
        part, mark = part_of_name(name), marks.get(kind)
        if part is not None and mark is not None and part < mark:
            marks[kind] = part
    return marks


def first_event_us(folder: Path | Store, rel: str | None = None, peek_bytes: int = 1 << 16) -> int:
    """The timestamp of a log file's first well-formed line within its first ``peek_bytes`` (a closed file never
    changes, so this is asked once per file); the file's modification time where none parses there. The file:
    ``rel`` in ``folder`` (a folder or a store), or the path ``folder`` itself. OSError if it is gone or
    unreadable."""
    store, key = locate(folder, rel)
    head = store.get_ranges(key, [(0, peek_bytes)])[0]
    for line in head.split(b"\n")[:-1] if len(head) == peek_bytes else head.split(b"\n"):
        try:
            ts = json.loads(line).get("ts_us")
        except (ValueError, AttributeError):
            continue
        if isinstance(ts, int) and not isinstance(ts, bool):
            return ts
    entry = store.head(key)
    if entry is None:
        raise NotFoundError(f"{store.url}: {key}: no such object")
    return entry.modified_us
