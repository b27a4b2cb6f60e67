"""A class-data-sharing archive of the classes a Spark driver loads, for every driver JVM the suite starts.

The suite starts dozens of Spark drivers (its sessions, `photon join` and backfill processes, spark-submit tasks,
Spark Connect servers), each for seconds; loading and verifying Spark's classes is much of what each start costs.
A JVM mapping them from an archive (JDK 17's dynamic CDS: ``-XX:ArchiveClassesAtExit`` once, then
``-XX:SharedArchiveFile``) started a session and ran a small job on 5.9 CPU-seconds instead of 11.0 (wall 6.0 s
instead of 10.2 s) here. The archive is made once per virtual environment and Java (it names both), by a short Spark
job; a JVM that cannot use it (another Java, another class path) runs without it, silently.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

# A session, a shuffle, Arrow to and from Python workers, Parquet written and read: the classes a join loads.
_JOB = """
import sys, tempfile
from photon.spark_session import get_spark
s = get_spark("photon-tests-cds", master="local[2]", shuffle_partitions=2)
df = s.range(20000).selectExpr("id % 7 AS k", "id", "cast(id AS string) AS t")
df = df.mapInArrow(lambda batches: batches, df.schema).groupBy("k").count()
out = tempfile.mkdtemp()
df.write.mode("overwrite").parquet(out)
s.read.parquet(out).join(s.range(7).withColumnRenamed("id", "k"), "k").collect()
s.stop()
"""
# A JVM that cannot map the archive says so on stdout; it then runs as it would without it.
QUIET = "-Xlog:cds=off,cds+dynamic=off"


def _java() -> Path | None:
    java_home = os.environ.get("JAVA_HOME")
    found = Path(java_home) / "bin" / "java" if java_home else shutil.which("java")
    return Path(found).resolve() if found else None


def archive_path() -> Path | None:
    """Where this virtual environment keeps the archive for the Java on PATH (or JAVA_HOME); None without Java."""
    java = _java()
    if java is None:
        return None
    stat = java.stat()
    key = hashlib.sha256(f"{java}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return Path(sys.prefix) / "share" / "photon" / f"spark-classes-{key}.jsa"


def ensure_archive(env: dict[str, str]) -> Path | None:
    """The archive, made now if it is missing (about 20 s); None where it cannot be made."""
    path = archive_path()
    if path is None:
        return None
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    opts = f"{env.get('PHOTON_SPARK_DRIVER_JAVA_OPTIONS', '')} -XX:ArchiveClassesAtExit={partial} {QUIET}"
    run = subprocess.run(
        [sys.executable, "-c", _JOB],
        env=env | {"PHOTON_SPARK_DRIVER_JAVA_OPTIONS": opts.strip()},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if run.returncode != 0 or not partial.exists():
        partial.unlink(missing_ok=True)
        print(f"no Spark class archive: {run.stderr[-2000:]}", file=sys.stderr)
        return None
    os.replace(partial, path)  # whole or not at all: two runs making it at once each rename a complete one
    return path


def java_options(path: Path) -> str:
    return f"-XX:SharedArchiveFile={path} {QUIET}"
