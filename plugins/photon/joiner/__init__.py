"""The joiner: a pipeline's lease and micro-batches, the query event store and its index, the adapter that fills a
joined row, and the pipeline's state in the registry (``state``).

May import: ``photon.registry``, ``photon.logs`` and the foundation."""
