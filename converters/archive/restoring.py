"""restore(store, id, target): an archived checkpoint's files written back byte for byte, every chunk's hash
verified; list_archives(store): what a store holds."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, Any

from ..errors import FormatError, TargetError
from ..remote import filesystem, remote_call, translate_errors
from ..uris import is_local, join, local_path
from . import codec
from .manifest import ids, read
from .store import Store, chunk_key

WORKERS = 2
AHEAD = 6  # chunks fetched and decoded ahead of the one being written


def list_archives(store: str) -> list[dict[str, Any]]:
    """Each archived checkpoint: id, source, created, files, logical and stored bytes."""
    st = Store(store)
    out = []
    for archive_id in ids(st):
        doc = read(st, archive_id)
        out.append({"id": archive_id, "source": doc.get("source"), "created": doc.get("created"),
                    "files": len(doc["files"]), "logical_bytes": doc.get("logical_bytes"),
                    "stored_bytes": doc.get("stored_bytes")})
    return out


def users(store: Store, digest: str) -> list[str]:
    """The archives whose manifests reference chunk `digest`."""
    out = []
    for archive_id in ids(store):
        try:
            doc = read(store, archive_id)
        except FormatError:
            continue
        if any(c[0] == digest for f in doc["files"] for c in f["chunks"]):
            out.append(archive_id)
    return out


def _chunk(store: Store, digest: str, length: int) -> bytes | memoryview:
    stored = store.get(chunk_key(digest))
    why = None
    if stored is None:
        why = "is missing"
    else:
        try:
            data = codec.decode(stored, length)
        except Exception:  # zstd's own errors, a bad tag: the chunk is damaged
            why = "does not decode"
        else:
            if len(data) != length or hashlib.sha256(data).hexdigest() != digest:
                why = "does not match its hash"
    if why:
        used = ", ".join(users(store, digest)) or "none"
        raise FormatError(f"archive store {store.uri}: chunk {digest} {why} (used by archives: {used}); "
                          "those archives cannot be restored from this store: re-archive their sources",
                          uri=store.where(chunk_key(digest)))
    return data


def restore(store: str, archive_id: str, target: str) -> list[str]:
    """Writes archive `archive_id` of `store` to `target` (a folder, or the file itself for a single-file
    checkpoint), which must not exist yet; returns the files written. A local target appears whole or not at
    all (written beside it under a temporary name, then renamed); remote files are each put whole, and those
    written are removed again when the restore fails."""
    st = Store(store)
    doc = read(st, archive_id)
    target = target.rstrip("/")
    _check_target(target)
    single = bool(doc.get("single_file")) and len(doc["files"]) == 1
    local = is_local(target)
    stage = f"{local_path(target)}.restoring-{uuid.uuid4().hex[:8]}" if local else target
    written: list[str] = []
    try:
        with ThreadPoolExecutor(WORKERS) as pool:
            for entry in doc["files"]:
                where = stage if single else join(stage, entry["name"])
                _write(st, pool, entry, where)
                written.append(where)
        if local:
            os.replace(stage, local_path(target))
    except BaseException:
        if local:
            if os.path.isdir(stage):
                shutil.rmtree(stage, ignore_errors=True)
            elif os.path.lexists(stage):
                os.remove(stage)
        else:
            for where in written:
                with contextlib.suppress(Exception):
                    remote_call(where, "rm_file")
        raise
    return [target if single else join(target, e["name"]) for e in doc["files"]]


def _check_target(target: str) -> None:
    if is_local(target):
        if os.path.lexists(local_path(target)):
            raise TargetError(f"restore target {target} exists; give a new folder", uri=target)
        return
    fs, path = filesystem(target)
    with translate_errors(target):
        if fs.exists(path):
            raise TargetError(f"restore target {target} exists; give a new location", uri=target)


def _write(st: Store, pool: ThreadPoolExecutor, entry: dict[str, Any], where: str) -> None:
    local = is_local(where)
    handle: IO[bytes]
    if local:
        try:
            os.makedirs(os.path.dirname(where) or ".", exist_ok=True)
            handle = open(where, "wb")  # noqa: SIM115 - closed below
        except OSError as e:
            raise TargetError(f"restore: cannot write {where}: {e.strerror or e}", uri=where) from None
    else:
        fs, path = filesystem(where)
        with translate_errors(where, writing=True):
            handle = fs.open(path, "wb")
    queue: deque[Future[bytes | memoryview]] = deque()
    done = False
    try:
        for digest, length, _ in entry["chunks"]:
            queue.append(pool.submit(_chunk, st, digest, length))
            if len(queue) >= AHEAD:
                handle.write(queue.popleft().result())
        while queue:
            handle.write(queue.popleft().result())
        done = True
    finally:
        for future in queue:
            future.cancel()
        if local:
            handle.close()
            if done:
                os.chmod(where, entry["mode"] or 0o644)
        elif done:
            with translate_errors(where, writing=True):
                handle.close()
