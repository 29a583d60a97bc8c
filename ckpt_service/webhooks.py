"""Webhooks (job callbacks): POST the final job document to the job's `callback_url`, with a timeout and retries.

The URL's host is resolved and checked when the callback is sent (`netguard.pin`), and the request goes
to the checked address without following redirects or proxies; a refused URL is not retried. Delivery
is claimed in the store first (so one worker sends it, and a sender that dies hands it on); failures
are logged and recorded, never raised into a worker.
"""

from __future__ import annotations

import threading
import time

from . import logs
from .jobs import JobRecord
from .netguard import CallbackPolicy, CallbackRefused, pin
from .store import JobStore


def deliver(store: JobStore, job: JobRecord, timeout: float, attempts: int, policy: CallbackPolicy) -> bool:
    import httpx

    document = job.document()
    delay = 0.5
    for attempt in range(1, attempts + 1):
        try:
            target = pin(job.callback_url or "", policy)
        except CallbackRefused as exc:
            logs.event("callback.refused", job_id=job.id, problem=str(exc))
            store.callback_done(job.id, False)
            return False
        try:
            with httpx.Client(timeout=timeout, follow_redirects=False, trust_env=False) as client:
                response = client.post(target.url, json=document, extensions=target.extensions,
                                       headers={**target.headers, "User-Agent": "ckpt-service", "X-Ckpt-Job": job.id})
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


def deliver_due(store: JobStore, owner: str, timeout: float, attempts: int, policy: CallbackPolicy
                ) -> list[threading.Thread]:
    """Claim due callbacks and send each from its own daemon thread; returns the threads."""
    hold = attempts * (timeout + 8) + 10  # longer than a full round of retries
    threads = []
    for job in store.claim_callbacks(owner, hold):
        thread = threading.Thread(target=_safe_deliver, args=(store, job, timeout, attempts, policy), daemon=True,
                                  name=f"callback-{job.id}")
        thread.start()
        threads.append(thread)
    return threads


def _safe_deliver(store: JobStore, job: JobRecord, timeout: float, attempts: int, policy: CallbackPolicy) -> None:
    try:
        deliver(store, job, timeout, attempts, policy)
    except Exception:
        logs.event("callback.error", job_id=job.id, exc_info=True)
