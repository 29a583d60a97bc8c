"""Server-sent events for one job: `state` on every state change, `progress` when progress moves,
`end` with the final job document, then the stream closes. Comments keep idle connections alive.

The store is read in a worker thread, so a stream never blocks the event loop. Open streams are
counted per token name and in total (`StreamSlots`); a stream holds its slot until its connection ends.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ckpt_service.service import CkptService
from ckpt_service.service_errors import TooManyStreams

KEEPALIVE_SECONDS = 15.0


def frame(event: str, data: dict[str, Any], event_id: int) -> str:
    return f"id: {event_id}\nevent: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


async def job_events(service: CkptService, job_id: str, poll_seconds: float) -> AsyncIterator[str]:
    yield "retry: 2000\n\n"
    last_state, last_progress, n = None, None, 0
    quiet_since = time.monotonic()
    while True:
        record = await anyio.to_thread.run_sync(service.job, job_id)
        document = record.document()
        if record.state != last_state:
            n += 1
            yield frame("state", document, n)
            last_state, last_progress = record.state, document["progress"]
            quiet_since = time.monotonic()
        elif document["progress"] != last_progress:
            n += 1
            yield frame("progress", {"id": record.id, "state": record.state, "attempt": record.attempt,
                                     "progress": document["progress"]}, n)
            last_progress = document["progress"]
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since > KEEPALIVE_SECONDS:
            yield ": keepalive\n\n"
            quiet_since = time.monotonic()
        if record.terminal:
            yield frame("end", document, n + 1)
            return
        await anyio.sleep(poll_seconds)


class StreamSlots:
    """At most `total` open streams, and at most `per_principal` for one token name."""

    def __init__(self, total: int, per_principal: int) -> None:
        self.total, self.per_principal = total, per_principal
        self._lock = threading.Lock()
        self._open: Counter[str] = Counter()

    def open(self) -> int:
        with self._lock:
            return sum(self._open.values())

    def take(self, who: str) -> Callable[[], None]:
        """Take a slot for `who` (TooManyStreams past a cap); returns the call that gives it back (once)."""
        with self._lock:
            if self._open[who] >= self.per_principal:
                raise TooManyStreams(f"token {who!r} already follows {self._open[who]} event streams (the limit, "
                                     "CKPT_SSE_MAX_STREAMS_PER_PRINCIPAL); close one first")
            if sum(self._open.values()) >= self.total:
                raise TooManyStreams(f"this server already serves {self.total} event streams (the limit, "
                                     "CKPT_SSE_MAX_STREAMS); retry later")
            self._open[who] += 1
        given_back = threading.Event()

        def give_back() -> None:
            with self._lock:
                if not given_back.is_set():
                    given_back.set()
                    self._open[who] -= 1
                    if self._open[who] <= 0:
                        del self._open[who]

        return give_back


class SlotStream(StreamingResponse):
    """A streaming response that gives its slot back when the stream ends, however it ends."""

    def __init__(self, content: AsyncIterator[str], give_back: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.give_back = give_back

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.give_back()
