"""A real `ckptctl serve` on a free loopback port, for the service tests. Every wait here is bounded."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import httpx

from ckpt_service.auth import create
from ckpt_service.client import ServiceClient
from ckpt_service.helpers import free_port

T = TypeVar("T")
#: quick heartbeats and polls, so the tests need not wait for production-sized intervals
FAST = {"CKPT_LEASE_SECONDS": "3", "CKPT_HEARTBEAT_SECONDS": "0.25", "CKPT_POLL_SECONDS": "0.1",
        "CKPT_PROGRESS_SECONDS": "0.1", "CKPT_JOB_NICE": "0"}




@contextlib.contextmanager
def serve(handler: type[BaseHTTPRequestHandler]) -> Iterator[ThreadingHTTPServer]:
    """A real HTTP server on a free loopback port, in a thread, for the life of the `with` block."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def wait_for(check: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll `check` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


@dataclass
class Tokens:
    read: str
    write: str
    admin: str
    entries: list[str] = field(default_factory=list)

    @classmethod
    def make(cls) -> Tokens:
        made = {scope: create(scope, f"test-{scope}") for scope in ("read", "write", "admin")}  # type: ignore[arg-type]
        return cls(made["read"][0], made["write"][0], made["admin"][0], [e.line() for _, e in made.values()])


@dataclass
class Server:
    data_dir: Path
    port: int
    env: dict[str, str]
    args: list[str]
    log: Path
    cwd: Path | None = None
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> Server:
        # -P: like the `ckptctl` console script, the server does not have its working directory on sys.path
        cmd = [sys.executable, "-P", "-m", "ckptctl", "serve", "--port", str(self.port), "--data-dir",
               str(self.data_dir), *self.args]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=self.cwd)

        def up() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                return httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200
            except httpx.TransportError:
                return False

        try:
            wait_for(up, timeout, "the server to answer /healthz", interval=0.1)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs (job processes die with it through PR_SET_PDEATHSIG)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def log_events(self) -> list[dict[str, Any]]:
        events = []
        for line in self.log.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    events.append(json.loads(line))
        return events

    def client(self, token: str | None = None) -> ServiceClient:
        return ServiceClient(self.url, token, timeout=15.0)

    def http(self, token: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=15.0)

    def wait_job(self, job_id: str, states: tuple[str, ...], timeout: float = 60.0,
                 token: str | None = None) -> dict[str, Any]:
        with self.client(token) as client:
            return wait_for(lambda: (job := client.job(job_id))["state"] in states and job, timeout,
                            f"job {job_id} to reach {states}", interval=0.1)


def make_server(data_dir: Path, *, read_roots: list[Path], write_roots: list[Path], workers: int = 2,
                tokens: list[str] | None = None, extra_env: dict[str, str] | None = None,
                args: list[str] | None = None, cwd: Path | None = None) -> Server:
    """A server (not started) with its own data dir; only loopback, only the given roots."""
    data_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    env.update(FAST)
    env.update({"CKPT_READ_ROOTS": json.dumps([str(p) for p in read_roots]),
                "CKPT_WRITE_ROOTS": json.dumps([str(p) for p in write_roots]),
                "CKPT_WORKERS": str(workers)})
    if tokens:
        env["CKPT_TOKENS"] = json.dumps(tokens)
    env.update(extra_env or {})
    return Server(data_dir, free_port(), env, args or [], data_dir / "server.log", cwd)


def job_spec(kind: str, source: Path | str, target: Path | str | None = None, **options: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"kind": kind, "source": str(source), "options": options}
    if target is not None:
        spec["target"] = str(target)
    return spec


def leftovers(target: Path) -> list[str]:
    """The target and any temporary siblings the engine writes next to it."""
    return sorted(p.name for p in target.parent.iterdir() if p.name == target.name
                  or p.name.startswith(f".{target.name}.tmp-"))


def run_here(client: Any, body: dict[str, Any]) -> dict[str, Any]:
    """Submit job `body` to an in-process app (a FastAPI TestClient), run it in this process as a worker
    would, and return the job as the API shows it."""
    from ckpt_service.executor import run_job

    job = client.post("/v1/jobs", json=body)
    assert job.status_code == 202, job.text
    store = client.app.state.service.store
    claimed = store.claim("test-worker", 60.0)
    assert claimed is not None and run_job(store, claimed.id, claimed.attempt) == 0
    return dict(client.get(f"/v1/jobs/{job.json()['id']}").json())
