"""archive(source, store): a checkpoint's files as chunks stored once (hashed, compressed) and a manifest."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..errors import CkptError, OptionError
from ..index import CheckpointIndex
from ..uris import is_local, local_path
from . import codec
from .chunking import BLOCK, cdc_cuts, segments, tensor_ranges
from .collect import STALE_S, put_marker, wait_for_gc
from .hashing import BLAKE3, HASHES
from .inflight import InFlight
from .manifest import FORMAT, check_id, manifest_key, parse
from .sources import SourceFile, list_files, open_read
from .store import CHUNKS, PENDING, Store, chunk_key

WORKERS = 2
IN_FLIGHT = 6  # chunks read/hashed/compressed at once (each at most 4 MiB raw)


@dataclass
class ArchiveResult:
    archive_id: str
    store: str
    files: int
    chunks: int
    new_chunks: int
    logical_bytes: int  # the checkpoint's bytes
    unique_bytes: int  # its distinct chunks' bytes
    stored_bytes: int  # those chunks as stored (compressed)
    new_bytes: int  # raw bytes of the chunks this archive added to the store
    new_stored_bytes: int  # what they take in the store
    seconds: float

    @property
    def dedup_saved(self) -> int:
        """Bytes not stored because the store (or this checkpoint) held them already."""
        return self.logical_bytes - self.new_bytes

    @property
    def compression_saved(self) -> int:
        return self.new_bytes - self.new_stored_bytes

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "dedup_saved": self.dedup_saved, "compression_saved": self.compression_saved}


SINGLE_FILE_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt")


def _inspected(uri: str, files: list[SourceFile]) -> dict[str, list[tuple[int, int, int]]]:
    from ..operations import inspect

    try:
        index: CheckpointIndex = inspect(uri)
    except CkptError:
        return {}
    return tensor_ranges(index, {f.uri: f.name for f in files})


def _index(source: str, files: list[SourceFile]) -> dict[str, list[tuple[int, int, int]]]:
    """The tensor ranges of each file the engine's index describes: the source's own index, then each file
    it leaves out that reads as a checkpoint of its own (a torch.save file beside a safetensors model). A file
    that none describes is cut by content."""
    ranges = _inspected(source, files)
    if len(files) > 1:
        for f in files:
            if f.name not in ranges and f.name.endswith(SINGLE_FILE_SUFFIXES):
                ranges.update(_inspected(f.uri, [f]))
    return ranges


@dataclass(frozen=True)
class _Range:
    """`length` bytes at `offset` of the local file open as `fd`, read by the worker that stores them."""

    fd: int
    uri: str
    offset: int
    length: int

    def read(self) -> bytes:
        data = os.pread(self.fd, self.length, self.offset)
        while len(data) < self.length:
            more = os.pread(self.fd, self.length - len(data), self.offset + len(data))
            if not more:
                raise CkptError(f"archive: {self.uri} changed while it was archived (shorter than listed); "
                                "archive a checkpoint that is complete", uri=self.uri)
            data += more
        return data


def _pieces(f: SourceFile, ranges: list[tuple[int, int, int]], fd: int | None) -> Iterator[tuple[bytes | _Range, int]]:
    """The file's chunks in order: (bytes, or for a tensor range of a local file (`fd`) the range to read, itemsize)."""
    with open_read(f.uri) as handle:
        for seg in segments(f.size, ranges):
            if not seg.by_content and fd is not None:
                yield _Range(fd, f.uri, seg.offset, seg.length), seg.itemsize
                continue
            handle.seek(seg.offset)
            if not seg.by_content:
                data = handle.read(seg.length)
                if len(data) != seg.length:
                    raise CkptError(f"archive: {f.uri} changed while it was archived (shorter than listed); "
                                    "archive a checkpoint that is complete", uri=f.uri)
                yield data, seg.itemsize
                continue
            left, carry = seg.length, b""
            while left or carry:
                block = handle.read(min(BLOCK, left)) if left else b""
                left -= len(block)
                if left and not block:
                    raise CkptError(f"archive: {f.uri} changed while it was archived (shorter than listed); "
                                    "archive a checkpoint that is complete", uri=f.uri)
                buf = carry + block
                start = 0
                for end in cdc_cuts(buf, final=not left):
                    yield buf[start:end], 1
                    start = end
                carry = buf[start:]
                if not left:
                    break


class _Writer:
    """Hashes and compresses chunks on worker threads; stores those the store does not hold yet."""

    def __init__(self, store: Store, known: set[str]) -> None:
        self.store, self.known, self.lock = store, known, threading.Lock()
        self.stored: dict[str, int] = {}  # chunk -> stored length, for the chunks seen in this archive
        self.new_bytes = self.new_stored = self.new_chunks = 0

    def chunk(self, piece: bytes | _Range, itemsize: int) -> list[Any]:
        data = piece.read() if isinstance(piece, _Range) else piece
        digest = HASHES[BLAKE3](data)
        with self.lock:
            if digest in self.stored or digest in self.known:
                claimed = False
            else:
                self.known.add(digest)
                claimed = True
        if claimed:
            encoded = codec.encode_parts(data, itemsize)
            self.store.put(chunk_key(digest), encoded)
            size = sum(len(part) for part in encoded)
            with self.lock:
                self.stored[digest] = size
                self.new_bytes += len(data)
                self.new_stored += size
                self.new_chunks += 1
        return [digest, len(data)]


def archive(source: str, store: str, archive_id: str | None = None, stale_s: float = STALE_S) -> ArchiveResult:
    """Archives the checkpoint at `source` (folder or file, local or fsspec) into the store at `store`; the id
    defaults to a hash of the content (archiving the same bytes again gives the same id and stores nothing)."""
    began = time.monotonic()
    if archive_id is not None:
        check_id(archive_id)
    st = Store(store)
    files, single = list_files(source)
    ranges = _index(source, files)
    marker = put_marker(st, PENDING, source)
    try:
        wait_for_gc(st, stale_s)
        known = {key.rsplit("/", 1)[-1] for key in st.listing(CHUNKS)}
        writer = _Writer(st, known)
        entries: list[dict[str, Any]] = []
        with ThreadPoolExecutor(WORKERS) as pool:
            for f in files:
                chunks: list[list[Any]] = []
                fd = _open_local(f)
                try:
                    with InFlight[list[Any]](pool, IN_FLIGHT) as flight:
                        for piece, itemsize in _pieces(f, ranges.get(f.name, []), fd):
                            chunks.extend(flight.submit(writer.chunk, piece, itemsize))
                            del piece
                        chunks.extend(flight.drain())
                finally:
                    if fd is not None:
                        os.close(fd)
                entries.append({"name": f.name, "size": f.size, "mode": f.mode, "chunks": chunks})
        sizes = _stored_sizes(st, writer, {c[0] for e in entries for c in e["chunks"]})
        for entry in entries:
            entry["chunks"] = [[d, n, sizes[d]] for d, n in entry["chunks"]]
        unique = {c[0]: c for e in entries for c in e["chunks"]}
        body = [[e["name"], e["size"], e["mode"], [c[0] for c in e["chunks"]]] for e in entries]
        archive_id = archive_id or hashlib.sha256(json.dumps(body).encode()).hexdigest()[:24]
        _check_free(st, archive_id, entries)
        doc = {"format": FORMAT, "hash": BLAKE3, "id": archive_id, "source": source, "single_file": single,
               "created": time.time(),
               "files": entries, "logical_bytes": sum(f.size for f in files),
               "unique_bytes": sum(c[1] for c in unique.values()),
               "stored_bytes": sum(c[2] for c in unique.values()),
               "new_bytes": writer.new_bytes, "new_stored_bytes": writer.new_stored}
        st.put(manifest_key(archive_id), json.dumps(doc, indent=1).encode())
    finally:
        st.delete(marker)
    return ArchiveResult(archive_id, st.uri, len(files), sum(len(e["chunks"]) for e in entries), writer.new_chunks,
                         doc["logical_bytes"], doc["unique_bytes"], doc["stored_bytes"], writer.new_bytes,
                         writer.new_stored, time.monotonic() - began)


def _open_local(f: SourceFile) -> int | None:
    """A descriptor of a local source file (its tensor ranges are then read by the workers), else None."""
    if not is_local(f.uri):
        return None
    try:
        return os.open(local_path(f.uri), os.O_RDONLY)
    except OSError as e:
        raise CkptError(f"archive: cannot read {f.uri}: {e.strerror or e}; check the checkpoint's files",
                        uri=f.uri) from None


def _check_free(store: Store, archive_id: str, entries: list[dict[str, Any]]) -> None:
    """Refuses an id the store holds for other content (archiving the same content again is a no-op)."""
    raw = store.get(manifest_key(archive_id))
    if raw is None:
        return
    old = parse(raw, store.where(manifest_key(archive_id)))["files"]
    if [[f["name"], f["mode"], [c[0] for c in f["chunks"]]] for f in old] != [
            [e["name"], e["mode"], [c[0] for c in e["chunks"]]] for e in entries]:
        raise OptionError(f"archive id {archive_id} is taken in store {store.uri} by another checkpoint; "
                          "choose another id", option="archive_id")


def _stored_sizes(store: Store, writer: _Writer, digests: set[str]) -> dict[str, int]:
    """Each chunk's stored length: written now, or as recorded by the manifests that reference it (read
    from the chunk itself when none does)."""
    sizes = dict(writer.stored)
    missing = digests - sizes.keys()
    if missing:
        from .manifest import ids, read

        for other in ids(store):
            for f in read(store, other)["files"]:
                for digest, _, stored in f["chunks"]:
                    if digest in missing:
                        sizes[digest] = stored
            missing = digests - sizes.keys()
            if not missing:
                break
        for digest in missing:
            data = store.get(chunk_key(digest))
            sizes[digest] = len(data) if data is not None else 0
    return sizes
