"""photon_backfill: for `airflow backfill create --dag-id photon_backfill --from-date ... --to-date ...`."""

from photon.airflow.dags import backfill_dag

photon_backfill = backfill_dag()
