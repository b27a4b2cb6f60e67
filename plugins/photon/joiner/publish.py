"""Publishing a committed batch: its staged files move into place, each renamed whole (step 7's second half, see
``photon.joiner``). Run by the lease after its commit, by a lease start for a batch committed but not yet published,
and by the verifier rolling a dead pipeline's batch forward."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from photon.durable import fsync_dir, make_dirs
from photon.logs.schemas import JOINED, QUARANTINE, UNJOINABLE


def publish_files(root: Path, tag: str) -> None:
    """Move a committed batch's staged files (``<root>/_staging/<tag>``) into place under their staged names.
    Idempotent, and safe beside another process publishing the same batch (a lease start, the verifier rolling a
    dead pipeline's batch forward): each file is renamed whole, once; whoever comes second finds it gone."""
    stage = root / "_staging" / tag
    moves = [(stage / "eventstore", root / "_state" / "eventstore")]
    moves += [(stage / kind, root / kind) for kind in (JOINED, UNJOINABLE, QUARANTINE)]
    for src, dst in moves:
        make_dirs(dst)
        if not src.is_dir():
            continue
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
