"""photon_registry_gc: hourly registry garbage collection."""

from photon.airflow.dags import registry_gc_dag

photon_registry_gc = registry_gc_dag()
