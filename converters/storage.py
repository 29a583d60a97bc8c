"""Byte-level I/O over local paths and fsspec URIs, and outputs that appear atomically.

Reads are explicit byte ranges (`os.pread` on local files, ranged `cat_file` elsewhere); no file
is mmapped or read whole unless it is small metadata.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

from .errors import SourceError, TargetError


def is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


def local_path(uri: str) -> str:
    return uri.removeprefix("file://")


@lru_cache(maxsize=64)
def _fs(protocol: str) -> Any:
    import fsspec

    try:
        return fsspec.filesystem(protocol)
    except ImportError as exc:
        raise SourceError(f"{protocol}:// needs an extra package: {exc}") from None


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


def exists(uri: str) -> bool:
    if is_local(uri):
        return os.path.exists(local_path(uri))
    fs, path = filesystem(uri)
    return bool(fs.exists(path))


def isdir(uri: str) -> bool:
    if is_local(uri):
        return os.path.isdir(local_path(uri))
    fs, path = filesystem(uri)
    return bool(fs.isdir(path))


def listdir(uri: str) -> list[str]:
    """Names (not paths) of the entries of a folder, sorted."""
    if is_local(uri):
        return sorted(os.listdir(local_path(uri)))
    fs, path = filesystem(uri)
    return sorted(basename(p) for p in fs.ls(path, detail=False))


def size(uri: str) -> int:
    if is_local(uri):
        return os.path.getsize(local_path(uri))
    fs, path = filesystem(uri)
    return int(fs.size(path))


def read_all(uri: str) -> bytes:
    """Read a whole (small, metadata) file."""
    try:
        if is_local(uri):
            with open(local_path(uri), "rb") as fh:
                return fh.read()
        fs, path = filesystem(uri)
        return bytes(fs.cat_file(path))
    except FileNotFoundError:
        raise SourceError(f"{uri}: no such file") from None
    except IsADirectoryError:
        raise SourceError(f"{uri}: is a folder, expected a file") from None


class RangeReader:
    """Reads byte ranges of files, keeping one descriptor per local file; safe across threads."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def fd(self, path: str) -> int:
        """A shared read-only descriptor of a local file (kept open until `close`)."""
        fd = self._fds.get(path)
        if fd is None:
            with self._lock:
                fd = self._fds.get(path)
                if fd is None:
                    try:
                        fd = os.open(path, os.O_RDONLY)
                    except FileNotFoundError:
                        raise SourceError(f"{path}: data file is missing; the checkpoint is incomplete "
                                          "(re-copy or re-upload it)") from None
                    self._fds[path] = fd
        return fd

    def read(self, uri: str, offset: int, length: int) -> bytes:
        if length == 0:
            return b""
        if is_local(uri):
            data = os.pread(self.fd(local_path(uri)), length, offset)
        else:
            fs, path = filesystem(uri)
            data = fs.cat_file(path, start=offset, end=offset + length)
        if len(data) != length:
            raise SourceError(f"{uri}: file is shorter than the checkpoint metadata says (wanted bytes "
                              f"{offset}..{offset + length}); it is truncated: re-copy or re-upload it")
        return data

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

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_target(uri: str, overwrite: bool) -> None:
    if exists(uri) and not overwrite:
        raise TargetError(f"{uri}: already exists; pass --overwrite to replace it, or choose another target")


@contextmanager
def atomic_output(uri: str, overwrite: bool = False) -> Iterator[str]:
    """Yield a temporary sibling path; on success move it to `uri`, on failure remove it.

    Works for a file or a folder target. Readers never see a half-written output.
    """
    check_target(uri, overwrite)
    if not is_local(uri):
        raise TargetError(f"{uri}: writing to object storage is not supported yet; write to a local path")
    target = os.path.abspath(local_path(uri))
    parent_dir = os.path.dirname(target)
    try:
        os.makedirs(parent_dir, exist_ok=True)
    except OSError as exc:
        raise TargetError(f"{parent_dir}: cannot create the output folder ({exc.strerror})") from None
    tmp = os.path.join(parent_dir, f".{os.path.basename(target)}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        yield tmp
        if os.path.exists(target):
            _remove(target)
        os.replace(tmp, target)
    except OSError as exc:
        _remove(tmp)
        if exc.errno == errno.ENOSPC:
            raise TargetError(f"{target}: disk full while writing; free space or choose another target "
                              "(nothing was left behind)") from None
        raise TargetError(f"{target}: cannot write ({exc.strerror or exc})") from None
    except BaseException:
        _remove(tmp)
        raise


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)
