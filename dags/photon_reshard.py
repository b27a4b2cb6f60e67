"""photon_reshard: manual, with a params form: a new shard configuration acknowledged by the joiners."""

from photon.airflow.dags import reshard_dag

photon_reshard = reshard_dag()
