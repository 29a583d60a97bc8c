"""Delivery under failure, in-process against real HTTP servers on loopback: webhook retries (a receiver
that answers 500 before it answers 204, or never does) and the client following a job whose event
stream breaks (it reconnects and still returns the final document)."""

from __future__ import annotations

import json
import sqlite3
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from ckpt_service.client import ServiceClient
from ckpt_service.netguard import CallbackPolicy
from ckpt_service.service_errors import ClientError
from ckpt_service.store import JobStore
from ckpt_service.webhooks import deliver

from .service_harness import serve


class Receiver(BaseHTTPRequestHandler):
    """A webhook receiver answering the statuses in `server.answers` in turn (the last one from then on)."""

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        server: Any = self.server
        server.seen.append((self.headers["X-Ckpt-Job"], json.loads(body)))
        status = server.answers[min(len(server.seen), len(server.answers)) - 1]
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def finished_job(store: JobStore, url: str) -> Any:
    job, _ = store.create_job(kind="inspect", spec={"kind": "inspect", "source": "/data/a"}, target=None,
                              callback_url=url, submitted_by="ci", max_attempts=1, queue_limit=10)
    claimed = store.claim("w1", 30)
    assert claimed is not None and claimed.id == job.id
    assert store.finish_now(job.id, claimed.attempt, "succeeded", result={"format": "dcp"})
    return store.get(job.id)


def callback_state(store: JobStore, job_id: str) -> str:
    conn = sqlite3.connect(store.path)
    try:
        return conn.execute("SELECT callback_state FROM jobs WHERE id = ?", (job_id,)).fetchone()[0]
    finally:
        conn.close()


@pytest.mark.parametrize(("answers", "attempts", "delivered", "posts"), [
    ([500, 503, 204], 4, True, 3),  # retried until it is taken
    ([500], 2, False, 2),  # given up after the last attempt
])
def test_webhook_retries(tmp_path: Path, answers: list[int], attempts: int, delivered: bool, posts: int) -> None:
    store = JobStore(tmp_path / "ckpt.db")
    with serve(Receiver) as server:
        server.seen, server.answers = [], answers  # type: ignore[attr-defined]
        job = finished_job(store, f"http://127.0.0.1:{server.server_port}/hook")
        started = time.monotonic()
        assert deliver(store, job, timeout=5, attempts=attempts, policy=CallbackPolicy.parse(["127.0.0.1"])) \
            is delivered
        seen = server.seen  # type: ignore[attr-defined]
    assert len(seen) == posts
    assert {job_id for job_id, _ in seen} == {job.id}
    assert all(document == job.document() for _, document in seen)  # the same final document every time
    assert seen[0][1]["state"] == "succeeded" and seen[0][1]["result"] == {"format": "dcp"}
    assert time.monotonic() - started >= 0.5 * (2 ** (posts - 1) - 1)  # backed off 0.5 s, then 1 s, ...
    assert callback_state(store, job.id) == ("sent" if delivered else "failed")


class BrokenStream(BaseHTTPRequestHandler):
    """The job API for one job: its event stream breaks mid-stream `server.breaks` times, then ends it."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        server: Any = self.server
        job = {"id": "job_1", "state": "running", "attempt": 1}
        if self.path == "/v1/jobs/job_1/events":
            server.streams += 1
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            if server.streams <= server.breaks:
                self.send_header("Content-Length", "1000")  # promises more than it sends, then hangs up
                self.end_headers()
                self.wfile.write(f"event: state\ndata: {json.dumps(job)}\n\n".encode())
                self.wfile.flush()
                self.close_connection = True
                return
            body = f"event: end\ndata: {json.dumps({**job, 'state': 'succeeded'})}\n\n".encode()
        elif self.path == "/v1/jobs/job_1":
            body = json.dumps(job).encode()
        else:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if self.path.endswith("/job_1"):
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_client_reconnects_when_the_event_stream_breaks() -> None:
    with serve(BrokenStream) as server:
        server.streams, server.breaks = 0, 2  # type: ignore[attr-defined]
        events: list[tuple[str, str]] = []
        with ServiceClient(f"http://127.0.0.1:{server.server_port}", retries=1) as client:
            final = client.wait("job_1", lambda event, data: events.append((event, data["state"])), timeout=30)
        assert final["state"] == "succeeded"
        assert server.streams == 3  # type: ignore[attr-defined]
    assert events == [("state", "running"), ("state", "running"), ("end", "succeeded")]


def test_client_gives_up_after_its_reconnects() -> None:
    with serve(BrokenStream) as server:
        server.streams, server.breaks = 0, 100  # type: ignore[attr-defined]
        with ServiceClient(f"http://127.0.0.1:{server.server_port}", retries=1) as client, \
                pytest.raises(ClientError, match="lost the event stream of job_1 1 times"):
            client.wait("job_1", reconnects=1)
        assert server.streams == 2  # type: ignore[attr-defined]
