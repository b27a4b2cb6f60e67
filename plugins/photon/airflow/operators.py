"""``PhotonSparkSubmitOperator``: the Spark provider's ``SparkSubmitOperator`` running one of the project's Spark
entry points (``spark/``), with what every such job needs added at execution time, never at parse time:

- the registry's DSNs from ``IdRegistryHook`` (the ``photon_registry`` connection), in spark-submit's environment
  rather than on its command line, so they never show in the UI or the process list;
- the core package on the driver's and executors' ``PYTHONPATH``, and the same Python for both;
- ``spark-submit`` itself from the environment Airflow runs in.

On a cluster whose workers do not share this machine's paths, ship the package with ``py_files`` instead (the
Docker image puts the project at the same path everywhere).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

from photon.airflow.hooks import IdRegistryHook

PLUGINS_DIR = str(Path(__file__).resolve().parents[2])
PROJECT_DIR = str(Path(PLUGINS_DIR).parent)
SPARK_DIR = Path(PROJECT_DIR) / "spark"


class PhotonSparkSubmitOperator(SparkSubmitOperator):
    def __init__(self, *, registry_conn_id: str = IdRegistryHook.default_conn_name, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.registry_conn_id = registry_conn_id

    def execute(self, context: Any) -> None:
        bin_dir = str(Path(sys.executable).parent)
        env = {
            "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
            "PYTHONPATH": os.pathsep.join([PLUGINS_DIR, PROJECT_DIR]),
            "PYSPARK_PYTHON": sys.executable,
            "PYSPARK_DRIVER_PYTHON": sys.executable,
            **(self.env_vars or {}),
            **IdRegistryHook(self.registry_conn_id).environment(),
        }
        self.env_vars = env
        self.conf = {
            "spark.executorEnv.PYTHONPATH": env["PYTHONPATH"],
            "spark.pyspark.python": sys.executable,
            **(self.conf or {}),
        }
        super().execute(context)
