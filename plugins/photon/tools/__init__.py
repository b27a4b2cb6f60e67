"""What operators and tests run around the pipeline: the log generator, the audit, status and report, the data
quality check (with ``data_docs/``, the npm lock of its offline assets) and the demo.

May import: everything below it (``photon.recovery``, ``photon.joiner``, ``photon.registry``, ``photon.logs``, the
foundation); never ``photon.cli`` or ``photon.airflow``."""
