"""Files that survive a power cut: written under a temporary name, fsynced, renamed, and the rename fsynced in its
folder. A batch's files are durable before its PostgreSQL commit (a committed batch whose files a crash lost could
never be published), and its publish renames are durable before it is marked published."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def fsync_dir(folder: Path) -> None:
    """Make the entries of ``folder`` (files created, renamed into or out of it) durable."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(folder: Path) -> None:
    """``mkdir -p`` whose new folders are durable in their parents."""
    missing = []
    p = folder
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another task made it, and may not have synced it yet
            d.mkdir()
        fsync_dir(d.parent)


def write_durably(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write ``path`` whole or not at all (readers and a retried task never see half of it), and durably."""
    make_dirs(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


class CorruptStateError(RuntimeError):
    """A state file a committed batch wrote is unreadable: it was damaged after it was synced (a disk fault, a
    manual change). The message names the file and what to do."""


def check_parquet(data: bytes, name: str, recover: str) -> None:
    """Raise CorruptStateError naming ``name`` (a path or URL) if ``data``, a Parquet file's bytes, is empty or
    truncated (its footer is missing or unreadable)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    size = len(data)
    if size < 12:
        raise CorruptStateError(f"{name} is {'empty' if size == 0 else 'truncated'} ({size} bytes). {recover}")
    if data[-4:] != b"PAR1":
        raise CorruptStateError(f"{name} is truncated ({size} bytes, no Parquet footer). {recover}")
    try:
        pq.ParquetFile(pa.BufferReader(data)).metadata  # noqa: B018  (reading the footer is the check)
    except (pa.ArrowInvalid, OSError) as exc:
        raise CorruptStateError(f"{name} cannot be read ({exc}). {recover}") from None


def secret_file(path: Path, make: Callable[[], str], *, replace: bool = False) -> str:
    """The text of ``path`` (mode 600, never readable by others even for a moment), written as ``make()`` if it
    does not exist yet, where two processes at once end up with the first one's; with ``replace``, written anew."""
    if replace or not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(make() + "\n")
        try:
            if replace:
                os.replace(tmp, path)
            else:
                os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    return path.read_text().strip()
