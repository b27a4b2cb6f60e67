"""The one place a SparkSession is made and Spark is configured. Imported lazily: the core registry code and DAG
files never import pyspark at module level."""

from __future__ import annotations

import os
import sys
from typing import Any


def get_spark(app_name: str, *, master: str | None = None, shuffle_partitions: int = 8) -> Any:
    from pyspark.sql import SparkSession

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
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("WARN")
    return session
