"""The joiner DAGs, two per data center (photon_join_dc_a and photon_join_dc_a_standby, ...): one lease at a time,
the other DAG's run warm beside it, generated from one definition."""

from photon.airflow.dags import dag_id_for, data_centers, join_dag

for _dc in data_centers():
    for _standby in (False, True):
        globals()[dag_id_for(_dc, _standby)] = join_dag(_dc, _standby)
