"""Publishing a committed batch (step 7's second half, see ``photon.joiner``): its data files, written into the
output tables by its tasks, committed to each table under ``txn(photon/<pipeline>, batch)`` (photon.logs.tables);
then its EventStore index moved into the pipeline's state. Run by the lease after its registry commit, by a lease
start for a batch committed but not yet published, and by the verifier rolling a dead pipeline's batch forward."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from photon.durable import fsync_dir, make_dirs
from photon.joiner.common import batch_tag
from photon.logs.tables import publish_batch


def publish_files(
    root: Path, pipeline: str, batch: int, epoch: int, committed: Callable[[str], None] | None = None
) -> dict[str, str]:
    """Publish batch ``batch`` of lease ``epoch`` from its stage (``<root>/_staging/<tag>``). Idempotent, and safe
    beside another process publishing the same batch (a lease start, the verifier rolling a dead pipeline's batch
    forward): a table already holding the batch commits nothing again, and each index file is renamed whole, once;
    whoever comes second finds it gone. Returns what each table did (``publish_batch``, which calls ``committed``)."""
    stage = root / "_staging" / batch_tag(batch, epoch)
    done = publish_batch(root, pipeline, batch, stage, committed)
    src, dst = stage / "eventstore", root / "_state" / "eventstore"
    make_dirs(dst)
    if src.is_dir():
        touched: set[Path] = set()
        for part in sorted(p for p in src.rglob("*") if p.suffix in (".parquet", ".arrow")):
            target = dst / part.relative_to(src)
            make_dirs(target.parent)
            with contextlib.suppress(FileNotFoundError):
                os.replace(part, target)
            touched.add(target.parent)
        for folder in sorted(touched):  # the renames are durable before the batch is marked published
            fsync_dir(folder)
    shutil.rmtree(stage, ignore_errors=True)
    return done
