"""photon_data_quality: a Great Expectations checkpoint per interval over every pipeline's output."""

from photon.airflow.dags import data_quality_dag

photon_data_quality = data_quality_dag()
