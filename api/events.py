"""Server-sent events for one job: `state` on every state change, `progress` when progress moves,
`end` with the final job document, then the stream closes. Comments keep idle connections alive.

The store is read in a worker thread, so a stream never blocks the event loop.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio

from ckpt_service.service import CkptService

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
