"""A content-addressed store on any fsspec location: `chunks/<h[:2]>/<h>`, `manifests/<id>.json`, and the
markers that keep garbage collection safe (`pending/<token>.json`, `gc/<token>.json`).

Every write is whole or absent: a local file is written under a temporary name and renamed, an object-store
put is atomic. Reads of a missing key answer None; other storage failures become one-line errors."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Sequence
from datetime import datetime

from ..errors import TargetError
from ..remote import filesystem, translate_errors
from ..uris import is_local, join, local_path

CHUNKS, MANIFESTS, PENDING, GC = "chunks", "manifests", "pending", "gc"


def chunk_key(digest: str) -> str:
    return f"{CHUNKS}/{digest[:2]}/{digest}"


class Store:
    """The keys of a store at `uri` (a local folder or a remote prefix such as `s3://bucket/archive`)."""

    def __init__(self, uri: str) -> None:
        self.uri = uri.rstrip("/")
        self.local = is_local(uri)
        self.root = local_path(self.uri)

    def where(self, key: str) -> str:
        return join(self.root if self.local else self.uri, key)

    def put(self, key: str, data: bytes | Sequence[bytes | memoryview]) -> None:
        """Writes `data` (bytes, or parts written one after the other) as `key`."""
        where = self.where(key)
        parts = [data] if isinstance(data, bytes) else data
        if self.local:
            try:
                os.makedirs(os.path.dirname(where), exist_ok=True)
                temp = f"{where}.tmp-{uuid.uuid4().hex}"
                with open(temp, "wb", buffering=0) as f:
                    for part in parts:
                        view = memoryview(part)
                        while view:
                            view = view[f.write(view):]
                os.replace(temp, where)
            except OSError as e:
                raise TargetError(f"archive store {self.uri}: cannot write {key}: {e.strerror or e}",
                                  uri=where) from None
            return
        fs, path = filesystem(where)
        with translate_errors(where, writing=True):
            fs.pipe_file(path, data if isinstance(data, bytes) else b"".join(parts))

    def get(self, key: str) -> bytes | None:
        where = self.where(key)
        if self.local:
            try:
                with open(where, "rb") as f:
                    return f.read()
            except FileNotFoundError:
                return None
        fs, path = filesystem(where)
        with translate_errors(where):
            try:
                return bytes(fs.cat_file(path))
            except FileNotFoundError:
                return None

    def delete(self, key: str) -> None:
        where = self.where(key)
        if self.local:
            with contextlib.suppress(FileNotFoundError):
                os.remove(where)
            return
        fs, path = filesystem(where)
        with translate_errors(where, writing=True), contextlib.suppress(FileNotFoundError):
            fs.rm_file(path)

    def listing(self, prefix: str) -> dict[str, tuple[float, int]]:
        """Every key under `prefix` (temporary files left out) -> (modification time in epoch seconds, size)."""
        base = self.where(prefix)
        out: dict[str, tuple[float, int]] = {}
        if self.local:
            for folder, _, names in os.walk(base):
                for name in names:
                    if ".tmp-" in name:
                        continue
                    full = os.path.join(folder, name)
                    try:
                        info = os.stat(full)
                    except FileNotFoundError:
                        continue
                    out[os.path.relpath(full, self.root).replace(os.sep, "/")] = (info.st_mtime, info.st_size)
            return out
        fs, path = filesystem(base)
        with translate_errors(base):
            try:
                found = fs.find(path, detail=True)
            except FileNotFoundError:
                return out
        own = self.uri.split("://", 1)[1]
        for name, info in found.items():
            name = name.split("://", 1)[-1]
            out[name[len(own) + 1:]] = (_mtime(info), int(info.get("size") or 0))
        return out


def _mtime(info: dict) -> float:
    for field in ("LastModified", "mtime", "last_modified", "created"):
        value = info.get(field)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, int | float):
            return float(value)
    return 0.0
