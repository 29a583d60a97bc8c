"""Read streams ahead of the one consumer that uses them in order, within a budget of bytes.

A remote source written to a remote target (an upload, which takes its bytes in file order) would
otherwise read one tensor at a time between uploads, and a checkpoint of many small tensors would keep a
request or two in flight where the link wants several. `ReadAhead` runs the streams in a pool's threads,
in order, each reading into buffers of its own (not the copier's reused slab), so a thread that has read
a small tensor goes on to the next at once. Memory is bounded by the `Budget`: a stream waits before
taking a new buffer that would carry the buffers in use and kept for reuse past its limit, except the
stream the consumer is waiting for, so the budget never stops the consumer: the most held is the limit
plus one block. Buffers are reused: a fresh one costs its page faults, which here cost more than the copy.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor, Future
from concurrent.futures import wait as wait_futures
from typing import Any

Buffer = Callable[[int], memoryview]  # a block's buffer of n bytes
Stream = Callable[[Buffer], Iterable[memoryview]]  # a stream's blocks, each in a buffer it asked for

_END = object()


class Stopped(Exception):
    """The consumer has gone: a stream stops where it is."""


class Budget:
    """Buffers for bytes read ahead and not yet used: at most `limit` bytes of them, those in use and those
    kept for reuse together (or one buffer, when no other is in use). A buffer of `KEEP` bytes or more is
    kept and reused for any block that fits it and fills at least half of it, so steady reading allocates
    (and faults in) nothing new; smaller ones come from the allocator's heap, cheaply."""

    KEEP = 1 << 20

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0  # bytes of the buffers in use
        self.kept = 0  # bytes of the buffers kept for reuse
        self.peak = 0
        self.free: list[bytearray] = []
        self.cond = threading.Condition()

    def _reuse(self, n: int) -> bytearray | None:
        fits = [buf for buf in self.free if n <= len(buf) <= 2 * n]
        if not fits:
            return None
        buf = min(fits, key=len)
        self.free.remove(buf)
        self.kept -= len(buf)
        return buf

    def take(self, n: int, now: Callable[[], bool]) -> bytearray:
        """A buffer of at least `n` bytes, waiting while a new one would pass the limit, unless `now()` (checked
        under the lock: the consumer waits for this block). Buffers kept for reuse are dropped to make room."""
        with self.cond:
            while (buf := self._reuse(n)) is None:
                while self.free and self.used + self.kept + n > self.limit:
                    self.kept -= len(self.free.pop(self.free.index(max(self.free, key=len))))
                if not self.used or self.used + self.kept + n <= self.limit or now():
                    break
                self.cond.wait()
            self.used += len(buf) if buf is not None else n
            self.peak = max(self.peak, self.used + self.kept)
        return buf if buf is not None else bytearray(n)  # a new buffer is faulted in outside the lock

    def give(self, buffers: list[bytearray]) -> None:
        """Buffers done with: the large ones kept for reuse."""
        if buffers:
            with self.cond:
                for buf in buffers:
                    self.used -= len(buf)
                    if len(buf) >= self.KEEP:
                        self.free.append(buf)
                        self.kept += len(buf)
                self.cond.notify_all()


class ReadAhead:
    """`streams` read ahead in `pool` (started in order, all of them queued at once), their blocks handed to
    the consumer by `blocks(i)`, which it must take in order. Use as a context manager: leaving it stops the
    streams and waits for every thread still in one (a stream's failure is raised when its blocks are)."""

    def __init__(self, pool: Executor, streams: Sequence[Stream], budget: Budget) -> None:
        self.pool = pool
        self.streams = streams
        self.budget = budget
        self.cond = budget.cond  # one lock for the budget and the queues: a wait sees both change
        self.queues: list[deque[tuple[Any, list[bytearray]]]] = [deque() for _ in streams]
        self.head = 0  # the stream the consumer reads now
        self.stopped = False
        self.futures: list[Future[None]] = []

    def __enter__(self) -> ReadAhead:
        self.futures = [self.pool.submit(self._produce, i) for i in range(len(self.streams))]
        return self

    def __exit__(self, *exc: object) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        for future in self.futures:
            future.cancel()  # not started yet
        wait_futures(self.futures)
        for queue in self.queues:  # blocks never used
            for _, buffers in queue:
                self.budget.give(buffers)
            queue.clear()

    def _urgent(self, i: int) -> bool:
        return self.stopped or (self.head == i and not self.queues[i])

    def _produce(self, i: int) -> None:
        taken: list[bytearray] = []  # the buffers of the block being read: given back once it is used

        def buffer(n: int) -> memoryview:
            taken.append(self.budget.take(n, lambda: self._urgent(i)))
            if self.stopped:
                raise Stopped
            return memoryview(taken[-1])[:n]

        item: Any = _END
        try:
            for block in self.streams[i](buffer):
                self._put(i, block, taken[:])
                taken.clear()
                if self.stopped:
                    return
        except Stopped:
            item = None
        except BaseException as exc:  # handed to the consumer, which raises it in order
            item = exc
        self._put(i, item, taken)

    def _put(self, i: int, item: Any, buffers: list[bytearray]) -> None:
        with self.cond:
            self.queues[i].append((item, buffers))
            self.cond.notify_all()

    def blocks(self, i: int) -> Iterator[memoryview]:
        """The blocks of stream `i` (the streams before it must have been read), each valid until the next."""
        with self.cond:
            self.head = i
            self.cond.notify_all()  # a stream waiting for budget may now be the one needed
        while True:
            with self.cond:
                while not self.queues[i]:
                    self.cond.wait()
                item, buffers = self.queues[i].popleft()
            try:
                if item is _END or item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
            finally:
                self.budget.give(buffers)
