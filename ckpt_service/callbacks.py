"""Job callbacks: POST the final job document to the job's `callback_url`, with a timeout and a few retries.

Delivery is claimed in the store first (so one worker sends it, and a sender that dies hands it on);
failures are logged and recorded, never raised into a worker.
"""

from __future__ import annotations

import threading
import time

from . import logs
from .jobs import JobRecord
from .store import JobStore


def deliver(store: JobStore, job: JobRecord, timeout: float, attempts: int) -> bool:
    import httpx

    document = job.document()
    delay = 0.5
    for attempt in range(1, attempts + 1):
        try:
            response = httpx.post(job.callback_url or "", json=document, timeout=timeout,
                                  headers={"User-Agent": "ckpt-service", "X-Ckpt-Job": job.id})
            if response.status_code < 300:
                logs.event("callback.sent", job_id=job.id, status=response.status_code, attempt=attempt)
                store.callback_done(job.id, True)
                return True
            problem = f"HTTP {response.status_code}"
        except httpx.HTTPError as exc:
            problem = type(exc).__name__
        logs.event("callback.retry" if attempt < attempts else "callback.failed", job_id=job.id, attempt=attempt,
                   problem=problem)
        if attempt < attempts:
            time.sleep(delay)
            delay *= 2
    store.callback_done(job.id, False)
    return False


def deliver_due(store: JobStore, owner: str, timeout: float, attempts: int) -> list[threading.Thread]:
    """Claim due callbacks and send each from its own daemon thread; returns the threads."""
    hold = attempts * (timeout + 8) + 10  # longer than a full round of retries
    threads = []
    for job in store.claim_callbacks(owner, hold):
        thread = threading.Thread(target=_safe_deliver, args=(store, job, timeout, attempts), daemon=True,
                                  name=f"callback-{job.id}")
        thread.start()
        threads.append(thread)
    return threads


def _safe_deliver(store: JobStore, job: JobRecord, timeout: float, attempts: int) -> None:
    try:
        deliver(store, job, timeout, attempts)
    except Exception:
        logs.event("callback.error", job_id=job.id, exc_info=True)
