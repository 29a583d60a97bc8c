"""A small httpx client for the ckpt-service REST API (used by `ckptctl submit/jobs/status/cancel/checkpoints`).

>>> client = ServiceClient("http://127.0.0.1:8080", token=os.environ.get("CKPT_TOKEN"))
>>> job = client.submit({"kind": "export", "source": "/data/run/step_2000", "target": "/data/exports/2000"})
>>> final = client.wait(job["id"])
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from .service_errors import ClientError

DEFAULT_SERVER = "http://127.0.0.1:8080"


def parse_sse(lines: Iterator[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(event, data) pairs from a text/event-stream; comments and `retry:` lines are skipped."""
    event, data = "message", list[str]()
    for line in lines:
        if line == "":
            if data:
                yield event, json.loads("\n".join(data))
            event, data = "message", []
        elif line.startswith(":"):
            continue
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())


class ServiceClient:
    def __init__(self, server: str = DEFAULT_SERVER, token: str | None = None, timeout: float = 30.0,
                 retries: int = 3) -> None:
        import httpx  # imported here so that `ckptctl inspect` and friends never load it

        headers = {"User-Agent": "ckptctl"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self.server = server.rstrip("/")
        self.retries = retries
        self.http = httpx.Client(base_url=self.server, headers=headers, timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, *, retry: bool = True, **kwargs: Any) -> Any:
        """Send a request; connection failures are retried (POSTs only when they carry an Idempotency-Key)."""
        import httpx

        attempts = self.retries if retry else 1
        for attempt in range(1, attempts + 1):
            try:
                response = self.http.request(method, path, **kwargs)
                break
            except httpx.TransportError as exc:
                if attempt == attempts:
                    raise ClientError(0, "unreachable", f"cannot reach {self.server} ({type(exc).__name__}); is "
                                      "`ckptctl serve` running there? (--server / CKPT_SERVER)") from None
                time.sleep(0.5 * attempt)
        if response.status_code >= 400:
            try:
                error = response.json()["error"]
                raise ClientError(response.status_code, error.get("type", "error"), error.get("message", ""),
                                  (error.get("fields") or [{}])[0].get("field"))
            except (ValueError, KeyError, TypeError):
                raise ClientError(response.status_code, "error", response.text[:200] or "request failed") from None
        return response.json() if response.content else None

    # -- jobs --------------------------------------------------------------------------------------

    def submit(self, spec: dict[str, Any], idempotency_key: str | None = None) -> dict[str, Any]:
        key = idempotency_key or uuid.uuid4().hex  # so a retried POST never makes a second job
        return self._request("POST", "/v1/jobs", json=spec, headers={"Idempotency-Key": key})

    def job(self, job_id: str) -> dict[str, Any]:
        return self._request("GET", f"/v1/jobs/{job_id}")

    def jobs(self, state: str | None = None, kind: str | None = None, limit: int = 50,
             cursor: str | None = None) -> dict[str, Any]:
        params = {k: v for k, v in {"state": state, "kind": kind, "limit": limit, "cursor": cursor}.items()
                  if v is not None}
        return self._request("GET", "/v1/jobs", params=params)

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._request("POST", f"/v1/jobs/{job_id}/cancel")

    def events(self, job_id: str, read_timeout: float = 60.0) -> Iterator[tuple[str, dict[str, Any]]]:
        """The job's server-sent events until `end` (the server sends a keep-alive every 15 s)."""
        import httpx

        timeout = httpx.Timeout(10.0, read=read_timeout)
        try:
            with self.http.stream("GET", f"/v1/jobs/{job_id}/events", timeout=timeout) as response:
                if response.status_code >= 400:
                    response.read()
                    self._request("GET", f"/v1/jobs/{job_id}", retry=False)  # raises the proper error
                    raise ClientError(response.status_code, "error", "event stream refused")
                yield from parse_sse(response.iter_lines())
        except httpx.TransportError as exc:
            raise ClientError(0, "unreachable", f"event stream from {self.server} broke ({type(exc).__name__})"
                              ) from None

    def wait(self, job_id: str, on_event: Callable[[str, dict[str, Any]], None] | None = None,
             timeout: float | None = None, reconnects: int = 20) -> dict[str, Any]:
        """Follow the job until it ends and return its final document; reconnects when the stream breaks."""
        from .jobs import TERMINAL  # here: the job models load only when a command waits on a job

        deadline = None if timeout is None else time.monotonic() + timeout
        for _ in range(reconnects + 1):
            try:
                for event, data in self.events(job_id):
                    if on_event is not None:
                        on_event(event, data)
                    if event == "end":
                        return data
                    if deadline is not None and time.monotonic() > deadline:
                        raise TimeoutError(f"job {job_id} still {data.get('state')} after {timeout} s")
            except ClientError as exc:
                if exc.status:
                    raise
            job = self.job(job_id)
            if job["state"] in TERMINAL:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job['state']} after {timeout} s")
            time.sleep(1.0)
        raise ClientError(0, "unreachable", f"lost the event stream of {job_id} {reconnects} times; giving up")

    # -- checkpoints -------------------------------------------------------------------------------

    def register(self, uri: str, name: str | None = None, tags: list[str] | None = None,
                 metadata: dict[str, Any] | None = None, source_format: str | None = None) -> dict[str, Any]:
        body = {"uri": uri, "name": name, "tags": tags or [], "metadata": metadata or {},
                "source_format": source_format}
        return self._request("POST", "/v1/checkpoints", json=body, retry=False)

    def checkpoint(self, checkpoint_id: str, tensors: bool = False) -> dict[str, Any]:
        return self._request("GET", f"/v1/checkpoints/{checkpoint_id}", params={"tensors": tensors})

    def checkpoints(self, name: str | None = None, tag: str | None = None, format: str | None = None,
                    limit: int = 50, cursor: str | None = None, archived: bool = False) -> dict[str, Any]:
        params = {k: v for k, v in {"name": name, "tag": tag, "format": format, "limit": limit,
                                    "cursor": cursor, "archived": "true" if archived else None}.items()
                  if v is not None}
        return self._request("GET", "/v1/checkpoints", params=params)

    def lineage(self, checkpoint_id: str) -> dict[str, Any]:
        return self._request("GET", f"/v1/checkpoints/{checkpoint_id}/lineage")

    def delete(self, checkpoint_id: str, purge: bool = False) -> dict[str, Any]:
        return self._request("DELETE", f"/v1/checkpoints/{checkpoint_id}", params={"purge": purge}, retry=False)
