"""Byte-level I/O over local paths and fsspec URIs, and outputs that appear atomically.

Reads are explicit byte ranges (`os.pread` on local files, ranged `cat_file` elsewhere); no file
is mmapped or read whole unless it is small metadata.
"""

from __future__ import annotations

import mmap
import os
import threading
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

from .errors import CkptError, SourceError, TargetError

#: Remote reads smaller than this fetch the whole aligned block (cached), so many small header reads
#: cost few requests; larger reads go straight through.
MIN_REQUEST = 256 * 1024
_CACHE_BLOCKS = 256  # 64 MiB at most
_CRC_WINDOW = 64 * 1024 * 1024
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs (pip install gcsfs)", "gcs": "gcs (pip install gcsfs)",
           "az": "azure (pip install adlfs)", "abfs": "azure (pip install adlfs)"}


def is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


def local_path(uri: str) -> str:
    return uri.removeprefix("file://")


@lru_cache(maxsize=64)
def _fs(protocol: str) -> Any:
    import fsspec

    try:
        try:  # listings must be fresh: another process may finish an upload while this one runs
            return fsspec.filesystem(protocol, use_listings_cache=False)
        except TypeError:
            return fsspec.filesystem(protocol)
    except ImportError:
        extra = _EXTRAS.get(protocol)
        hint = f"pip install 'ckpt-service[{extra}]'" if extra == "s3" else (f"install {extra}" if extra else
                                                                             "install its fsspec package")
        raise SourceError(f"{protocol}:// URIs need an extra package: {hint}") from None
    except ValueError:
        raise SourceError(f"{protocol}:// is not a storage protocol fsspec knows") from None


@contextmanager
def translate_errors(uri: str, writing: bool = False) -> Iterator[None]:
    """Turn storage exceptions into one-line errors that say what failed, in plain words."""
    kind = TargetError if writing else SourceError
    try:
        yield
    except CkptError:
        raise
    except FileNotFoundError as exc:
        text = str(exc)
        if "bucket" in text.lower() or "NoSuchBucket" in text:
            raise kind(f"{uri}: no such bucket; create it or fix the URI") from None
        raise kind(f"{uri}: no such file or prefix") from None
    except PermissionError:
        raise kind(f"{uri}: access denied; check the credentials (AWS_ACCESS_KEY_ID / AWS_PROFILE) and the "
                   "bucket policy") from None
    except OSError as exc:
        text = f"{type(exc).__name__}: {exc}"
        if "Could not connect" in text or "EndpointConnectionError" in text or "Connect" in type(exc).__name__:
            raise kind(f"{uri}: storage endpoint unreachable ({_endpoint()}); check AWS_ENDPOINT_URL or the "
                       "network") from None
        if "SlowDown" in text or "Throttl" in text or "503" in text:
            raise kind(f"{uri}: the storage service kept throttling requests; retry later") from None
        raise kind(f"{uri}: storage error ({text})") from None
    except Exception as exc:  # botocore and aiohttp raise their own types
        name = type(exc).__name__
        if "Credential" in name:
            raise kind(f"{uri}: no credentials found; set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile") \
                from None
        if "Connect" in name or "Timeout" in name:
            raise kind(f"{uri}: storage endpoint unreachable ({_endpoint()}); check AWS_ENDPOINT_URL or the "
                       "network") from None
        raise


def _endpoint() -> str:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "the default AWS endpoint"


def filesystem(uri: str) -> tuple[Any, str]:
    """(fsspec filesystem, path) for a remote URI."""
    protocol = uri.split("://", 1)[0]
    return _fs(protocol), uri


def join(base: str, *names: str) -> str:
    out = base.rstrip("/")
    for name in names:
        out = f"{out}/{name}"
    return out


def basename(uri: str) -> str:
    return uri.rstrip("/").rsplit("/", 1)[-1]


def parent(uri: str) -> str:
    return uri.rstrip("/").rsplit("/", 1)[0] if "/" in uri.rstrip("/") else "."


def _remote_call(uri: str, method: str, **kwargs: Any) -> Any:
    """`fs.<method>(uri)` on the URI's filesystem, with storage errors in plain words."""
    fs, path = filesystem(uri)
    with translate_errors(uri):
        return getattr(fs, method)(path, **kwargs)


def exists(uri: str) -> bool:
    return os.path.exists(local_path(uri)) if is_local(uri) else bool(_remote_call(uri, "exists"))


def isdir(uri: str) -> bool:
    return os.path.isdir(local_path(uri)) if is_local(uri) else bool(_remote_call(uri, "isdir"))


def listdir(uri: str) -> list[str]:
    """Names (not paths) of the entries of a folder, sorted."""
    if is_local(uri):
        return sorted(os.listdir(local_path(uri)))
    own = uri.split("://", 1)[-1].rstrip("/")
    return sorted(basename(p) for p in _remote_call(uri, "ls", detail=False) if p.rstrip("/") != own)


def size(uri: str) -> int:
    return os.path.getsize(local_path(uri)) if is_local(uri) else int(_remote_call(uri, "size"))


def read_all(uri: str) -> bytes:
    """Read a whole (small, metadata) file."""
    try:
        if is_local(uri):
            with open(local_path(uri), "rb") as fh:
                return fh.read()
        return bytes(_remote_call(uri, "cat_file"))
    except FileNotFoundError:
        raise SourceError(f"{uri}: no such file") from None
    except IsADirectoryError:
        raise SourceError(f"{uri}: is a folder, expected a file") from None


class RangeReader:
    """Reads byte ranges of files, keeping one descriptor per local file; safe across threads."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._blocks: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._maps: dict[str, mmap.mmap] = {}
        self.requested = 0  # bytes asked for by the engine (remote files)
        self.fetched = 0  # bytes transferred from remote storage
        self.requests = 0

    def fd(self, path: str) -> int:
        """A shared read-only descriptor of a local file (kept open until `close`)."""
        fd = self._fds.get(path)
        if fd is None:
            with self._lock:
                fd = self._fds.get(path)
                if fd is None:
                    fd = self._fds[path] = self._open(path)
        return fd

    def read(self, uri: str, offset: int, length: int) -> bytes:
        if length == 0:
            return b""
        if is_local(uri):
            data = os.pread(self.fd(local_path(uri)), length, offset)
        else:
            data = self._remote(uri, offset, length)
        if len(data) != length:
            raise SourceError(f"{uri}: file is shorter than the checkpoint metadata says (wanted bytes "
                              f"{offset}..{offset + length}); it is truncated: re-copy or re-upload it")
        return data

    def _fetch(self, uri: str, start: int, end: int) -> bytes:
        fs, path = filesystem(uri)
        with translate_errors(uri):
            data = bytes(fs.cat_file(path, start=start, end=end))
        with self._lock:
            self.fetched += len(data)
            self.requests += 1
        return data

    def _remote(self, uri: str, offset: int, length: int) -> bytes:
        """Ranged read; small reads go through an LRU of aligned `MIN_REQUEST` blocks."""
        with self._lock:
            self.requested += length
        if length >= MIN_REQUEST:
            return self._fetch(uri, offset, offset + length)
        out = bytearray()
        block = offset // MIN_REQUEST
        while len(out) < length:
            key = (uri, block)
            with self._lock:
                data = self._blocks.get(key)
                if data is not None:
                    self._blocks.move_to_end(key)
            if data is None:
                data = self._fetch(uri, block * MIN_REQUEST, (block + 1) * MIN_REQUEST)
                with self._lock:
                    self._blocks[key] = data
                    while len(self._blocks) > _CACHE_BLOCKS:
                        self._blocks.popitem(last=False)
            lo = offset + len(out) - block * MIN_REQUEST
            piece = data[lo: lo + length - len(out)]
            if not piece:
                break
            out += piece
            block += 1
        return bytes(out)

    def fetch_note(self) -> list[str]:
        """A report line on remote traffic, when there was any."""
        if not self.fetched:
            return []
        return [f"fetched {self.fetched} bytes in {self.requests} requests for {self.requested} bytes needed "
                "from remote storage"]

    def readinto(self, uri: str, offset: int, view: memoryview) -> None:
        length = len(view)
        if length == 0:
            return
        if is_local(uri):
            fd = self.fd(local_path(uri))
            got = os.preadv(fd, [view], offset)
            while got < length:
                more = os.preadv(fd, [view[got:]], offset + got)
                if more == 0:
                    raise SourceError(f"{uri}: file is shorter than the checkpoint metadata says (wanted "
                                      f"bytes {offset}..{offset + length}); it is truncated: re-copy it")
                got += more
        else:
            view[:] = self.read(uri, offset, length)

    def crc32(self, path: str, offset: int, length: int, crc: int = 0) -> int:
        """CRC-32 of a local file range, read through a mapping of the page cache (no copy into Python).

        Pages are dropped from this process after each window, so its memory stays flat; local files only
        (remote files are never mapped)."""
        if length == 0:
            return crc
        mapping = self._maps.get(path)
        if mapping is None:
            fd = self.fd(path)
            with self._lock:
                mapping = self._maps.get(path)
                if mapping is None:
                    mapping = self._maps[path] = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        end = offset + length
        if end > len(mapping):
            raise SourceError(f"{path}: file is shorter than the checkpoint metadata says (wanted bytes up to "
                              f"{end}); it is truncated: re-copy or re-upload it")
        view = memoryview(mapping)
        try:
            while offset < end:
                stop = min(end, offset + _CRC_WINDOW)
                crc = zlib.crc32(view[offset:stop], crc)
                page = offset - offset % mmap.PAGESIZE
                mapping.madvise(mmap.MADV_DONTNEED, page, stop - page)
                offset = stop
        finally:
            view.release()
        return crc

    def _open(self, path: str) -> int:
        try:
            return os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise SourceError(f"{path}: data file is missing; the checkpoint is incomplete (re-copy or re-upload "
                              "it)") from None

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            for mapping in self._maps.values():
                mapping.close()
            self._maps.clear()

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_target(uri: str, overwrite: bool) -> None:
    """Refuse to write over an existing output, unless asked, or unless it is one we never finished."""
    if exists(uri) and not overwrite and not is_incomplete(uri):
        raise TargetError(f"{uri}: already exists; pass --overwrite to replace it, or choose another target")


def is_incomplete(uri: str) -> bool:
    """True for an output prefix that ckpt-service started and did not finish (marker, no manifest)."""
    if is_local(uri) or not isdir(uri):
        return False
    names = listdir(uri)
    return ".ckpt-writing" in names and "ckpt-manifest.json" not in names

