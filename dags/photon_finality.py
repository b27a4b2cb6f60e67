"""photon_finality: hourly, wait until the hour is final, then declare it (marker and asset event)."""

from photon.airflow.dags import finality_dag

photon_finality = finality_dag()
