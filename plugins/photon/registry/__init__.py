"""The IdRegistry on PostgreSQL: the client joiners write through (``client``), its SQL (``sql``), setting it up and
reading its state (``admin``, ``migrations``), shards and their layout (``sharding``, ``reshard``), owner records and
tokens (``owners``), garbage collection (``gc``) and the main server's clock (``clock``).

May import: ``photon.logs`` and the foundation (``photon.settings``, ``photon.pg``, ``photon.durable``,
``photon.spark_session``)."""
