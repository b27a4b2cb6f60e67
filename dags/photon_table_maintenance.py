"""photon_table_maintenance: hourly compaction, checkpoint and vacuum of the output tables."""

from photon.airflow.dags import table_maintenance_dag

photon_table_maintenance = table_maintenance_dag()
