"""photon_verify_recover: every few minutes, recover lost joins and clear tokens of committed output."""

from photon.airflow.dags import verify_recover_dag

photon_verify_recover = verify_recover_dag()
