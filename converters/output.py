"""Where a conversion writes, so that readers never see half an output.

- Local: everything goes into a temporary sibling, renamed into place at the end.
- Object storage (s3://, memory://, any fsspec URI): a `.ckpt-writing` marker goes up first, then the
  data files (streamed; on S3 a parallel multipart upload for large files, see `upload`), then
  `ckpt-manifest.json` (each file's size and CRC-32) last, then the marker is removed. A prefix with
  the marker and no manifest is incomplete; readers say so. A failed or cancelled run removes what it uploaded.
- A single-file target on object storage is one upload, which S3 completes atomically.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO

from . import storage, upload, writeback
from .checksum import crc32
from .errors import TargetError
from .jsonsafe import dumps_indented
from .names import MANIFEST, WRITING, tmp_prefix
from .upload import UPLOAD_BLOCK


class _Checksummed:
    """A write-only stream that counts bytes and a CRC-32 on the way to the real file."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw
        self.size = 0
        self.crc = 0

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        self.raw.write(view)
        self.crc = crc32(view, self.crc)
        self.size += len(view)
        return len(view)

    def tell(self) -> int:
        return self.size


class Output:
    """A target being written."""

    def __init__(self, uri: str, single_file: bool) -> None:
        self.uri = uri.rstrip("/")
        self.single_file = single_file
        self.local = storage.is_local(uri)
        self.files: dict[str, dict[str, Any]] = {}
        self.about: dict[str, Any] = {}  # more for the manifest: what the output is (`export`: its key mapping)
        self.root = ""  # where files go now: a temp path locally, the final prefix remotely
        # S3 parts in flight, shared by every upload of this output (memory: slots + open files, in parts)
        self.slots = None if self.local else upload.Slots(upload.parallel())

    def path(self, name: str = "") -> str:
        """Local path of an output file (local targets only); '' names the single-file target itself."""
        if self.single_file or not name:
            return self.root
        return os.path.join(self.root, name)

    @contextmanager
    def open(self, name: str = "") -> Iterator[Any]:
        """A sequential writer for file `name` (a plain file locally, a streamed upload remotely)."""
        if self.local:
            if "/" in name:  # a file of a folder inside the output (a framework's layout: model/, optimizer/)
                os.makedirs(os.path.dirname(self.path(name)), exist_ok=True)
            with open(self.path(name), "wb") as fh:
                yield writeback.SteppedFile(fh)
            self.record(name, os.path.getsize(self.path(name)))
            return
        fs, _ = storage.filesystem(self.uri)
        target = self.uri if self.single_file else storage.join(self.uri, name)
        with storage.translate_errors(target, writing=True):
            raw = self._writer(fs, target)
            # a multipart writer computes its parts' CRCs (sent with them) and the file's from those
            stream = raw if isinstance(raw, upload.MultipartWriter) else _Checksummed(raw)
            try:
                yield stream
                raw.close()
            except BaseException:
                # never commit a half-written file: abort the (multipart) upload instead of closing it
                with contextlib.suppress(Exception):
                    raw.discard()
                raw.closed = True  # discarded: closing (or garbage collection) must not upload anything
                raise
        self.record(name, stream.size, stream.crc)

    def _writer(self, fs: Any, target: str) -> Any:
        """S3: a parallel multipart writer sharing this output's part slots; other fsspec backends: fs.open."""
        if self.slots is None or not upload.supports(fs):
            return fs.open(target, "wb", block_size=UPLOAD_BLOCK)
        return upload.MultipartWriter(fs, target, self.slots)

    def record(self, name: str, size: int, crc: int | None = None) -> None:
        self.files[name or storage.basename(self.uri)] = {"bytes": size, **({"crc32": crc} if crc is not None else {})}

    def manifest(self, kind: str) -> bytes:
        doc = {"format": kind, "created_by": "ckpt-service", "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                         time.gmtime()),
               **self.about, "files": {name: info for name, info in sorted(self.files.items())}}
        return dumps_indented(doc).encode()


def remove_tree(path: str | os.PathLike[str], ignore_errors: bool = True) -> None:
    """Remove a folder with its contents, or a file or symlink (a link is removed, never followed).

    A missing path is fine; other failures are ignored unless `ignore_errors` is false."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=ignore_errors)
        return
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except OSError:
        if not ignore_errors:
            raise


def remove_output(uri: str) -> None:
    """Remove a folder or file at `uri`, local or on object storage (a missing one is fine)."""
    if storage.is_local(uri):
        remove_tree(storage.local_path(uri))
    else:
        _remove_remote(uri)


def _remove_remote(uri: str, settle: float = 0.0) -> None:
    """Remove what was uploaded under `uri`. After an interrupt, an upload already handed to fsspec's I/O
    thread may still land: with `settle`, look again for that long and remove late arrivals too."""
    fs, _ = storage.filesystem(uri)
    deadline = time.monotonic() + settle
    while True:
        with contextlib.suppress(Exception):
            fs.invalidate_cache()
            if fs.exists(uri):
                fs.rm(uri, recursive=True)
        if time.monotonic() >= deadline:
            return
        time.sleep(0.25)


@contextmanager
def open_output(uri: str, overwrite: bool, kind: str, single_file: bool = False) -> Iterator[Output]:
    """Yield an `Output`; commit it when the block ends, or remove every trace if it raises."""
    present = storage.check_target(uri, overwrite)
    out = Output(uri, single_file)
    if out.local:
        yield from _local(out, kind)
    else:
        yield from _remote(out, present, kind)


def _local(out: Output, kind: str) -> Iterator[Output]:
    target = os.path.abspath(storage.local_path(out.uri))
    parent = os.path.dirname(target)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as exc:
        raise TargetError(f"{parent}: cannot create the output folder ({exc.strerror})") from None
    out.root = os.path.join(parent, tmp_prefix(os.path.basename(target)) + uuid.uuid4().hex[:8])
    if not out.single_file:
        os.makedirs(out.root)
    try:
        yield out
        if not out.single_file:
            with open(os.path.join(out.root, MANIFEST), "wb") as fh:
                fh.write(out.manifest(kind))
        if os.path.lexists(target):
            remove_tree(target)
        os.replace(out.root, target)
    except OSError as exc:
        remove_tree(out.root)
        if storage.names_source(exc, out.uri):
            raise  # a source file failed: the command names it (storage.io_errors)
        if exc.errno == errno.ENOSPC:
            raise TargetError(f"{target}: disk full while writing; free space or choose another target "
                              "(nothing was left behind)", uri=target) from None
        raise TargetError(f"{target}: cannot write ({exc.strerror or exc})", uri=target) from None
    except BaseException:
        remove_tree(out.root)
        raise


def _remote(out: Output, present: bool, kind: str) -> Iterator[Output]:
    """`present`: something is at the target that may be replaced (`check_target`): it is removed first."""
    fs, _ = storage.filesystem(out.uri)
    out.root = out.uri
    if present:
        _remove_remote(out.uri)
    try:
        if not out.single_file:
            with storage.translate_errors(out.uri, writing=True):
                fs.pipe_file(storage.join(out.uri, WRITING), json.dumps({"started": time.time()}).encode())
        yield out
        if not out.single_file:
            with storage.translate_errors(out.uri, writing=True):
                fs.pipe_file(storage.join(out.uri, MANIFEST), out.manifest(kind))
                fs.rm(storage.join(out.uri, WRITING))
    except BaseException:
        _remove_remote(out.uri, settle=2.0)
        raise
