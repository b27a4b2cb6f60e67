"""The input/output contract: how click and query logs are named, laid out and parsed (``parse``, ``layout``), what
an event id is (``ids``), and the Arrow schemas of the joined, unjoinable and quarantine output (``schemas``).

May import: ``photon.settings``, ``photon.durable``. Nothing else of photon."""
