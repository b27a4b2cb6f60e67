"""Photon on Airflow, PySpark and PostgreSQL: exactly-once joins of clicks to queries across data centers.

The core package is pure Python: nothing here imports Airflow except the modules under ``photon.airflow``.
"""

__version__ = "0.1.0"
