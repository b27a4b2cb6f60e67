"""Airflow's side of the product: the IdRegistry hook, the joiner's Spark operator and the DAG builders. The DAG
files in ``dags/`` only call the builders; nothing here touches the network or the registry at import time."""
