"""The joiner DAGs, one per data center (photon_join_dc_a, photon_join_dc_b): generated from one definition."""

from photon.airflow.dags import data_centers, join_dag

for _dc in data_centers():
    globals()[f"photon_join_{_dc.replace('-', '_')}"] = join_dag(_dc)
