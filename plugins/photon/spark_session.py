"""The one place a SparkSession is made and Spark is configured. Imported lazily: the core registry code and DAG
files never import pyspark at module level.

Spark logs warnings and errors only, from the driver JVM's first line (``log4j2.properties`` beside this module): its
INFO start-up, some 45 lines, buried each join task's first batch line. A JVM that this process launches (plain
``python``, ``photon join``) gets the file through ``spark.driver.extraJavaOptions``; one that spark-submit started
before this Python ran gets it from whoever ran spark-submit (``PhotonSparkSubmitOperator`` passes
``driver_java_options()``). A spark-submit without it gets Spark's ``spark.log.level=WARN`` (unless it set a level
itself), which the SparkContext applies a few INFO lines into its start.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

LOG4J2_PROPERTIES = Path(__file__).resolve().with_name("log4j2.properties")


def driver_java_options() -> str:
    """The driver JVM's options for a quiet start (``spark.driver.extraJavaOptions``; as a URI, so that a path with
    spaces stays one option), and ``PHOTON_SPARK_DRIVER_JAVA_OPTIONS``."""
    # Read here, not through photon.settings: this module is foundation and imports nothing of photon.
    extra = os.environ.get("PHOTON_SPARK_DRIVER_JAVA_OPTIONS", "").strip()
    return f"-Dlog4j2.configurationFile={LOG4J2_PROPERTIES.as_uri()}" + (f" {extra}" if extra else "")


REMOTE_ENV = "PHOTON_SPARK_REMOTE"


def get_spark(
    app_name: str, *, master: str | None = None, shuffle_partitions: int = 8, remote: str | None = None
) -> Any:
    """A SparkSession: with ``remote`` (or ``PHOTON_SPARK_REMOTE``), a Spark Connect session on a server that is
    already running (``sc://...``: its JVM, executors and Python workers warm), else a classic one whose JVM this
    process starts (or spark-submit started)."""
    from pyspark.sql import SparkSession

    remote = remote or os.environ.get(REMOTE_ENV) or None
    if remote:
        # spark-submit sets MASTER for the Python it runs; a Connect client has no master of its own.
        os.environ.pop("MASTER", None)
        # gRPC's core logs at INFO to stderr (e.g. "skipping fork() handlers" when the embedded registry starts its
        # server beside the session's threads); its errors reach us as exceptions anyway. Read when gRPC starts.
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
        # Only the session's SQL settings: the JVM, the master and the UI are the server's.
        return (
            SparkSession.builder.remote(remote)
            .config("spark.sql.shuffle.partitions", str(shuffle_partitions))
            .config("spark.sql.session.timeZone", "UTC")
            .config("spark.sql.execution.arrow.pyspark.enabled", "true")
            .getOrCreate()
        )

    # The VM's hostname resolves to a non-loopback address; keep the driver on loopback unless told otherwise.
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    # Python workers run the driver's interpreter (the project's virtual environment), not whatever is on PATH.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = (
        SparkSession.builder.appName(app_name)
        .config("spark.sql.shuffle.partitions", str(shuffle_partitions))
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
    )
    if master:
        builder = builder.master(master)
    elif "PYSPARK_GATEWAY_PORT" not in os.environ:
        # Under spark-submit (which starts the JVM and sets PYSPARK_GATEWAY_PORT) the master is spark-submit's
        # --master; plain python gets local mode.
        builder = builder.master("local[*]")
    if "PYSPARK_GATEWAY_PORT" not in os.environ:  # the JVM is launched by getOrCreate, with these options
        builder = builder.config("spark.driver.extraJavaOptions", driver_java_options())
    elif not _started_quiet():
        builder = builder.config("spark.log.level", "WARN")
    return builder.getOrCreate()


def _started_quiet() -> bool:
    """Whether spark-submit's JVM runs with ``driver_java_options()``, or was given a log level of its own."""
    from pyspark import SparkConf, SparkContext

    SparkContext._ensure_initialized()  # connects to spark-submit's gateway; starts no context
    jvm: Any = SparkContext._jvm
    started = str(jvm.java.lang.System.getProperty("log4j2.configurationFile"))
    return started == LOG4J2_PROPERTIES.as_uri() or SparkConf().contains("spark.log.level")


def is_remote(spark: Any) -> bool:
    """Whether ``spark`` is a Spark Connect session (no SparkContext in this process)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def default_parallelism(spark: Any) -> int:
    """How many tasks run at once: the SparkContext's default parallelism, or a Spark Connect server's
    ``spark.default.parallelism`` (which ``photon spark-connect`` sets)."""
    if is_remote(spark):
        return int(spark.conf.get("spark.default.parallelism", None) or os.cpu_count() or 2)
    return int(spark.sparkContext.defaultParallelism)
