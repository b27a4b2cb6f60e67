"""``PhotonSparkSubmitOperator``: the Spark provider's ``SparkSubmitOperator`` running one of the project's Spark
entry points (``spark/``), with what every such job needs added at execution time, never at parse time:

- the registry's DSNs from ``IdRegistryHook`` as the job's component (the joiner: connection
  ``photon_registry_joiner``, else ``photon_registry``), in spark-submit's environment rather than on its command
  line, so they never show in the UI or the process list; the executors get them from the driver;
- the core package on the driver's and executors' ``PYTHONPATH``, and the same Python for both;
- ``spark-submit`` itself from the environment Airflow runs in;
- the driver's log at WARN from its first line (``photon.spark_session.driver_java_options``): Spark's INFO start-up
  would otherwise fill the task log before its first batch line.

On a cluster whose workers do not share this machine's paths, ship the package with ``py_files`` instead (the
Docker image puts the project at the same path everywhere).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

from photon.airflow.hooks import Component, IdRegistryHook, ObjectStoreHook, component_conn_id
from photon.spark_session import driver_java_options

PLUGINS_DIR = str(Path(__file__).resolve().parents[2])
PROJECT_DIR = str(Path(PLUGINS_DIR).parent)
SPARK_DIR = Path(PROJECT_DIR) / "spark"


class PhotonSparkSubmitOperator(SparkSubmitOperator):
    """``registry_component`` is the role the job connects to the registry as (the project's Spark entry point is the
    joiner); ``registry_conn_id`` (templated) the connection its component's connection is named after."""

    template_fields = (*SparkSubmitOperator.template_fields, "registry_conn_id")

    def __init__(
        self,
        *,
        registry_conn_id: str = IdRegistryHook.default_conn_name,
        registry_component: Component = "joiner",
        spark_connect: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        component_conn_id(registry_conn_id, registry_component)  # an unknown component fails the DAG file's import
        self.registry_conn_id = registry_conn_id
        self.registry_component = registry_component
        self.spark_connect = spark_connect

    def spark_remote(self) -> dict[str, str]:
        """With ``spark_connect``: the environment that makes the job a client of the Spark Connect server
        ``photon airflow`` keeps under PHOTON_HOME, if it is up and runs this code (``PHOTON_SPARK_REMOTE``, when
        set, wins); else nothing, and the job starts Spark itself."""
        if not self.spark_connect:
            return {}
        if os.environ.get("PHOTON_SPARK_REMOTE"):
            return {"PHOTON_SPARK_REMOTE": os.environ["PHOTON_SPARK_REMOTE"]}
        from photon.settings import load_settings
        from photon.tools.spark_connect import TOKEN_ENV, NoServerError, connection

        try:
            remote, token = connection(load_settings().home)
        except NoServerError as exc:
            self.log.info("%s; this job starts its own Spark", exc)
            return {}
        return {"PHOTON_SPARK_REMOTE": remote, TOKEN_ENV: token}

    def execute(self, context: Any) -> None:
        bin_dir = str(Path(sys.executable).parent)
        env = {
            "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
            "PYTHONPATH": os.pathsep.join([PLUGINS_DIR, PROJECT_DIR]),
            "PYSPARK_PYTHON": sys.executable,
            "PYSPARK_DRIVER_PYTHON": sys.executable,
            **(self.env_vars or {}),
            **IdRegistryHook(self.registry_conn_id, component=self.registry_component).environment(),
            **ObjectStoreHook().environment(),  # the store's key, if a connection names it: in the environment only
        }
        if remote := self.spark_remote():
            # The job's driver is a Spark Connect client of the warm server: spark-submit starts no SparkContext.
            env |= remote
            self.log.info("joining on the warm Spark Connect server (no Spark start of its own)")
        self.env_vars = env
        self.conf = {
            "spark.executorEnv.PYTHONPATH": env["PYTHONPATH"],
            "spark.pyspark.python": sys.executable,
            "spark.driver.extraJavaOptions": driver_java_options(),
            **(self.conf or {}),
        }
        super().execute(context)
