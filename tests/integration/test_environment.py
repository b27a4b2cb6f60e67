"""The pinned environment holds together: pip's dependency check is clean and Spark starts and runs a job."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pyspark


def test_pip_check_is_clean() -> None:
    result = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_spark_runs_a_job_with_the_pinned_version(spark: Any) -> None:
    from importlib.metadata import version

    assert version("pyspark") == version("pyspark-client") == pyspark.__version__
    df = spark.createDataFrame([(1, "a"), (2, "b"), (2, "c")], ["k", "v"])
    assert sorted(r["k"] for r in df.groupBy("k").count().collect()) == [1, 2]


def test_the_driver_jvm_runs_with_photon_spark_driver_java_options(spark: Any) -> None:
    """PHOTON_SPARK_DRIVER_JAVA_OPTIONS (the suite sets the client compiler only) reaches the driver JVM's command
    line beside the quiet log configuration, not just the Spark config."""
    import os

    from photon.spark_session import LOG4J2_PROPERTIES

    wanted = os.environ["PHOTON_SPARK_DRIVER_JAVA_OPTIONS"].split()
    jvm = spark.sparkContext._jvm
    args = list(jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getInputArguments())
    assert f"-Dlog4j2.configurationFile={LOG4J2_PROPERTIES.as_uri()}" in args and set(wanted) <= set(args), args
