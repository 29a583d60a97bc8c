"""Parallel multipart uploads to S3 with bounded memory.

`MultipartWriter` takes sequential writes, cuts them into parts of `UPLOAD_BLOCK` bytes and uploads up to
K parts at once on fsspec's I/O loop (s3fs's own `_call_s3`, so retries, credentials and error mapping are
s3fs's). K is a semaphore shared by every file of one output (`Slots`): a writer that would put a part
over K blocks until one lands, so an output holds at most K parts in flight plus the part each open file
is filling, (K + files) x part size: a part goes out as it is (`Part`), not copied. A file smaller than
`MIN_PART` is a single PUT; a larger one opens its multipart upload once that much is written, while its
first part still fills (so the part goes out as soon as it is full).

Nothing is half-written: the object appears only when `complete_multipart_upload` succeeds. `discard`
(on any failure, KeyboardInterrupt included) waits, bounded, for the requests already handed to the loop
(a `create_multipart_upload` in flight lands after an interrupt) and then aborts the upload, so no
multipart upload is left open.
"""

from __future__ import annotations

import base64
import contextlib
import io
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any

from .checksum import crc32, crc32_combine

UPLOAD_BLOCK = 16 * 1024 * 1024  # part size; S3 needs >= 5 MiB for every part but the last
MIN_PART = 5 * 1024 * 1024  # a file this large is uploaded in parts (even one part): S3's smallest part
GROW_EVERY = 1000  # parts: the part size grows by UPLOAD_BLOCK every 1000 parts (S3 allows 10,000)
SETTLE_S = 60.0  # bound on waiting for requests in flight before aborting


def parallel() -> int:
    """Parts in flight per output: the engine config's `upload_parallel` (CKPT_UPLOAD_PARALLEL), default 4."""
    from .config import current

    return current().upload_parallel


def supports(fs: Any) -> bool:
    """Whether `fs` is an s3fs filesystem (others keep fsspec's own buffered writer)."""
    return callable(getattr(fs, "_call_s3", None)) and callable(getattr(fs, "split_path", None))


class Slots:
    """At most `count` parts in flight, shared by the writers of one output; counts the most seen at once."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._free = threading.Semaphore(count)
        self._lock = threading.Lock()
        self.busy = 0
        self.peak = 0

    def take(self) -> None:
        self._free.acquire()
        with self._lock:
            self.busy += 1
            self.peak = max(self.peak, self.busy)

    def give(self, _: object = None) -> None:
        with self._lock:
            self.busy -= 1
        self._free.release()


def part_size(number: int, block: int = UPLOAD_BLOCK) -> int:
    """Size of part `number` (1-based): `block`, growing by `block` every GROW_EVERY parts."""
    return block * (1 + (number - 1) // GROW_EVERY)


class Part(io.BytesIO):
    """A part's bytes as the request body. botocore turns a `bytes` body into a BytesIO that shares it, and
    aiohttp then takes a view of that buffer, which makes BytesIO copy it first: a body that is a BytesIO
    of its own goes out without that copy (and its 16 MiB allocation). Every attempt must send it whole:
    botocore rewinds it for its own retries; `_rewind` does for each call (s3fs retries a request by
    calling again with the same body); aiohttp closes a body once sent, which leaves this one open."""

    def close(self) -> None:
        self.seek(0)


def _rewind(params: dict[str, Any], **_: Any) -> None:
    body = params.get("Body")
    if isinstance(body, Part):
        body.seek(0)


def _crc32_param(crc: int) -> str:
    """A CRC-32 as S3's `ChecksumCRC32`: base64 of its 4 big-endian bytes."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def _crc32(body: Part) -> int:
    """The part's CRC-32, computed here at memory bandwidth (`checksum.crc32`): sent with the part, botocore
    computes none of its own (with zlib's, about 5x slower here; the same request otherwise), and S3 checks
    the part against it; combined, the parts' give the file's (`MultipartWriter.crc`)."""
    with body.getbuffer() as view:
        return crc32(view)


async def _send_part(fs: Any, method: str, checksum: str, **kwargs: Any) -> Any:
    """`fs._call_s3(method, **kwargs)` with the body's `checksum` (`_crc32_param`), a `Part` body rewound before
    every attempt. A client that sends checksums only where S3 requires them (botocore's setting
    `request_checksum_calculation="when_required"`, or AWS_REQUEST_CHECKSUM_CALCULATION, for S3-compatible
    stores that refuse the headers) sends none of ours either."""
    await fs.set_session()
    fs.s3.meta.events.register_first(f"before-parameter-build.s3.{_OPERATIONS[method]}", _rewind,
                                     unique_id=f"ckpt-rewind-{method}")
    if getattr(fs.s3.meta.config, "request_checksum_calculation", None) != "when_required":
        kwargs.update(ChecksumAlgorithm="CRC32", ChecksumCRC32=checksum)
    return await fs._call_s3(method, **kwargs)


_OPERATIONS = {"upload_part": "UploadPart", "put_object": "PutObject"}


class MultipartWriter:
    """A write-only stream that becomes one S3 object: one PUT, or a multipart upload K parts at a time."""

    def __init__(self, fs: Any, path: str, slots: Slots, block: int | None = None) -> None:
        self.fs = fs
        self.bucket, self.key, _ = fs.split_path(path)
        self.slots = slots
        self.block = block or UPLOAD_BLOCK
        self.buf = Part()  # the part being filled: it grows as it fills, so small files stay small
        self.create: Future[str] | None = None
        self.put: Future[Any] | None = None  # the single PUT of a small file
        self.upload_id: str | None = None  # set in the loop's thread once the multipart upload exists
        self.discarded = False
        self.parts: list[Future[dict[str, Any]]] = []
        self.closed = False
        self.size = 0  # bytes written
        self.crc = 0  # CRC-32 of the parts sent, once closed: of the whole file

    def _submit(self, coro: Coroutine[Any, Any, Any]) -> Future[Any]:
        import asyncio  # here: a local output never needs the event loop's module

        return asyncio.run_coroutine_threadsafe(coro, self.fs.loop)

    def tell(self) -> int:
        return self.size

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        total = len(view)
        self.size += total
        while view:
            room = part_size(len(self.parts) + 1, self.block) - self.buf.tell()
            self.buf.write(view[:room])
            if len(view) < room:  # the part is not full yet
                if self.buf.tell() >= MIN_PART:
                    self._open()  # a multipart upload: opened while its first part fills
                break
            view = view[room:]
            self._send()
        return total

    def _take(self) -> tuple[Part, str]:
        """The filled part, handed over as it is (a new buffer takes its place), and its `ChecksumCRC32`."""
        body, self.buf = self.buf, Part()
        length = body.tell()
        body.seek(0)
        crc = _crc32(body)
        self.crc = crc32_combine(self.crc, crc, length)
        return body, _crc32_param(crc)

    def _send(self) -> None:
        """Hand the filled part to the loop as the next part (blocking while K parts are in flight)."""
        self._raise_failed()
        self._open()
        number = len(self.parts) + 1
        self.slots.take()
        body, checksum = self._take()
        try:
            future = self._submit(self._part(number, body, checksum))
        except BaseException:
            self.slots.give()
            raise
        future.add_done_callback(self.slots.give)
        self.parts.append(future)

    def _open(self) -> None:
        """Start opening the multipart upload, unless that has begun."""
        if self.create is None:
            self.create = self._submit(self._create())

    def _raise_failed(self) -> None:
        for future in [self.create, *self.parts]:
            error = future.exception() if future is not None and future.done() else None
            if error is not None:
                raise error

    async def _create(self) -> str:
        """Start the multipart upload (in the loop's thread, which Ctrl-C never interrupts). An interrupt can
        come while the main thread hands this over, losing the future: so the coroutine itself aborts an
        upload it opens after `discard` ran."""
        if self.discarded:
            raise RuntimeError(f"{self.key}: upload discarded")
        reply = await self.fs._call_s3("create_multipart_upload", Bucket=self.bucket, Key=self.key)
        self.upload_id = str(reply["UploadId"])
        if self.discarded:
            await self._abort()
        return self.upload_id

    async def _abort(self) -> None:
        with contextlib.suppress(Exception):
            await self.fs._call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.key,
                                   UploadId=self.upload_id)

    async def _part(self, number: int, body: Part, checksum: str) -> dict[str, Any]:
        assert self.create is not None
        import asyncio

        upload_id = await asyncio.wrap_future(self.create)
        if self.discarded:  # the upload is being aborted: sending the part would only fail (and be retried)
            raise RuntimeError(f"{self.key}: upload discarded")
        reply = await _send_part(self.fs, "upload_part", checksum, Bucket=self.bucket, Key=self.key,
                                 UploadId=upload_id, PartNumber=number, Body=body)
        return {"PartNumber": number, "ETag": reply["ETag"]}

    def close(self) -> None:
        """Finish the object: one PUT for a file smaller than a part, else the last part and the completion."""
        if self.closed:
            return
        if self.create is None:
            body, checksum = self._take()
            self.put = self._submit(_send_part(self.fs, "put_object", checksum, Bucket=self.bucket, Key=self.key,
                                               Body=body))
            self.put.result()
        else:
            if self.buf.tell():
                self._send()
            parts = [future.result() for future in self.parts]
            upload_id = self.create.result()
            self._submit(self.fs._call_s3("complete_multipart_upload", Bucket=self.bucket, Key=self.key,
                                          UploadId=upload_id, MultipartUpload={"Parts": parts})).result()
        self.closed = True
        self.buf = Part()
        self.fs.invalidate_cache(f"{self.bucket}/{self.key}")

    def discard(self, settle: float = SETTLE_S) -> None:
        """Give up: wait (at most `settle` seconds) for the requests in flight, then abort the upload. (A
        single PUT that lands is an object like any other: the output removes what it uploaded.)"""
        self.discarded = True  # first: a create still in flight sees it and aborts what it opens (`_create`)
        self.closed = True
        self.buf = Part()
        pending = [f for f in [self.put, self.create, *self.parts] if f is not None]
        wait_futures(pending, timeout=settle)
        if self.upload_id is not None:
            with contextlib.suppress(Exception):
                self._submit(self._abort()).result(timeout=settle)
