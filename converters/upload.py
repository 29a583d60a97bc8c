"""Parallel multipart uploads to S3 with bounded memory.

`MultipartWriter` takes sequential writes, cuts them into parts of `UPLOAD_BLOCK` bytes and uploads up to
K parts at once on fsspec's I/O loop (s3fs's own `_call_s3`, so retries, credentials and error mapping are
s3fs's). K is a semaphore shared by every file of one output (`Slots`): a writer that would put a part
over K blocks until one lands, so an output holds at most K parts in flight plus the part each open file
is filling, (K + files) x part size (and, while a part is sent, the copy botocore makes of it). A file
smaller than one part is a single PUT.

Nothing is half-written: the object appears only when `complete_multipart_upload` succeeds. `discard`
(on any failure, KeyboardInterrupt included) waits, bounded, for the requests already handed to the loop
(a `create_multipart_upload` in flight lands after an interrupt) and then aborts the upload, so no
multipart upload is left open.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine, Generator, Iterable, Sequence
from concurrent.futures import Executor, Future
from concurrent.futures import wait as wait_futures
from typing import Any

UPLOAD_BLOCK = 16 * 1024 * 1024  # part size; S3 needs >= 5 MiB for every part but the last
PARALLEL_ENV = "CKPT_UPLOAD_PARALLEL"
DEFAULT_PARALLEL = 4  # the copier's default thread count
GROW_EVERY = 1000  # parts: the part size grows by UPLOAD_BLOCK every 1000 parts (S3 allows 10,000)
FIRST_BUFFER = 1024 * 1024
SETTLE_S = 60.0  # bound on waiting for requests in flight before aborting


def parallel() -> int:
    """Parts in flight per output: CKPT_UPLOAD_PARALLEL, default 4."""
    from .env import positive_int

    return positive_int(PARALLEL_ENV, DEFAULT_PARALLEL, "parts")


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


class MultipartWriter:
    """A write-only stream that becomes one S3 object: one PUT, or a multipart upload K parts at a time."""

    def __init__(self, fs: Any, path: str, slots: Slots, block: int | None = None) -> None:
        self.fs = fs
        self.bucket, self.key, _ = fs.split_path(path)
        self.slots = slots
        self.block = block or UPLOAD_BLOCK
        self.buf = bytearray(min(FIRST_BUFFER, self.block))  # grows to a part: small files stay small
        self.fill = 0
        self.create: Future[str] | None = None
        self.put: Future[Any] | None = None  # the single PUT of a small file
        self.upload_id: str | None = None  # set in the loop's thread once the multipart upload exists
        self.discarded = False
        self.parts: list[Future[dict[str, Any]]] = []
        self.closed = False

    def _submit(self, coro: Coroutine[Any, Any, Any]) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.fs.loop)

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        total = len(view)
        while view:
            limit = part_size(len(self.parts) + 1, self.block)
            if self.fill == len(self.buf):  # double the buffer, up to a part
                grown = bytearray(min(limit, 2 * len(self.buf)))
                grown[: self.fill] = self.buf[: self.fill]
                self.buf = grown
            n = min(len(view), len(self.buf) - self.fill)
            self.buf[self.fill: self.fill + n] = view[:n]
            self.fill += n
            view = view[n:]
            if self.fill == limit:
                self._send()
        return total

    def _send(self) -> None:
        """Hand the buffer's bytes to the loop as the next part (blocking while K parts are in flight). The
        part goes as `bytes` (botocore copies a bytearray body up to three times); the buffer is reused."""
        self._raise_failed()
        if self.create is None:
            self.create = self._submit(self._create())
        number = len(self.parts) + 1
        self.slots.take()
        try:
            body = bytes(memoryview(self.buf)[: self.fill])
            future = self._submit(self._part(number, body))
        except BaseException:
            self.slots.give()
            raise
        future.add_done_callback(self.slots.give)
        self.parts.append(future)
        self.fill = 0
        limit = part_size(number + 1, self.block)
        if len(self.buf) < limit:
            self.buf = bytearray(limit)

    def _raise_failed(self) -> None:
        for future in [self.create, *self.parts]:
            if future is not None and future.done() and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]

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

    async def _part(self, number: int, body: bytes) -> dict[str, Any]:
        assert self.create is not None
        upload_id = await asyncio.wrap_future(self.create)
        if self.discarded:  # the upload is being aborted: sending the part would only fail (and be retried)
            raise RuntimeError(f"{self.key}: upload discarded")
        reply = await self.fs._call_s3("upload_part", Bucket=self.bucket, Key=self.key, UploadId=upload_id,
                                       PartNumber=number, Body=body)
        return {"PartNumber": number, "ETag": reply["ETag"]}

    def close(self) -> None:
        """Finish the object: one PUT for a file smaller than a part, else the last part and the completion."""
        if self.closed:
            return
        if self.create is None:
            body = bytes(memoryview(self.buf)[: self.fill])
            self.put = self._submit(self.fs._call_s3("put_object", Bucket=self.bucket, Key=self.key, Body=body))
            self.put.result()
        else:
            if self.fill:
                self._send()
            parts = [future.result() for future in self.parts]
            upload_id = self.create.result()
            self._submit(self.fs._call_s3("complete_multipart_upload", Bucket=self.bucket, Key=self.key,
                                          UploadId=upload_id, MultipartUpload={"Parts": parts})).result()
        self.closed = True
        self.buf = bytearray()
        self.fs.invalidate_cache(f"{self.bucket}/{self.key}")

    def discard(self, settle: float = SETTLE_S) -> None:
        """Give up: wait (at most `settle` seconds) for the requests in flight, then abort the upload. (A
        single PUT that lands is an object like any other: the output removes what it uploaded.)"""
        self.discarded = True  # first: a create still in flight sees it and aborts what it opens (`_create`)
        self.closed = True
        self.buf = bytearray()
        pending = [f for f in [self.put, self.create, *self.parts] if f is not None]
        wait_futures(pending, timeout=settle)
        if self.upload_id is not None:
            with contextlib.suppress(Exception):
                self._submit(self._abort()).result(timeout=settle)


_EMPTY = object()
_END = object()


class _Handoff:
    """One block passed from a producer thread to the consumer; the producer waits until the consumer is done
    with it (the block lives in the producer's reusable buffer)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.item: Any = _EMPTY

    def put(self, item: Any, stop: threading.Event) -> bool:
        """Hand over `item`; wait until it was taken and used. False when the consumer gave up."""
        with self.cond:
            self.item = item
            self.cond.notify_all()
            while self.item is not _EMPTY and not stop.is_set():
                self.cond.wait()
        return not stop.is_set()

    def get(self) -> Any:
        with self.cond:
            while self.item is _EMPTY:
                self.cond.wait()
            return self.item

    def done(self) -> None:
        with self.cond:
            self.item = _EMPTY
            self.cond.notify_all()


def read_ahead(pool: Executor, streams: Sequence[Callable[[], Iterable[memoryview]]], depth: int
               ) -> Generator[memoryview, None, None]:
    """The blocks of every stream in `streams`, in order, with up to `depth` streams reading ahead in `pool`'s
    threads (a remote source is read while the blocks before are uploaded). A producer hands over one block
    at a time and waits until the consumer has used it, so memory is `depth` blocks (the copier's budget for
    `depth` threads). Producers stop when the consumer stops; an error in one is raised in order."""
    stop = threading.Event()
    handoffs = [_Handoff() for _ in streams]
    running: dict[int, Future[None]] = {}

    def produce(i: int) -> None:
        if stop.is_set():
            return
        try:
            for block in streams[i]():
                if not handoffs[i].put(block, stop):
                    return
            handoffs[i].put(_END, stop)
        except BaseException as exc:  # handed to the consumer, which raises it in order
            handoffs[i].put(exc, stop)

    submitted = 0
    try:
        for i in range(len(streams)):
            while submitted < len(streams) and submitted < i + max(1, depth):
                running[submitted] = pool.submit(produce, submitted)
                submitted += 1
            while True:
                item = handoffs[i].get()
                if item is _END:
                    handoffs[i].done()
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
                handoffs[i].done()
            running.pop(i).result()
    finally:
        stop.set()
        for future in running.values():
            future.cancel()  # not started yet
        for handoff in handoffs:
            with handoff.cond:
                handoff.cond.notify_all()
        wait_futures(list(running.values()))  # no producer touches a buffer after this returns
