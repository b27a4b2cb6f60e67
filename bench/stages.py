"""Where the joiner's time goes, per stage, without changing the joiner.

Three views, each measured, none estimated:
- ``DriverClock``: the real run's driver side (lease start, file discovery, the Spark job, commit, publish), by
  wrapping the driver's own methods on the Joiner instance (they run in this process).
- ``spark_stages``: the real run's Spark stages (parse and store, then shuffle and join), from Spark's status store:
  wall time, task time summed over both cores, shuffle bytes and write time.
- ``replay``: the executor side, split finer (read, parse, EventStore write, registry lookup, EventStore lookup,
  adapter, registration, output writes, fsync) by running the joiner's own executor functions for one batch in this
  process, on one core, with those functions timed (self time: a timed call inside another is not counted twice).
  Spark's own share of the real job (Arrow to JVM rows and back, the shuffle, scheduling, Python worker IPC) is what
  the real job's task time has beyond the replay's.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

US = 1_000_000


class Timers:
    """Self time per name of wrapped callables: a timed call made inside another is subtracted from the outer."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._local = threading.local()

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            stack = self._local.__dict__.setdefault("stack", [])
            frame = [0.0]
            stack.append(frame)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - t0
                stack.pop()
                self.seconds[name] += elapsed - frame[0]
                self.calls[name] += 1
                if stack:
                    stack[-1][0] += elapsed

        return timed

    @contextlib.contextmanager
    def patch(self, owner: Any, attr: str, name: str) -> Iterator[None]:
        original = getattr(owner, attr)
        setattr(owner, attr, self.wrap(name, original))
        try:
            yield
        finally:
            setattr(owner, attr, original)


@contextlib.contextmanager
def timed_table_commits() -> Iterator[list[float]]:
    """Seconds of each batch's table commit made in this process while the block runs, one entry per call of
    ``photon.logs.tables.publish_batch`` as the joiner's publish makes it (one Delta commit under the batch's txn per
    table that got rows; the EventStore moves and the registry's ``published`` mark after it are not in it). Safe
    for joiners in several threads."""
    import photon.joiner.publish as publish

    real = publish.publish_batch
    seconds: list[float] = []

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - t0)  # list.append is atomic: no lock for threads

    publish.publish_batch = timed
    try:
        yield seconds
    finally:
        publish.publish_batch = real


def commit_ms(seconds: list[float]) -> dict[str, Any]:
    """The table commit's cost per batch: p50 and p99 in milliseconds, and over how many batches."""
    if not seconds:
        return {"table_commit_ms_p50": None, "table_commit_ms_p99": None, "table_commit_batches": 0}
    q = np.quantile(np.asarray(seconds) * 1e3, [0.5, 0.99])
    return {
        "table_commit_ms_p50": round(float(q[0]), 2),
        "table_commit_ms_p99": round(float(q[1]), 2),
        "table_commit_batches": len(seconds),
    }


def commit_text(figures: dict[str, Any]) -> str:
    if not figures["table_commit_batches"]:
        return "no table commit"
    return (
        f"table commit per batch p50 {figures['table_commit_ms_p50']:.1f} ms, p99 "
        f"{figures['table_commit_ms_p99']:.1f} ms ({figures['table_commit_batches']} batch"
        + ("es)" if figures["table_commit_batches"] != 1 else ")")
    )


@dataclass
class DriverClock:
    """Wraps a Joiner's driver-side steps; ``seconds`` by step after the run."""

    timers: Timers = field(default_factory=Timers)

    def attach(self, joiner: Any, *, batch: bool = True) -> None:
        joiner.start = self.timers.wrap("lease start", joiner.start)
        joiner.discovery.new_files = self.timers.wrap("discover new files", joiner.discovery.new_files)
        joiner.batches.retry_counts = self.timers.wrap("retry check", joiner.batches.retry_counts)
        if batch:  # the rest of a batch beside its Spark job, commit and publish
            joiner.batches.run_batch = self.timers.wrap("batch (other)", joiner.batches.run_batch)
        joiner.state.commit = self.timers.wrap("commit", joiner.state.commit)
        joiner.batches.publish = self.timers.wrap("publish", joiner.batches.publish)

    def seconds(self, results: list[Any]) -> dict[str, float]:
        """By step; the Spark job (and the footers it counts) from each batch's own ``duration_s``."""
        out = dict(self.timers.seconds)
        job = sum(float(r.metrics.get("duration_s", 0.0)) for r in results)
        out["spark job (parse to staged writes)"] = job
        out["batch (other)"] = max(0.0, out.get("batch (other)", 0.0) - job)
        return out


# -- Spark's own stage metrics ---------------------------------------------------------------------------------


def last_stage_id(spark: Any) -> int:
    stages = spark_stages(spark, -1)
    return max((s["id"] for s in stages), default=-1)


def spark_stages(spark: Any, after: int) -> list[dict[str, Any]]:
    """Completed stages with an id above ``after``, oldest first, from the status store (the UI's data; the UI itself
    is off). Empty if this Spark version's store cannot be read this way."""
    try:
        store = spark.sparkContext._jsc.sc().statusStore()
        gw = spark.sparkContext._gateway
        seq = store.stageList(None, False, False, gw.new_array(gw.jvm.double, 0), None)
    except Exception:
        return []
    out = []
    it = seq.iterator()
    while it.hasNext():
        s = it.next()
        if s.stageId() <= after or s.status().toString() != "COMPLETE":
            continue
        sub, end = s.submissionTime(), s.completionTime()
        wall = (end.get().getTime() - sub.get().getTime()) / 1e3 if sub.isDefined() and end.isDefined() else 0.0
        out.append(
            {
                "id": int(s.stageId()),
                "name": str(s.name()),
                "tasks": int(s.numTasks()),
                "wall_s": wall,
                "task_s": s.executorRunTime() / 1e3,
                "cpu_s": s.executorCpuTime() / 1e9,
                "gc_s": s.jvmGcTime() / 1e3,
                "shuffle_write_s": s.shuffleWriteTime() / 1e9,
                "shuffle_write_mb": s.shuffleWriteBytes() / 1e6,
                "shuffle_read_mb": (s.shuffleRemoteBytesRead() + s.shuffleLocalBytesRead()) / 1e6,
            }
        )
    return sorted(out, key=lambda s: s["id"])


# -- the executor side, replayed in this process ---------------------------------------------------------------


class _LocalFrame:
    """Stands in for the DataFrame chain a batch runs (``range -> mapInArrow -> repartition(n, column) -> mapInArrow
    -> collect``) and runs it here, one partition after the other, recording each mapInArrow's time."""

    def __init__(self, parts: list[list[pa.RecordBatch]], stage_s: list[float]):
        self.parts, self.stage_s = parts, stage_s

    def mapInArrow(self, fn: Callable[..., Any], schema: Any) -> _LocalFrame:
        import pyspark

        original = pyspark.TaskContext.__dict__["get"]
        out = []
        t0 = time.perf_counter()
        try:
            for i, part in enumerate(self.parts):
                pyspark.TaskContext.get = _Context(i).getter()  # type: ignore[method-assign]
                out.append(list(fn(iter(part))))
        finally:
            pyspark.TaskContext.get = original  # type: ignore[method-assign]
        self.stage_s.append(time.perf_counter() - t0)
        return _LocalFrame(out, self.stage_s)

    def repartition(self, n: int, column: str) -> _LocalFrame:
        batches = [b for part in self.parts for b in part]
        if not batches:
            return _LocalFrame([[] for _ in range(n)], self.stage_s)
        table = pa.Table.from_batches(batches)
        keys = table.column(column).to_pylist()
        of = np.fromiter((hash(k) % n for k in keys), np.int64, len(keys))
        return _LocalFrame([table.filter(pa.array(of == i)).to_batches() for i in range(n)], self.stage_s)

    def collect(self) -> list[dict[str, Any]]:
        return [row for part in self.parts for b in part for row in b.to_pylist()]


@dataclass
class _Context:
    part: int

    def partitionId(self) -> int:
        return self.part

    def attemptNumber(self) -> int:
        return 0

    def getter(self) -> Callable[[], Any]:
        return lambda: self


@dataclass
class Replay:
    wall_s: float
    seconds: dict[str, float]  # by step, self time, one core
    source_s: float  # stage 1 (parse and store), all tasks, one core
    join_s: float  # stage 2 (steps 2-6), all partitions, one core
    joined: int
    batches: int


def replay(spark: Any, servers: dict[str, str], logs: Path, dc: str, root: Path) -> Replay:
    """The joiner until caught up over ``logs/<dc>``, as in the real run, but with every batch's Spark job run in
    this process (stage 1 per task's files as Spark splits them, candidates split by click id as the shuffle would,
    stage 2 per partition) on one core, every step timed. Into its own registry and output folder."""
    import pathlib

    import photon.joiner.eventstore as eventstore
    import photon.joiner.tasks as joiner_tasks
    import photon.logs.tables as tables
    from photon.joiner.common import JoinSettings
    from photon.joiner.lease import Joiner
    from photon.registry.client import IdRegistry
    from photon.storage import LocalStore, S3Store

    j = Joiner(dc, logs, root, servers, spark, JoinSettings(trigger_interval_s=0.0))
    stage_s: list[float] = []

    def local_tasks(n: int) -> _LocalFrame:
        groups = np.array_split(
            np.arange(n), max(1, min(n, j.batches.parallelism))
        )  # contiguous, as spark.range splits
        return _LocalFrame([[pa.record_batch({"id": pa.array(g, pa.int64())})] for g in groups], stage_s)

    j.batches._tasks = local_tasks  # type: ignore[method-assign]
    clock = DriverClock()
    clock.attach(j, batch=False)
    timers = clock.timers
    patches = [
        (pathlib.Path, "read_bytes", "read files"),
        (joiner_tasks, "parse_file_located", "parse"),
        (eventstore, "write_index", "EventStore index (bucketing)"),
        (tables, "parquet_bytes", "Parquet encode"),
        (LocalStore, "put", "folder writes (index, data files, records)"),
        (S3Store, "put", "object puts (index, data files, records)"),
        (S3Store, "read", "object reads (logs, index)"),
        (S3Store, "get_ranges", "object range reads (query lines)"),
        (S3Store, "files", "object listings"),
        (os, "fsync", "fsync"),
        (IdRegistry, "lookup", "registry pre-filter lookup"),
        (eventstore.EventStoreCache, "lookup", "EventStore lookup"),
        (eventstore.EventStoreCache, "_read_lines", "EventStore: query lines read back and parsed"),
        (joiner_tasks, "run_adapter", "adapter"),
        (IdRegistry, "register", "registry register"),
    ]
    cpus = pa.cpu_count()
    pa.set_cpu_count(1)  # as in Spark's Python workers (OMP_NUM_THREADS=1 there): one core, Arrow included
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stack.callback(pa.set_cpu_count, cpus)
        for owner, attr, name in patches:
            stack.enter_context(timers.patch(owner, attr, name))
        results = j.run(until_caught_up=True, drain=True)
    wall = time.perf_counter() - t0
    seconds = dict(timers.seconds)
    source_s, join_s = sum(stage_s[0::2]), sum(stage_s[1::2])
    executor = [name for _, _, name in patches]
    seconds["other (dedupe, filters, Arrow glue)"] = max(
        0.0, source_s + join_s - sum(seconds.get(n, 0.0) for n in executor)
    )
    joined = sum(int(r.metrics.get("joined", 0)) for r in results)
    return Replay(wall, seconds, source_s, join_s, joined, len(results))
