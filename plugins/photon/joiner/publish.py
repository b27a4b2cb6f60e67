"""Publishing a committed batch (step 7's second half, see ``photon.joiner``): its data files, written into the
output tables by its tasks, committed to each table under ``txn(photon/<pipeline>, batch)`` (photon.logs.tables);
then its EventStore index moved into the pipeline's state. Run by the lease after its registry commit, by a lease
start for a batch committed but not yet published, and by the verifier rolling a dead pipeline's batch forward."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from photon.joiner.common import batch_tag
from photon.logs.tables import publish_batch
from photon.storage import Store, as_store

STAGING, STATE = "_staging", "_state"
INDEX_FILES = (".parquet", ".arrow")


def stage_key(batch: int, epoch: int) -> str:
    """Where batch ``batch`` of lease ``epoch`` stages what it writes, under the pipeline's root."""
    return f"{STAGING}/{batch_tag(batch, epoch)}"


def publish_files(
    root: Path | Store,
    pipeline: str,
    batch: int,
    epoch: int,
    committed: Callable[[str], None] | None = None,
    expect: Mapping[str, int] | None = None,
) -> dict[str, str]:
    """Publish batch ``batch`` of lease ``epoch`` from its stage (``<root>/_staging/<tag>``; ``root`` a folder or a
    store). Idempotent, and safe beside another process publishing the same batch (a lease start, the verifier
    rolling a dead pipeline's batch forward): a table already holding the batch commits nothing again, and each index
    file is moved whole, once; whoever comes second finds it gone. Returns what each table did (``publish_batch``,
    which calls ``committed``; ``expect``: the rows per kind its tasks staged, when the publisher knows them)."""
    store = as_store(root)
    stage = stage_key(batch, epoch)
    done = publish_batch(store, pipeline, batch, stage, committed, expect)
    src = f"{stage}/eventstore"
    for e in list(store.listing(src)):
        if e.key.endswith(INDEX_FILES):  # durable in place before the batch is marked published (Store.move)
            store.move(e.key, f"{STATE}/eventstore/{e.key.removeprefix(src + '/')}")
    store.remove_all(stage)
    return done
