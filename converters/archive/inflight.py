"""A bounded window of tasks on a thread pool, their results taken in submission order.

Archive reads chunks in workers and restore fetches or writes them in workers; each keeps at most a few in flight
(memory stays flat) and, when the caller stops early (an error), cancels what has not started and waits for what
has, so no worker outlives the file it reads or writes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class InFlight(Generic[T]):
    def __init__(self, pool: ThreadPoolExecutor, limit: int) -> None:
        self.pool, self.limit = pool, limit
        self.queue: deque[Future[T]] = deque()

    def submit(self, fn: Callable[..., T], *args: Any) -> list[T]:
        """Start `fn(*args)`; the results of the oldest tasks, waited for while the window is full."""
        self.queue.append(self.pool.submit(fn, *args))
        return [self.queue.popleft().result() for _ in range(len(self.queue) - self.limit + 1)]

    def drain(self) -> list[T]:
        """The results of every task still in flight (at most the window's), oldest first."""
        return [self.queue.popleft().result() for _ in range(len(self.queue))]

    def __enter__(self) -> InFlight[T]:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for future in self.queue:
            future.cancel()
        for future in self.queue:
            if not future.cancelled():
                future.exception()  # a running task ends before its file closes
        self.queue.clear()
