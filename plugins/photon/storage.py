"""Where the logs, the state and the output live: a local folder, or a prefix of a bucket on any S3-compatible store
that honours conditional writes. One small interface (``Store``): list from a mark, read whole or by byte ranges,
put (whole; if absent where a second writer must lose), delete. Keys are ``/``-separated, relative to the store's
root; objects are written whole and never renamed, so the same code runs on a folder and on a bucket.

- ``LocalStore``: a folder. A put is durable before it returns (written under a temporary name, fsynced, linked
  into place, its folder fsynced); put-if-absent is a hard link, which fails if the name exists.
- ``S3Store``: obstore (Apache arrow-rs ``object_store``), put-if-absent as ``If-None-Match: *``. Credentials and
  endpoint come from the standard AWS variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
  ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``) or ``options``; never from a URL.

``open_store(url)`` picks one by the URL: ``s3://bucket/prefix`` or a path (``file://`` optional).
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import re
import secrets
import shutil
import stat
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from photon.durable import fsync_dir, make_dirs

if TYPE_CHECKING:
    from obstore.store import ClientConfig, RetryConfig, S3Config

T = TypeVar("T")


class StorageError(OSError):
    """A store could not do what was asked: the message names the store and the key, never a credential. An
    OSError, as a file's failure is: a caller that handles a folder's I/O errors handles a bucket's alike."""


class NotFoundError(StorageError, FileNotFoundError):
    pass


@dataclass(frozen=True)
class Entry:
    """An object: its key (relative to the store), size, a tag that changes whenever the object is written again
    (S3: its ETag; a folder: inode, size and modification time), and its modification time (µs)."""

    key: str
    size: int
    etag: str
    modified_us: int
    inode: int = 0  # a folder's file: its inode (another file renamed into its place has another); S3: 0


class ChangingError(StorageError):
    """A folder's file changed while it was read (a copy still being written into place): read it again later."""


class Store(Protocol):
    url: str
    # Whether an object appears whole once it is listed (S3: a put is atomic). A folder's files may be copied in
    # place by other writers: a reader waits for them to settle (photon.joiner.discovery).
    atomic: bool

    def listing(self, prefix: str = "", *, after: str | None = None) -> Iterator[Entry]:
        """The objects under the folder ``prefix`` ("" for all; whole parts: "a" holds "a/x", not "a-b/x") whose key
        sorts after ``after``, in key order (by bytes, as S3 lists)."""
        ...

    def files(self, prefix: str = "") -> list[Entry]:
        """The objects directly in the folder ``prefix`` (not in its sub-folders), in key order."""
        ...

    def head(self, key: str) -> Entry | None: ...

    def get(self, key: str) -> bytes: ...

    def read(self, key: str) -> tuple[bytes, Entry]:
        """An object whole, with the entry of the very version read (``ChangingError``: a folder's file changed
        while it was read)."""
        ...

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """The bytes ``[start, end)`` of each range, cut at the object's end (as ``pread``)."""
        ...

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> bool:
        """Write ``key`` whole. With ``if_absent``, only if no object has that key: False (and nothing written) if
        one holding other bytes has; True if it holds these very bytes (a try whose answer was lost wrote it, or
        another writer wrote the same: either way the key says what this put says)."""
        ...

    def delete(self, key: str) -> None:
        """Remove ``key``; a key already gone is no error."""
        ...

    def folders(self, prefix: str = "") -> list[str]:
        """The names of the folders directly in the folder ``prefix`` (those holding an object), in key order."""
        ...

    def move(self, src: str, dst: str) -> bool:
        """Put the object ``src`` at ``dst`` (replacing what is there) and remove ``src``: False if ``src`` is gone
        (moved by someone else already). A folder renames; an object store copies on the server, then deletes, so
        a reader may see both for a moment, never neither."""
        ...

    def remove_all(self, prefix: str) -> None:
        """Remove every object under the folder ``prefix``; a folder already gone is no error."""
        ...

    def location(self, key: str) -> str:
        """A path or URL naming ``key``, for messages."""
        ...

    def delta_location(self, key: str) -> tuple[str, dict[str, str]]:
        """Where ``deltalake`` finds the table at ``key``: its URI and storage options (credentials included, for
        this process only: never logged)."""
        ...

    def child(self, prefix: str) -> Store:
        """The store rooted at ``prefix`` under this one."""
        ...


TMP_SUFFIX = ".photon-tmp"  # a folder put in progress: ".<random>.photon-tmp", never listed


def _check_key(key: str) -> str:
    """A key both kinds of store hold as one object: relative, '/'-separated, no empty, '.' or '..' part, no control
    character or backslash (an S3 server may read "\\" as "/"), UTF-8, and no part a folder put would take for its
    own temporary file."""
    parts = key.split("/")
    bad = not key or any(p in ("", ".", "..") or p.endswith(TMP_SUFFIX) or len(p.encode()) > 255 for p in parts)
    if bad or "\\" in key or any(ord(c) < 32 or ord(c) == 127 for c in key) or not key.isprintable():
        raise StorageError(
            f"not a key: {key!r} (relative, '/'-separated, printable, no backslash, no empty, '.' "
            "or '..' part, parts of at most 255 bytes)"
        )
    try:
        key.encode()
    except UnicodeEncodeError:
        raise StorageError(f"not a key: {key!r} (not UTF-8)") from None
    return key


def _check_read_key(key: str) -> str:
    """A key to read, list or delete: relative, no empty, '.' or '..' part, no NUL. Looser than ``_check_key`` (what
    a put may create): an object someone else named (a backslash, a control character) must still read back."""
    if not key or "\0" in key or any(p in ("", ".", "..") for p in key.split("/")):
        raise StorageError(f"not a key: {key!r} (relative, '/'-separated, no empty, '.' or '..' part)")
    return key


class LocalStore:
    """A folder (see the module's text)."""

    atomic = False

    def __init__(self, root: Path | str):
        self.root = Path(root)
        self.url = str(self.root)

    def __repr__(self) -> str:
        return f"LocalStore({self.url})"

    def _path(self, key: str) -> Path:
        return self.root / _check_read_key(key)

    @staticmethod
    def entry_of(key: str, st: os.stat_result) -> Entry:
        tag = f"{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}"
        return Entry(key, st.st_size, tag, st.st_mtime_ns // 1000, st.st_ino)

    def listing(self, prefix: str = "", *, after: str | None = None) -> Iterator[Entry]:
        # Walk only the folders that can hold keys after the mark, in key order.
        folder = prefix.strip("/")
        yield from self._walk(self.root / _check_key(folder) if folder else self.root, folder, after)

    def _walk(self, path: Path, base: str, after: str | None) -> Iterator[Entry]:
        try:
            found = [e for e in os.scandir(path) if not e.name.endswith(TMP_SUFFIX)]  # a put in progress
        except (FileNotFoundError, NotADirectoryError):
            return
        # Key order, as S3 lists: a folder's keys sort as its name with "/" after it ("a-b" before "a/x").
        for e in sorted(found, key=lambda e: e.name + "/" if e.is_dir() else e.name):
            key = f"{base}/{e.name}" if base else e.name
            if e.is_dir():
                if after is None or after < key + "/\U0010ffff":  # something under it may sort after the mark
                    yield from self._walk(Path(e.path), key, after)
                continue
            if after is not None and key <= after:
                continue
            try:
                st = e.stat()
            except FileNotFoundError:
                continue  # deleted since the listing
            yield self.entry_of(key, st)

    def stat(self, key: str) -> os.stat_result:
        """What the folder holds at ``key``, whatever it is (a named pipe, a directory): for a caller that listed
        ``key`` here and must tell those apart. No key check: a str join, per file of a listing."""
        return os.stat(os.path.join(self.url, key))

    def files(self, prefix: str = "") -> list[Entry]:
        folder = prefix.strip("/")
        found = []
        try:
            listed = list(os.scandir(self.root / _check_key(folder) if folder else self.root))
        except (FileNotFoundError, NotADirectoryError):
            return []
        for e in listed:
            if e.name.endswith(TMP_SUFFIX) or e.is_dir():
                continue
            with contextlib.suppress(FileNotFoundError):  # deleted since the listing
                found.append(self.entry_of(f"{folder}/{e.name}" if folder else e.name, e.stat()))
        return sorted(found, key=lambda e: e.key.encode())

    def head(self, key: str) -> Entry | None:
        try:
            st = self._path(key).stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        return None if not os.path.isfile(self._path(key)) else self.entry_of(key, st)

    @contextlib.contextmanager
    def _open(self, key: str) -> Iterator[int]:
        """A regular file's descriptor. Never blocks: a named pipe put in a file's place would make a plain open
        wait for a writer for good."""
        try:
            fd = os.open(self._path(key), os.O_RDONLY | os.O_NONBLOCK)
        except (FileNotFoundError, NotADirectoryError):
            raise NotFoundError(f"{self.url}: {key}: no such object") from None
        except OSError as exc:
            raise StorageError(f"{self.url}: {key}: {exc.strerror or exc}") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise NotFoundError(f"{self.url}: {key}: not a regular file")
            yield fd
        except StorageError:
            raise
        except OSError as exc:
            raise StorageError(f"{self.url}: {key}: {exc.strerror or exc}") from None
        finally:
            os.close(fd)

    def get(self, key: str) -> bytes:
        return self.read(key)[0]

    def read(self, key: str) -> tuple[bytes, Entry]:
        with self._open(key) as fd:
            before = os.fstat(fd)
            with os.fdopen(os.dup(fd), "rb") as fh:
                content = fh.read()
            try:
                after = os.stat(self._path(key))  # the name's file now: another renamed into place is a change
            except FileNotFoundError:
                raise ChangingError(f"{self.url}: {key}: removed while it was read") from None
        entry = self.entry_of(key, after)
        if (before.st_ino, before.st_size, before.st_mtime_ns) != (after.st_ino, after.st_size, after.st_mtime_ns) or (
            len(content) != after.st_size
        ):
            raise ChangingError(f"{self.url}: {key}: changed while it was read")
        return content, entry

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        with self._open(key) as fd:
            if len(ranges) > 8:  # many small ranges (an index's lines): one map, sliced
                size = os.fstat(fd).st_size
                if not size:
                    return [b""] * len(ranges)
                try:
                    with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mm:
                        return [mm[start:end] if end > start else b"" for start, end in ranges]
                except ValueError:  # emptied since the fstat (mmap refuses an empty file): read as it is now
                    pass
            return [os.pread(fd, max(0, end - start), start) for start, end in ranges]

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> bool:
        try:
            return self._put(key, data, if_absent)
        except StorageError:
            raise
        except OSError as exc:  # a folder of that name, a file where a folder must be, a full or read-only disk
            raise StorageError(f"{self.url}: {key}: {exc.strerror or exc}") from None

    def _put(self, key: str, data: bytes, if_absent: bool) -> bool:
        path = self.root / _check_key(key)
        make_dirs(path.parent)
        tmp = path.with_name(f".{secrets.token_hex(8)}{TMP_SUFFIX}")
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            if if_absent:
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    return path.read_bytes() == data  # as a bucket answers (S3Store.put)
            else:
                os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(path.parent)
        return True

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError, NotADirectoryError, IsADirectoryError):  # no such object
            self._path(key).unlink()

    def folders(self, prefix: str = "") -> list[str]:
        folder = prefix.strip("/")
        try:
            listed = list(os.scandir(self.root / _check_key(folder) if folder else self.root))
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted((e.name for e in listed if e.is_dir() and not e.name.endswith(TMP_SUFFIX)), key=str.encode)

    def move(self, src: str, dst: str) -> bool:
        source, target = self._path(src), self.root / _check_key(dst)
        try:
            make_dirs(target.parent)
            try:
                os.replace(source, target)
            except FileNotFoundError:
                return False  # moved by someone else already
            # Durable before the caller acts on it: the file in its new folder, and gone from its old one (a folder
            # removed meanwhile, by a publisher that cleared the stage, has nothing left to sync)
            fsync_dir(target.parent)
            if source.parent != target.parent:
                with contextlib.suppress(FileNotFoundError):
                    fsync_dir(source.parent)
        except OSError as exc:
            raise StorageError(f"{self.url}: {src} -> {dst}: {exc.strerror or exc}") from None
        return True

    def remove_all(self, prefix: str) -> None:
        shutil.rmtree(self._path(prefix.strip("/")), ignore_errors=True)

    def location(self, key: str) -> str:
        return str(self._path(key))

    def delta_location(self, key: str) -> tuple[str, dict[str, str]]:
        return str(self._path(key)), {}

    def path(self, key: str) -> Path:
        """The file of ``key`` (a folder's readers may map it into memory rather than read it)."""
        return self._path(key)

    def child(self, prefix: str) -> LocalStore:
        return LocalStore(self.root / _check_key(prefix.strip("/")))


class S3Store:
    """A prefix of an S3 bucket (see the module's text)."""

    atomic = True

    def __init__(self, url: str, options: Mapping[str, str] | None = None):
        from obstore.store import S3Store as _S3

        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        if not bucket:
            raise StorageError(f"not an S3 URL: {url!r} (s3://bucket/prefix)")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.options = dict(options or {})
        config = {k.lower(): v for k, v in self.options.items()}
        endpoint = config.get("aws_endpoint_url") or os.environ.get("AWS_ENDPOINT_URL", "")
        if endpoint.startswith("http://"):
            config.setdefault("aws_allow_http", "true")
        self._config = config
        if "%" in self.prefix:
            # deltalake reads its location as a URL and decodes "%41" to "A", once more even when escaped: its tables
            # would be under another prefix than this store's objects
            raise StorageError(f"{self.url}: a '%' in the prefix is not supported (the output tables' library reads"
                               " it as an escape): choose another prefix")  # fmt: skip
        try:
            if self.prefix:
                _check_key(self.prefix)
            self._store = _S3(
                bucket,
                prefix=self.prefix or None,
                config=cast("S3Config", config) or None,
                retry_config=cast("RetryConfig", _retry_config()),
                client_options=cast("ClientConfig", _client_options()),
            )
        except StorageError:
            raise
        except Exception as exc:  # an unknown option, a malformed endpoint: one line, never the values
            raise StorageError(f"{self.url}: {type(exc).__name__}: {str(exc).strip().splitlines()[0]}") from None

    def __repr__(self) -> str:
        return f"S3Store({self.url})"

    def _error(self, exc: Exception, key: str) -> StorageError:
        from obstore.exceptions import NotFoundError as _NotFound

        if "<Code>NoSuchBucket</Code>" in str(exc):  # S3's answer for a bucket, not for a key: say it plainly
            return StorageError(f"{self.url}: the bucket {self.bucket!r} does not exist on {self._endpoint()}")
        if "169.254.169.254" in str(exc):  # no key given: the client asked the cloud's instance metadata for one
            return StorageError(
                f"{self.url}: no credentials for the store: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and"
                " AWS_ENDPOINT_URL for a store other than AWS S3), or the Airflow connection photon_storage"
            )
        cls = NotFoundError if isinstance(exc, (_NotFound, FileNotFoundError)) else StorageError
        return cls(f"{self.url}: {key or '(listing)'}: {error_text(exc)}")

    def _endpoint(self) -> str:
        return self._config.get("aws_endpoint_url") or os.environ.get("AWS_ENDPOINT_URL") or "AWS S3"

    @staticmethod
    def _entry(meta: Mapping[str, Any]) -> Entry:
        modified = meta["last_modified"]
        return Entry(
            str(meta["path"]), int(meta["size"]), str(meta.get("e_tag") or ""), int(modified.timestamp() * 1e6)
        )

    # A folder level with more sub-folders than this wholly after the mark is listed whole, in pages of 1,000, rather
    # than a request per sub-folder (a backlog of a day's 1,440 minute partitions: 2 requests, not 1,440).
    WALK_FANOUT = 16

    def listing(self, prefix: str = "", *, after: str | None = None) -> Iterator[Entry]:
        # Folder by folder (a delimiter listing a level), skipping every folder whose keys all sort before the mark:
        # a listing from a recent mark costs a few requests however many objects lie before it. Never by
        # StartAfter: SeaweedFS applies it per folder level, leaving out keys after the mark and keeping some before.
        import obstore

        folder = prefix.strip("/")
        try:
            found = _again(lambda: self._walk(_check_key(folder) if folder else None, after))
        except (obstore.exceptions.BaseError, OSError, ValueError) as exc:  # obstore maps some to OSError
            if isinstance(exc, StorageError):
                raise
            raise self._error(exc, prefix) from None
        # SeaweedFS lists a folder emptied by deletes as an object named like the folder: never one of its objects
        under = f"{folder}/" if folder else ""
        yield from sorted(
            (e for e in found if e.key.startswith(under) and e.key != folder), key=lambda e: e.key.encode()
        )

    def _walk(self, folder: str | None, after: str | None) -> list[Entry]:
        import obstore

        level = obstore.list_with_delimiter(self._store, folder)
        subs = [str(p) for p in level["common_prefixes"]]
        subs = [p for p in subs if after is None or after < p + "/\U0010ffff"]  # may hold a key after the mark
        inside = [p for p in subs if after is not None and p < after]  # the mark falls among its keys
        whole = [p for p in subs if p not in inside]
        if len(whole) > self.WALK_FANOUT:
            return [self._entry(m) for chunk in obstore.list(self._store, folder, chunk_size=1000) for m in chunk
                    if after is None or str(m["path"]) > after]  # fmt: skip
        found = [e for e in map(self._entry, level["objects"]) if after is None or e.key > after]
        for p in inside:
            found += self._walk(p, after)
        for p in whole:
            found += [self._entry(m) for chunk in obstore.list(self._store, p, chunk_size=1000) for m in chunk]
        return found

    def files(self, prefix: str = "") -> list[Entry]:
        import obstore

        folder = prefix.strip("/")
        try:
            level = _again(lambda: obstore.list_with_delimiter(self._store, _check_key(folder) if folder else None))
            found = level["objects"]
        except (obstore.exceptions.BaseError, OSError, ValueError) as exc:  # obstore maps some to OSError
            raise self._error(exc, prefix) from None
        under = f"{folder}/" if folder else ""  # not the folder itself, as SeaweedFS lists an emptied one (listing)
        entries = (self._entry(m) for m in found)
        return sorted((e for e in entries if e.key.startswith(under) and e.key != folder), key=lambda e: e.key.encode())

    def head(self, key: str) -> Entry | None:
        import obstore

        try:
            return self._entry(obstore.head(self._store, _check_read_key(key)))
        except (obstore.exceptions.NotFoundError, FileNotFoundError):  # obstore raises either
            return None
        except (obstore.exceptions.BaseError, OSError, ValueError) as exc:  # obstore maps some to OSError
            raise self._error(exc, key) from None

    def get(self, key: str) -> bytes:
        return self.read(key)[0]

    def read(self, key: str) -> tuple[bytes, Entry]:
        import obstore

        try:
            got = obstore.get(self._store, _check_read_key(key))
            return bytes(got.bytes()), self._entry(got.meta)
        except (obstore.exceptions.BaseError, OSError, ValueError) as exc:  # obstore maps some to OSError
            raise self._error(exc, key) from None

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        if sum(1 for s, e in ranges if e > s) > 1:
            # obstore merges nearby ranges and panics when a merged one runs past the end: cut them at the size first
            entry = self.head(key)
            if entry is None:
                raise NotFoundError(f"{self.url}: {key}: no such object")
            return self._ranges(key, [(min(s, entry.size), min(e, entry.size)) for s, e in ranges])
        try:
            return self._ranges(key, ranges)
        except NotFoundError:
            raise
        except StorageError:  # a range past the end (416): cut the ranges at the object's size, once
            entry = self.head(key)
            if entry is None:
                raise NotFoundError(f"{self.url}: {key}: no such object") from None
            return self._ranges(key, [(min(s, entry.size), min(e, entry.size)) for s, e in ranges])

    def _ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        import obstore

        wanted = [i for i, (start, end) in enumerate(ranges) if end > start]  # obstore refuses an empty range
        if not wanted:
            if self.head(key) is None:
                raise NotFoundError(f"{self.url}: {key}: no such object")
            return [b""] * len(ranges)
        try:
            got = obstore.get_ranges(
                self._store,
                _check_read_key(key),
                starts=[ranges[i][0] for i in wanted],
                ends=[ranges[i][1] for i in wanted],
            )
        except (obstore.exceptions.BaseError, OSError, ValueError) as exc:  # obstore maps some to OSError
            raise self._error(exc, key) from None
        found = [b""] * len(ranges)
        for i, b in zip(wanted, got, strict=True):
            found[i] = bytes(b)
        return found

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> bool:
        import obstore

        if not if_absent:
            try:
                obstore.put(self._store, _check_key(key), data, mode="overwrite", **_as_put(key, data))
            except (obstore.exceptions.BaseError, OSError, ValueError) as exc:  # obstore maps some to OSError
                raise self._error(exc, key) from None
            return True

        # The client never retries a conditional put once sent (it is not idempotent): after a store restart its
        # pooled connection failed it at once. Tried again here within the retry budget; and since a try whose answer
        # was lost may have written the object, "it exists" means this put's when the object holds these very bytes
        # (a reviewer's proxy dropping one answer made the lease start's probe refuse a sound store).
        def create() -> bool:
            try:
                obstore.put(self._store, _check_key(key), data, mode="create", **_as_put(key, data))
            except (obstore.exceptions.AlreadyExistsError, obstore.exceptions.PreconditionError):
                return self._holds(key, data)  # S3 answers a lost race 412; some stores 409
            return True

        try:
            return again(create, lambda exc: isinstance(exc, obstore.exceptions.GenericError))
        except (obstore.exceptions.BaseError, OSError, ValueError) as exc:  # obstore maps some to OSError
            raise self._error(exc, key) from None

    def _holds(self, key: str, data: bytes) -> bool:
        try:
            return self.get(key) == data
        except NotFoundError:  # written by another, then deleted
            return False

    def delete(self, key: str) -> None:
        import obstore

        try:
            _again(lambda: obstore.delete(self._store, _check_read_key(key)))
        except (obstore.exceptions.NotFoundError, FileNotFoundError):  # obstore raises either
            return
        except (obstore.exceptions.BaseError, OSError, ValueError) as exc:  # obstore maps some to OSError
            raise self._error(exc, key) from None

    def folders(self, prefix: str = "") -> list[str]:
        import obstore

        folder = prefix.strip("/")
        try:
            level = _again(lambda: obstore.list_with_delimiter(self._store, _check_key(folder) if folder else None))
        except (obstore.exceptions.BaseError, OSError, ValueError) as exc:  # obstore maps some to OSError
            raise self._error(exc, prefix) from None
        return sorted((str(p).rstrip("/").rpartition("/")[2] for p in level["common_prefixes"]), key=str.encode)

    def move(self, src: str, dst: str) -> bool:
        import obstore

        try:
            obstore.copy(self._store, _check_read_key(src), _check_key(dst))
        except (obstore.exceptions.NotFoundError, FileNotFoundError):  # obstore raises either
            return False
        except (obstore.exceptions.BaseError, OSError, ValueError) as exc:  # obstore maps some to OSError
            raise self._error(exc, f"{src} -> {dst}") from None
        self.delete(src)
        return True

    def remove_all(self, prefix: str) -> None:
        import obstore

        keys = [e.key for e in self.listing(prefix)]
        for i in range(0, len(keys), 1000):  # DeleteObjects: up to 1,000 keys a request (a stage's are dozens)
            chunk = keys[i : i + 1000]
            try:
                _again(functools.partial(obstore.delete, self._store, chunk))
            except (obstore.exceptions.NotFoundError, FileNotFoundError):  # obstore raises either
                continue
            except (obstore.exceptions.BaseError, OSError, ValueError) as exc:  # obstore maps some to OSError
                raise self._error(exc, prefix) from None

    def delta_location(self, key: str) -> tuple[str, dict[str, str]]:
        options = {k: v for k, v in self._config.items()}
        options |= _retry_options()  # as this client's
        # The standard variables, as obstore reads them (deltalake's own reading of the environment differs)
        for name in (
            "AWS_ENDPOINT_URL",
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_SESSION_TOKEN",
            "AWS_REGION",
        ):
            if os.environ.get(name) and name.lower() not in options:
                options[name.lower()] = os.environ[name]
        return self.location(key), options

    def location(self, key: str) -> str:
        return f"s3://{self.bucket}/{'/'.join(p for p in (self.prefix, _check_read_key(key)) if p)}"

    def child(self, prefix: str) -> S3Store:
        _check_key(prefix.strip("/"))
        return S3Store(f"s3://{self.bucket}/{'/'.join(p for p in (self.prefix, prefix.strip('/')) if p)}", self.options)


# An object's content type, by its key's ending. Sent with every put, in one request up to SINGLE_PUT_MAX: SeaweedFS
# gzips a chunk it takes for text (a JSONL log sent without a type, any part of a multipart upload) and inflates it on
# every read, 0.16 s of its CPU per 27 MB log object against 0.01 s stored as sent, on the cores the joiner runs on.
CONTENT_TYPES = {
    ".jsonl": "application/x-ndjson",
    ".parquet": "application/vnd.apache.parquet",
    ".json": "application/json",
    ".arrow": "application/vnd.apache.arrow.file",
}
# A larger object goes in parts (S3 takes up to 5 GiB in one PUT): one request must end within REQUEST_MAX_S, which
# 256 MiB does above 0.5 MB/s; the project's objects are tens of MB at most (a log file of a second at 50,000/s: 20).
SINGLE_PUT_MAX = 256 << 20


def _as_put(key: str, data: bytes) -> dict[str, Any]:
    kind = CONTENT_TYPES.get(os.path.splitext(key)[1], "binary/octet-stream")
    return {"attributes": {"Content-Type": kind}, "use_multipart": len(data) > SINGLE_PUT_MAX}


def check_conditional_writes(store: Store, folder: str = "_probe") -> None:
    """Refuse (``StorageError``, one line naming the store) a store whose put-if-absent writes anyway: a server that
    ignores ``If-None-Match`` would let two publishers of one batch both commit the same Delta table version. Three
    requests: a put-if-absent of a new key, the same again (must lose), a delete."""
    key = f"{folder}/conditional-{secrets.token_hex(8)}"
    try:
        first = store.put(key, b"1\n", if_absent=True)
        second = store.put(key, b"2\n", if_absent=True)
    finally:
        store.delete(key)
    if not first or second:
        raise StorageError(
            f"{store.url}: the store does not honour conditional writes (a put with If-None-Match: * "
            f"{'wrote over an existing object' if second else 'was refused for a new key'}); photon needs them for "
            "its output tables: use a store that supports them (AWS S3, SeaweedFS, MinIO, R2)"
        )


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def error_text(exc: BaseException) -> str:
    """An object store client's error in one line: its first line (what failed) and, where the client nests its
    causes, the innermost (why: "Connection refused"), without terminal colours. Never a credential: the clients'
    messages name the URL and the request, not the keys."""
    text, _, debug = _ANSI.sub("", str(exc)).partition("Debug source:")
    lines = [ln.strip(" ↳") for ln in text.splitlines() if ln.strip(" ↳")]
    # obstore's "Debug source:" is a Rust struct dump whose last line is "}": its last quoted message is the cause
    # ("Connection refused (os error 111)", "operation timed out").
    cause = re.findall(r'"([^"\n]{3,200})"', debug)
    if cause and (not lines or cause[-1] not in lines[-1]):
        lines.append(cause[-1])
    if not lines:
        return type(exc).__name__
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


def _retry_s() -> float:
    from photon.settings import load_settings  # the settings module reads the environment: at use, not at import

    return load_settings().storage_retry_s


# A failed request is retried until the budget (PHOTON_STORAGE_RETRY_S) is spent, not for a count: with the client's
# default of 10 retries and its jittered backoff from 100 ms, a refused connection (a store restarting) gave up after
# 1.5 s. The pause between tries grows to 2 s at most, so a store back within the budget is found within 2 s.
MAX_BACKOFF_S = 2.0
MAX_RETRIES = 10_000  # never the bound: the budget is
STALL_S = 10.0  # at most this long without a byte of an answer (``_client_options``)
REQUEST_MAX_S = 600.0  # a whole request, its body included


def _again(act: Callable[[], T]) -> T:
    """An idempotent request ``act`` (a listing, a delete), tried again within the budget when it was cut off midway
    (a server killed while it answered, or as the request reached it): the client retries a request that got no
    answer and an object's read whose body broke off, never a listing's body, nor a POST whose connection was reset
    (a delete is a bulk DeleteObjects POST, even of one key); a lease's listing, its stage's removal and a publish's
    move failed so when the store restarted. Any other failure is raised at once."""
    import obstore

    return again(act, lambda exc: isinstance(exc, obstore.exceptions.GenericError) and broke_off(exc))


# What a store's client says of a request cut off by a server that went away mid-answer (or mid-request): a listing's
# body broken off, a connection reset under a conditional put or a Delta commit, which no client retries by itself,
# or an answer that never came within deltalake's timeout (a peer gone without a reset).
_BROKE_OFF = re.compile(
    r"body error|reset by peer|connection closed|broken pipe|end of file before message length|timed out",
    re.IGNORECASE,
)


def broke_off(exc: BaseException) -> bool:
    """Whether ``exc`` says a request was cut off midway (``_BROKE_OFF``): worth trying again if it is idempotent."""
    return _BROKE_OFF.search(str(exc)) is not None


def again(act: Callable[[], T], retry: Callable[[BaseException], bool]) -> T:
    """``act`` (idempotent), tried again while it fails with an error ``retry`` accepts, within the budget
    (PHOTON_STORAGE_RETRY_S)."""
    try:
        return act()
    except BaseException as exc:  # the first try outside tenacity: the settings' read (2 ms) only when one fails
        if not retry(exc):
            raise
    from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_random_exponential

    retrying = Retrying(
        stop=stop_after_delay(_retry_s()),
        wait=wait_random_exponential(multiplier=0.1, max=MAX_BACKOFF_S),
        retry=retry_if_exception(retry),
        reraise=True,
    )
    return retrying(act)


def _retry_config() -> dict[str, Any]:
    """obstore's retry configuration (a ``RetryConfig``)."""
    backoff = {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=MAX_BACKOFF_S)}
    return {"max_retries": MAX_RETRIES, "retry_timeout": timedelta(seconds=_retry_s()), "backoff": backoff}


def _client_options() -> dict[str, Any]:
    """obstore's HTTP client options (a ``ClientConfig``). A peer gone without a reset (a partition, a paused machine)
    sends nothing and closes nothing: an answer stalled for half the retry budget is given up on and the request
    tried again within it (the client's one timeout, 30 s for the whole request, outlasted the budget and then cut a
    large object's read on a slow link). A whole request may take as long as its bytes need, a bounded while."""
    stall = min(STALL_S, _retry_s() / 2)
    return {"read_timeout": timedelta(seconds=stall), "timeout": timedelta(seconds=REQUEST_MAX_S)}


def _retry_options() -> dict[str, str]:
    """The same for deltalake, as its storage options. It takes one bound of a request's time, the whole request's
    ("timeout"; "read_timeout" is not read): half the budget, so that an answer held by a peer gone without a reset
    is given up on and asked again within the budget (its default, 30 s, outlasted the budget: a table's read and a
    publish's commit failed). A read through deltalake (a data file of the output) must end within it."""
    return {
        "max_retries": str(MAX_RETRIES),
        "retry_timeout": f"{max(1, round(_retry_s()))}s",
        "backoff_config.init_backoff": "100ms",
        "backoff_config.max_backoff": f"{MAX_BACKOFF_S:g}s",
        "timeout": f"{int(_retry_s() * 1000 / 2)}ms",
    }


def open_store(url: str | Path, options: Mapping[str, str] | None = None) -> Store:
    """The store a ``--logs`` or ``--out`` names: ``s3://bucket/prefix``, or a folder (a path or ``file://``)."""
    text = str(url)
    if not text.strip():
        raise StorageError("an empty path or URL names no store")
    if text.startswith("s3://"):
        return S3Store(text, options)
    if "://" in text and not text.startswith("file://"):
        raise StorageError(f"{text}: not a folder or an s3:// URL (the stores this project reads and writes)")
    return LocalStore(Path(text.removeprefix("file://")))


def as_store(where: Path | Store | str) -> Store:
    """A store as given, or the one a path or URL names (``open_store``)."""
    return open_store(where) if isinstance(where, (str, Path)) else where


@functools.lru_cache(maxsize=32)
def cached_store(url: str) -> Store:
    """The store ``url`` names, one per process and URL: a Spark worker's tasks share its client (an S3 client per
    task would cost a connection each)."""
    return open_store(url)


# Requests in flight at once per process when a task reads many objects: an object store answers each after a round
# trip (4.5 ms a GET here, with the server on the same two cores; tens of ms on a cloud store), and a task that read its
# 120 files one after another spent 40% of its time waiting on them.
IN_FLIGHT = 8
_POOL: tuple[int, ThreadPoolExecutor] | None = None


def in_flight(calls: Sequence[Callable[[], T]], window: int = IN_FLIGHT) -> Iterator[T]:
    """The results of ``calls``, in order, up to ``window`` of them running at once (``window`` 1: one after
    another, here). At most ``window`` results are held before they are taken: reading ahead, not all at once. A
    call's exception is raised when its result is taken, and ends the reading."""
    global _POOL
    if window <= 1 or len(calls) <= 1:
        yield from (call() for call in calls)
        return
    if _POOL is None or _POOL[0] != os.getpid():  # threads do not survive a fork (Spark's Python daemon forks workers)
        _POOL = (os.getpid(), ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="photon-store"))
    pool = _POOL[1]
    ahead: deque[Future[T]] = deque(pool.submit(call) for call in calls[:window])
    for call in calls[window:]:
        yield ahead.popleft().result()
        ahead.append(pool.submit(call))
    while ahead:
        yield ahead.popleft().result()


def locate(where: Path | Store | str, key: str | None = None) -> tuple[Store, str]:
    """The store and key of ``key`` in ``where`` (a store, a folder or a URL), or of the file ``where`` itself (a
    path) when no key is given."""
    if key is None:
        path = Path(str(where))
        return LocalStore(path.parent), path.name
    return as_store(where), key
