"""The micro-batch joiner (Photon's dispatcher + joiner) on Spark: one long-lived session, one batch per trigger.

Batch k of pipeline P, under a lease with epoch E, is one Spark job of two stages:
- Stage 1, one task per few new files (and retry files): query files are parsed and their queries stored by time
  bucket in the batch's staged EventStore; click files are parsed into candidates, the retry set read back;
  malformed lines go to quarantine with a reason.
- Shuffle by click id, so every copy of a click lands in one partition (and every new query is stored before any
  lookup). Stage 2, in each partition:
  2. registry pre-filter: drop clicks another batch already registered (Photon's dispatcher lookup);
  3. EventStore lookup: the worker's cache of recent buckets (the Python workers live as long as the session), the
     stored buckets it has not seen, and this batch's staged queries; for a backfill, then the data center's shared
     query index (query_index.py). A click whose query is older than the registry's horizon is unjoinable at once;
     clicks without a query wait for a retry with exponential backoff, or go to unjoinable/ once older than the
     maximum join delay;
  4. the adapter merges the query's fields into the click;
  5. registration of the partition's joined ids, one transaction per shard, under token (P, k);
  6. the rows won, the unjoinable clicks and the new retry set are written, staged under ``b<k>-e<E>``.
  Only counts and latencies go back to the driver.
7. The driver commits batch k with its metrics (fenced by E, in order), then moves the staged output into place.

A crash anywhere re-runs batch k from the last committed state; registrations of the dead attempt carry the same
token, come back WON_AGAIN and are written then. A zombie lease can register but never commit or publish.

The parts, one protocol step each: ``lease`` (``Joiner``: a lease's start, its loop and its end, ``Term``),
``discovery`` (which files a batch takes), ``batch`` (``BatchRunner``: one micro-batch, steps 1 and 7),
``tasks`` (what Spark's Python workers run: stage 1, and steps 2-6), ``publish`` (step 7's moves), ``common``
(settings and constants they share). Beside them: the pipeline's state in the registry (``state``), the EventStore
(``eventstore``) and the shared query index (``query_index``), the adapter (``adapter``).

May import: ``photon.registry``, ``photon.logs`` and the foundation (``photon.settings``, ``photon.pg``,
``photon.durable``, ``photon.spark_session``).
"""
