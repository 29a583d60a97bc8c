"""Reading byte ranges of checkpoint files: `RangeReader`.

Reads are explicit byte ranges (`os.pread` on local files, ranged `cat_file` elsewhere); no file is mmapped
or read whole. Each range is checked against the file's real size before any buffer is allocated. Remote
reads go through an LRU of aligned blocks (small reads), prefetched spans (a DCP record's header with its
tensor's first bytes) and, for large ranges, several requests side by side. The reader's thread pools are
`ContextPool`s: a read in them runs under the engine config of the call that queued it (its read roots
confine it as they would in the calling thread).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from .config import ContextPool
from .confinement import open_file
from .errors import FormatError, SourceError
from .files import size
from .remote import filesystem, translate_errors
from .uris import is_local, local_path

#: Remote reads smaller than this fetch the whole aligned block (cached), so many small header reads
#: cost few requests; larger reads fetch their own range, taking the ends that cached blocks hold from them.
MIN_REQUEST = 256 * 1024
#: Larger remote reads are split into about this many bytes per request, fetched `REMOTE_PARALLEL` at a time
#: (one pool per reader, shared by its threads), straight into the caller's buffer.
READ_CHUNK = 8 * 1024 * 1024
REMOTE_PARALLEL = 4
#: Index reads of many small remote pieces (a DCP record's header each) run this many at a time: each waits
#: on a round trip, not on the CPU.
INDEX_PARALLEL = 16
_CACHE_BLOCKS = 256  # 64 MiB at most
#: Bytes fetched ahead with a record's header (`RangeReader.prefetch`) and not yet read, at most.
_SPAN_BYTES = 128 * 1024 * 1024

_R = TypeVar("_R")
_T = TypeVar("_T")


def _gather(futures: list[Future[_T]]) -> list[_T]:
    """The futures' results in order; the first failure in order is raised. Either way, none is still running
    when this returns (never leave a request writing into a buffer the caller has given up on)."""
    try:
        return [future.result() for future in futures]
    finally:
        for future in futures:
            future.cancel()
        for future in futures:
            if not future.cancelled():
                future.exception()


@dataclass
class _Group:
    """The records of a prefetched group (`RangeReader.prefetch`): how many, and which were read."""

    count: int
    read: dict[int, int] = field(default_factory=dict)  # record -> bytes of its tensor read
    done: set[int] = field(default_factory=set)  # records read whole


@dataclass
class _Span:
    data: bytes
    group: int
    state: _Group


class RangeReader:
    """Reads byte ranges of files, keeping one descriptor per local file; safe across threads."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._blocks: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._done: dict[Hashable, Any] = {}  # `once` results
        self._pending: dict[Hashable, Future[Any]] = {}  # blocks being fetched, `once` values being computed
        self._spans: OrderedDict[tuple[str, int], _Span] = OrderedDict()  # prefetched, not yet read
        self._span_bytes = 0
        self._sizes: dict[str, int] = {}
        self._pool: ContextPool | None = None  # remote range requests in flight (lazily started)
        self._side_pool: ContextPool | None = None  # `map` calls (lazily started)
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

    def file_size(self, uri: str) -> int:
        """The real size of a file being read (local: of the open descriptor), cached."""
        known = self._sizes.get(uri)
        if known is None:
            known = os.fstat(self.fd(local_path(uri))).st_size if is_local(uri) else size(uri)
            self._sizes[uri] = known
        return known

    def check_range(self, uri: str, offset: int, length: int) -> None:
        """Refuse a range that is negative or reaches past the end of the file, before allocating for it."""
        if offset < 0 or length < 0:
            raise FormatError(f"{uri}: the checkpoint metadata names bytes {offset}..{offset + length}, a negative "
                              "position or length; the metadata is damaged", uri=uri)
        if offset + length > self.file_size(uri):
            raise SourceError(f"{uri}: file is shorter than the checkpoint metadata says (wanted bytes "
                              f"{offset}..{offset + length}); it is truncated or damaged: re-copy or re-upload it",
                              uri=uri)

    def read(self, uri: str, offset: int, length: int) -> bytes:
        self.check_range(uri, offset, length)
        if length == 0:
            return b""
        if is_local(uri):
            try:
                data = os.pread(self.fd(local_path(uri)), length, offset)
            except OSError as exc:
                raise SourceError(f"{uri}: cannot read ({exc.strerror or exc})", uri=uri) from None
        else:
            data = self._remote(uri, offset, length)
        if len(data) != length:
            raise SourceError(f"{uri}: file is shorter than the checkpoint metadata says (wanted bytes "
                              f"{offset}..{offset + length}); it is truncated: re-copy or re-upload it", uri=uri)
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
        """Ranged read; small reads come from prefetched spans or an LRU of aligned `MIN_REQUEST` blocks."""
        if length >= MIN_REQUEST:
            out = bytearray(length)
            self._remote_into(uri, offset, memoryview(out))
            return bytes(out)
        with self._lock:
            self.requested += length
        out = bytearray()
        while len(out) < length:
            at = offset + len(out)
            piece = self._span_piece(uri, at, length - len(out))
            if not piece:
                block = at // MIN_REQUEST
                lo = at - block * MIN_REQUEST
                piece = memoryview(self._block(uri, block))[lo: lo + length - len(out)]
                if not piece:
                    break
            out += piece
        return bytes(out)

    def once(self, key: Hashable, compute: Callable[[], _T]) -> _T:
        """`compute()` once per `key` for this reader, kept; threads that want a key being computed wait for
        that computation instead of starting their own. A failure is raised to every waiter and not kept."""
        return self._once(self._done, key, compute)

    def _once(self, store: dict[Any, Any], key: Hashable, compute: Callable[[], _T]) -> _T:
        with self._lock:
            if key in store:
                if isinstance(store, OrderedDict):
                    store.move_to_end(key)
                return store[key]
            pending = self._pending.get(key)
            mine = pending is None
            if pending is None:
                pending = self._pending[key] = Future()
        if not mine:
            return pending.result()
        try:
            value = compute()
        except BaseException as exc:
            with self._lock:
                del self._pending[key]
            pending.set_exception(exc)
            raise
        with self._lock:
            del self._pending[key]
            store[key] = value
            while store is self._blocks and len(self._blocks) > _CACHE_BLOCKS:
                self._blocks.popitem(last=False)
        pending.set_result(value)
        return value

    def _block(self, uri: str, block: int) -> bytes:
        """One aligned `MIN_REQUEST` block, from the cache or fetched; threads that want a block being fetched
        wait for that request instead of sending their own (index reads run side by side, `map`)."""
        return self._once(self._blocks, (uri, block),
                          lambda: self._fetch(uri, block * MIN_REQUEST, (block + 1) * MIN_REQUEST))

    def prefetch(self, uri: str, ranges: list[tuple[int, int]], group: int, count: int) -> None:
        """Fetch remote (offset, length) ranges side by side, each in one request, and keep them for the reads
        that follow: the `count` DCP records of a group (those lying back to back at `group`), each record's
        header with its tensor's first bytes, so that locating a tensor and reading it cost one request, not
        two, and neighbouring small records none of their own. The spans are dropped once every record of
        the group was `release`d or, oldest first, beyond `_SPAN_BYTES`."""
        state = _Group(count)

        def fetch(offset: int, length: int) -> None:
            self.check_range(uri, offset, length)
            data = self._fetch(uri, offset, offset + length)
            with self._lock:
                self._spans[(uri, offset)] = _Span(data, group, state)
                self._span_bytes += len(data)
                while self._span_bytes > _SPAN_BYTES:
                    self._span_bytes -= len(self._spans.popitem(last=False)[1].data)

        self._run([partial(fetch, offset, length) for offset, length in ranges])

    def release(self, uri: str, group: int, record: int, nbytes: int, total: int) -> None:
        """`nbytes` of the `total` bytes of record `record` of the group at `group` have been read: once all of
        every record of the group are, the group's spans go (and a span fetched for that record alone)."""
        with self._lock:
            for key in [k for k, span in self._spans.items() if k[0] == uri and span.group in (group, record)]:
                span = self._spans[key]
                read = span.state.read[record] = span.state.read.get(record, 0) + nbytes
                if read >= total:
                    span.state.done.add(record)
                if len(span.state.done) >= span.state.count:
                    self._span_bytes -= len(self._spans.pop(key).data)

    def _span_piece(self, uri: str, at: int, length: int) -> memoryview:
        """Up to `length` bytes from `at` that a prefetched span holds (empty when none does), not copied."""
        with self._lock:
            start, data = self._span_at(uri, at)
            return data[at - start: at - start + length]

    def _span_at(self, uri: str, at: int) -> tuple[int, memoryview]:
        """(start, a view of the bytes) of a prefetched span of `uri` that holds byte `at`, or (at, an empty
        view); the lock is held. Views, so that taking a piece of a span copies nothing."""
        for (span_uri, start), span in self._spans.items():
            if span_uri == uri and start <= at < start + len(span.data):
                return start, memoryview(span.data)
        return at, memoryview(b"")

    def _remote_into(self, uri: str, offset: int, view: memoryview) -> None:
        """Fill `view` with a large remote range (see `_fetches`)."""
        self._run(self._fetches(uri, offset, view))

    def _fetches(self, uri: str, offset: int, view: memoryview) -> list[Callable[[], None]]:
        """The requests that fill `view` with a large remote range, `READ_CHUNK` bytes or so each, every one
        copying its bytes into place as they arrive; the ends that blocks cached for small reads hold are
        copied at once."""
        length = len(view)
        with self._lock:
            self.requested += length
        start, end = self._from_cache(uri, offset, view)
        if start == end:
            return []
        count = -(-(end - start) // READ_CHUNK)
        step = -(-(end - start) // count)

        def fetch(lo: int) -> None:
            hi = min(lo + step, end)
            data = self._fetch(uri, offset + lo, offset + hi)
            if len(data) != hi - lo:
                raise SourceError(f"{uri}: file is shorter than the checkpoint metadata says (wanted bytes "
                                  f"{offset}..{offset + length}); it is truncated: re-copy or re-upload it", uri=uri)
            view[lo:hi] = data

        return [partial(fetch, lo) for lo in range(start, end, step)]

    def _run(self, fetches: list[Callable[[], None]]) -> None:
        """Run requests `REMOTE_PARALLEL` at a time (one pool per reader, shared by its threads); one runs
        in the calling thread. Returns when every request has finished, failed or not."""
        if len(fetches) <= 1:
            for fetch in fetches:
                fetch()
            return
        with self._lock:
            if self._pool is None:
                self._pool = ContextPool(REMOTE_PARALLEL, thread_name_prefix="ckpt-fetch")
            pool = self._pool
        _gather([pool.submit(fetch) for fetch in fetches])

    def map(self, fn: Callable[[_T], _R], items: Sequence[_T], remote: bool = True) -> list[_R]:
        """`[fn(item) for item in items]`, with up to `INDEX_PARALLEL` calls side by side when their reads are
        `remote` (each is mostly a round trip), in this reader's own pool (apart from the range requests' pool,
        which `fn` may use); results in order, and the first failure in order is raised."""
        if not remote or len(items) < 2:
            return [fn(item) for item in items]
        with self._lock:
            if self._side_pool is None:
                self._side_pool = ContextPool(INDEX_PARALLEL, thread_name_prefix="ckpt-index")
            pool = self._side_pool
        return _gather([pool.submit(fn, item) for item in items])

    def readinto_many(self, reads: list[tuple[str, int, memoryview]]) -> None:
        """`readinto` for several (uri, offset, view) at once: the large remote ones are fetched side by side
        (a tensor's chunks in several rank files), the others one after another."""
        fetches: list[Callable[[], None]] = []
        for uri, offset, view in reads:
            if is_local(uri) or len(view) < MIN_REQUEST:
                self.readinto(uri, offset, view)
            else:
                self.check_range(uri, offset, len(view))
                fetches += self._fetches(uri, offset, view)
        self._run(fetches)

    def _from_cache(self, uri: str, offset: int, view: memoryview) -> tuple[int, int]:
        """Copy the ends of `view` that prefetched spans and blocks already fetched for small reads hold (a
        record's header and the zip directory after it share blocks or spans with its data), so no byte is
        fetched twice; returns the part of `view` still to fetch, as [start, end) offsets into it."""
        start, end = 0, len(view)
        while start < end and (piece := self._span_piece(uri, offset + start, end - start)):
            view[start: start + len(piece)] = piece
            start += len(piece)
        with self._lock:
            at, held = self._span_at(uri, offset + end - 1) if start < end else (0, memoryview(b""))
            if held:  # a span holding the view's last bytes
                lo = max(offset + start, at)
                view[lo - offset: end] = held[lo - at: offset + end - at]
                end = lo - offset
            while start < end:
                block = (offset + start) // MIN_REQUEST
                data = self._blocks.get((uri, block))
                lo = offset + start - block * MIN_REQUEST
                piece = memoryview(data)[lo: lo + end - start] if data is not None else memoryview(b"")
                if not piece:
                    break
                view[start: start + len(piece)] = piece
                start += len(piece)
            while start < end:
                block = (offset + end - 1) // MIN_REQUEST
                data = self._blocks.get((uri, block))
                lo = max(offset + start, block * MIN_REQUEST)
                if data is None or len(data) < offset + end - block * MIN_REQUEST:
                    break
                view[lo - offset: end] = memoryview(data)[lo - block * MIN_REQUEST: offset + end - block * MIN_REQUEST]
                end = lo - offset
        return start, end

    def fetch_note(self) -> list[str]:
        """A report line on remote traffic, when there was any."""
        if not self.fetched:
            return []
        return [f"fetched {self.fetched} bytes in {self.requests} requests for {self.requested} bytes needed "
                "from remote storage"]

    def readinto(self, uri: str, offset: int, view: memoryview) -> None:
        length = len(view)
        self.check_range(uri, offset, length)
        if length == 0:
            return
        if is_local(uri):
            fd = self.fd(local_path(uri))
            try:
                got = os.preadv(fd, [view], offset)
                while got < length:
                    more = os.preadv(fd, [view[got:]], offset + got)
                    if more == 0:
                        raise SourceError(f"{uri}: file is shorter than the checkpoint metadata says (wanted "
                                          f"bytes {offset}..{offset + length}); it is truncated: re-copy it", uri=uri)
                    got += more
            except OSError as exc:
                raise SourceError(f"{uri}: cannot read ({exc.strerror or exc})", uri=uri) from None
        elif length >= MIN_REQUEST:
            self._remote_into(uri, offset, view)
        else:
            view[:] = self.read(uri, offset, length)

    def _open(self, path: str) -> int:
        return open_file(path, "data file is missing; the checkpoint is incomplete (re-copy or re-upload it)")

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            self._sizes.clear()
            pools = [self._pool, self._side_pool]
            self._pool = self._side_pool = None
            self._spans.clear()
            self._span_bytes = 0
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
