"""Publishing a committed batch (step 7's second half, see ``photon.joiner``): its data files, written into the
output tables by its tasks, committed to each table under ``txn(photon/<pipeline>, batch)`` (photon.logs.tables);
then its EventStore index moved into the pipeline's state. Run by the lease after its registry commit, by a lease
start for a batch committed but not yet published, and by the verifier rolling a dead pipeline's batch forward."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from photon.joiner.common import batch_tag
from photon.joiner.tasks import MarkersMissingError, read_markers
from photon.logs.tables import publish_batch
from photon.storage import StorageError, Store, as_store

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
    index: Sequence[str] | None = None,
    indexed: int | None = None,
) -> dict[str, str]:
    """Publish batch ``batch`` of lease ``epoch`` from its stage (``<root>/_staging/<tag>``; ``root`` a folder or a
    store). Idempotent, and safe beside another process publishing the same batch (a lease start, the verifier
    rolling a dead pipeline's batch forward): a table already holding the batch commits nothing again, and each index
    file is moved whole, once; whoever comes second finds it gone. Returns what each table did (``publish_batch``,
    which calls ``committed``; ``expect``: the rows per kind its tasks staged, when the publisher knows them).

    The batch's EventStore index files are moved by the names its tasks gave in their read markers: ``index`` (the
    lease that ran it has them), or the markers found in the stage when they name the ``indexed`` queries the batch
    committed. Only failing both (a batch of an older version, whose markers name no files) are they listed."""
    store = as_store(root)
    stage = stage_key(batch, epoch)
    done = publish_batch(store, pipeline, batch, stage, committed, expect)
    src = f"{stage}/eventstore"
    if index is None and indexed:
        # The markers listed again (within the storage retry budget) until they name the queries the batch indexed;
        # failing that (a stage already published and removed), listed as before
        try:
            index = read_markers(store, stage, indexed=indexed).index
        except MarkersMissingError:
            index = None
    if index is None:
        index = [e.key.removeprefix(src + "/") for e in store.listing(src) if e.key.endswith(INDEX_FILES)]
    for rel in index:  # each durable in place before the batch is marked published (Store.move)
        if (
            not store.move(f"{src}/{rel}", f"{STATE}/eventstore/{rel}")
            and store.head(f"{STATE}/eventstore/{rel}") is None
        ):
            raise IndexMissingError(
                f"{store.location(src)}/{rel}: an index file of batch {batch} of {pipeline!r} (named by its task) is "
                "neither in its stage nor in the pipeline's state: not published; the batch is published again later"
            )
    store.remove_all(stage)
    return done


class IndexMissingError(StorageError):
    """A batch's index file, named by the task that wrote it, found nowhere: the batch is never published so."""
