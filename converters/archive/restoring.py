"""restore(store, id, target): an archived checkpoint's files written back byte for byte, every chunk's hash
verified; list_archives(store): what a store holds."""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

import numpy as np

from ..certificate import sidecar
from ..errors import FormatError, TargetError
from ..remote import filesystem, remote_call, translate_errors
from ..uris import is_local, join, local_path
from . import codec
from .chunking import PIECE
from .direct import ALIGN, DirectFile, aligned
from .hashing import HASHES
from .inflight import InFlight
from .manifest import hash_name, ids, read
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


def _damaged(store: Store, digest: str, why: str) -> FormatError:
    used = ", ".join(users(store, digest)) or "none"
    return FormatError(f"archive store {store.uri}: chunk {digest} {why} (used by archives: {used}); "
                       "those archives cannot be restored from this store: re-archive their sources",
                       uri=store.where(chunk_key(digest)))


def _chunk(store: Store, digest: str, length: int, hashed: str, out: np.ndarray | None = None) -> bytes | memoryview:
    """Chunk `digest` fetched, decoded (into `out` when given) and its hash checked."""
    stored = store.get(chunk_key(digest))
    why = None
    if stored is None:
        why = "is missing"
    else:
        try:
            data = codec.decode(stored, length, out)
        except Exception:  # zstd's own errors, a bad tag: the chunk is damaged
            why = "does not decode"
        else:
            if len(data) != length or HASHES[hashed](data) != digest:
                why = "does not match its hash"
    if why:
        raise _damaged(store, digest, why)
    return data


_buffers = threading.local()


def _buffer(length: int) -> np.ndarray:
    """This worker thread's buffer for decoded chunks, aligned for direct I/O (reused: no fresh pages to fault in
    for every chunk)."""
    buf = getattr(_buffers, "buf", None)
    if buf is None or len(buf) < length:
        buf = _buffers.buf = aligned(max(length, PIECE + ALIGN))
    return buf


def _put(store: Store, digest: str, length: int, hashed: str, target: DirectFile, offset: int, where: str) -> None:
    """Chunk `digest` decoded into this worker's buffer at `offset` modulo ALIGN, its hash checked, and written at
    `offset` of `target` (a worker's whole share). A local store's chunk is read through a memory map."""
    try:
        lead = offset % ALIGN
        out = _buffer(lead + length)[lead:lead + length]
        if not store.local:
            _chunk(store, digest, length, hashed, out)
        else:
            _decoded_into(store, digest, length, hashed, out)
        target.write(out, offset)
    except OSError as e:
        raise TargetError(f"restore: cannot write {where}: {e.strerror or e}", uri=where) from None


def _decoded_into(store: Store, digest: str, length: int, hashed: str, out: np.ndarray) -> None:
    """A local store's chunk, read through a memory map, decoded into `out` and its hash checked."""
    try:
        src = os.open(store.where(chunk_key(digest)), os.O_RDONLY)
    except FileNotFoundError:
        raise _damaged(store, digest, "is missing") from None
    try:
        if os.fstat(src).st_size == 0:
            raise _damaged(store, digest, "does not decode")
        with mmap.mmap(src, 0, access=mmap.ACCESS_READ) as mapped, memoryview(mapped) as view:
            why = _why_damaged(view, digest, length, hashed, out)
    finally:
        os.close(src)
    if why:
        raise _damaged(store, digest, why)


def _why_damaged(view: memoryview, digest: str, length: int, hashed: str, out: np.ndarray) -> str | None:
    """Decodes a stored chunk into `out` and checks its hash; why it is damaged, else None."""
    try:
        data = codec.decode(view, length, out)
    except Exception:  # zstd's own errors, a bad tag: the chunk is damaged
        return "does not decode"
    if len(data) != length or HASHES[hashed](data) != digest:  # data: out's bytes (a damaged chunk's own view)
        return "does not match its hash"
    return None


def restore(store: str, archive_id: str, target: str) -> list[str]:
    """Writes archive `archive_id` of `store` to `target` (a folder, or the file itself for a single-file
    checkpoint), which must not exist yet; returns the files written. A single file's manifest archived with it
    is written beside it (`<target>.ckpt-manifest.json`; its certificate names the file, so `verify
    --certificate` passes on a file restored under its own name). A local target appears whole or not at all
    (written beside it under a temporary name, then renamed, a single file's manifest before the file); remote
    files are each put whole, and those written are removed again when the restore fails."""
    st = Store(store)
    doc = read(st, archive_id)
    hashed = hash_name(doc)
    target = target.rstrip("/")
    single = bool(doc.get("single_file"))
    finals = _places(doc, target, single)
    for where in finals if single else [target]:
        _check_target(where)
    local = is_local(target)
    stage = f"{local_path(target)}.restoring-{uuid.uuid4().hex[:8]}" if local else target
    staged = _places(doc, stage, single)
    written: list[str] = []
    placed: list[str] = []
    try:
        with ThreadPoolExecutor(WORKERS) as pool:
            for entry, where in zip(doc["files"], staged, strict=True):
                (_write_local if local else _write)(st, pool, entry, where, hashed)
                written.append(where)
        if local:
            for temporary, final in reversed(list(zip(staged, finals, strict=True))) if single else [(stage, target)]:
                os.replace(temporary, local_path(final))
                placed.append(local_path(final))
    except BaseException:
        if local:
            for path in [*(staged if single else [stage]), *placed]:
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                elif os.path.lexists(path):
                    os.remove(path)
        else:
            for where in written:
                with contextlib.suppress(Exception):
                    remote_call(where, "rm_file")
        raise
    return finals


def _places(doc: dict[str, Any], root: str, single: bool) -> list[str]:
    """Where each of the archive's files goes under `root`: a single file at `root` and its manifest beside it,
    a folder's files in it."""
    if single:
        return [root, sidecar(root)][:len(doc["files"])]
    return [join(root, entry["name"]) for entry in doc["files"]]


def _check_target(target: str) -> None:
    if is_local(target):
        if os.path.lexists(local_path(target)):
            raise TargetError(f"restore target {target} exists; give a new folder", uri=target)
        return
    fs, path = filesystem(target)
    with translate_errors(target):
        if fs.exists(path):
            raise TargetError(f"restore target {target} exists; give a new location", uri=target)


def _write_local(st: Store, pool: ThreadPoolExecutor, entry: dict[str, Any], where: str, hashed: str) -> None:
    """The file's chunks fetched, verified and written in place by the workers (each at its offset, `DirectFile`),
    at most AHEAD at once."""
    try:
        os.makedirs(os.path.dirname(where) or ".", exist_ok=True)
        target = DirectFile(where, entry["size"])
    except OSError as e:
        raise TargetError(f"restore: cannot write {where}: {e.strerror or e}", uri=where) from None
    done = False
    try:
        with InFlight[None](pool, AHEAD) as flight:
            offset = 0
            for digest, length, _ in entry["chunks"]:
                flight.submit(_put, st, digest, length, hashed, target, offset, where)
                offset += length
            flight.drain()
        done = True
    finally:
        try:
            target.close(entry["mode"] or 0o644 if done else None)
        except OSError as e:
            if done:
                raise TargetError(f"restore: cannot write {where}: {e.strerror or e}", uri=where) from None


def _write(st: Store, pool: ThreadPoolExecutor, entry: dict[str, Any], where: str, hashed: str) -> None:
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
    done = False
    try:
        with InFlight[bytes | memoryview](pool, AHEAD) as flight:
            for digest, length, _ in entry["chunks"]:
                for data in flight.submit(_chunk, st, digest, length, hashed):
                    handle.write(data)
            for data in flight.drain():
                handle.write(data)
        done = True
    finally:
        if local:
            handle.close()
            if done:
                os.chmod(where, entry["mode"] or 0o644)
        elif done:
            with translate_errors(where, writing=True):
                handle.close()
