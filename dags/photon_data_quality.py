"""photon_data_quality: a Great Expectations checkpoint over every pipeline's output, per hour declared final."""

from photon.airflow.dags import data_quality_dag

photon_data_quality = data_quality_dag()
