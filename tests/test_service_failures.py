"""Jobs that are cancelled or whose process is killed: a real server, real job processes, real signals.

Jobs are slowed down with the server's bandwidth cap (CKPT_JOB_MAX_BYTES_PER_SECOND), so a conversion
of the tiny sample runs for a few seconds and can be interrupted while it writes.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckpt_service.worker import pid_alive
from converters import verify
from converters.transforms import KeyOptions

from .service_harness import Server, job_spec, leftovers, make_server, wait_for

pytestmark = pytest.mark.slow  # real FSDP samples, servers or containers: the full suite (CI), not the edit loop

SLOW = {"CKPT_JOB_MAX_BYTES_PER_SECOND": "150000"}  # the tiny sample's ~0.7 MB take ~5 s


def slow_convert(source: Path, target: Path) -> dict[str, Any]:
    return job_spec("convert", source, target, only="all")


def running_with_progress(server: Server, job_id: str, timeout: float = 30) -> dict[str, Any]:
    with server.client() as client:
        return wait_for(lambda: (job := client.job(job_id))["state"] == "running" and job["pid"]
                        and (job["progress"] or {}).get("done_bytes") and job, timeout, f"{job_id} to make progress")


@pytest.fixture(scope="module")
def source(fsdp2: dict) -> Path:
    return fsdp2["fsdp2-dcp"].path


@pytest.fixture(scope="module")
def server(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    out, swap = tmp_path_factory.mktemp("fail-out"), tmp_path_factory.mktemp("fail-swap")
    server = make_server(tmp_path_factory.mktemp("fail-data"), read_roots=[source.parent, swap], write_roots=[out],
                         workers=1, extra_env=SLOW)
    server.out, server.swap = out, swap  # type: ignore[attr-defined]
    yield server.start()
    server.stop()


def test_cancel_running_and_queued_jobs(server: Server, source: Path) -> None:
    out: Path = server.out  # type: ignore[attr-defined]
    with server.client() as client:
        first = client.submit(slow_convert(source, out / "cancel-running.safetensors"))
        second = client.submit(slow_convert(source, out / "cancel-queued.safetensors"))
        running = running_with_progress(server, first["id"])
        assert client.job(second["id"])["state"] == "queued"  # one job slot

        queued = client.cancel(second["id"])
        assert queued["state"] == "cancelled"  # a queued job is cancelled at once

        asked = time.monotonic()
        flagged = client.cancel(first["id"])
        assert flagged["cancel_requested"] is True
        final = server.wait_job(first["id"], ("cancelled", "succeeded", "failed"), timeout=15)
        took = time.monotonic() - asked
        assert final["state"] == "cancelled", final
        assert took < 5, f"cancel took {took:.1f} s"
        assert final["finished_at"] is not None and final["result"] is None
        assert client.job(second["id"])["attempt"] == 0  # never started
        assert client.cancel(second["id"])["state"] == "cancelled"  # cancelling twice is fine
    wait_for(lambda: not pid_alive(running["pid"]), 10, "the job process to be gone")
    assert leftovers(out / "cancel-running.safetensors") == []


def test_killed_job_process_is_retried_from_a_clean_target(server: Server, source: Path) -> None:
    out: Path = server.out  # type: ignore[attr-defined]
    target = out / "retried.safetensors"
    with server.client() as client:
        job = client.submit(slow_convert(source, target))
        running = running_with_progress(server, job["id"])
        assert any(name.startswith(".retried.safetensors.tmp-") for name in leftovers(target))  # mid-write
        os.kill(running["pid"], signal.SIGKILL)
        final = server.wait_job(job["id"], ("succeeded", "failed"), timeout=60)
    assert final["state"] == "succeeded", final
    assert final["attempt"] == 2 and final["pid"] != running["pid"]
    assert leftovers(target) == ["retried.safetensors"]
    report = verify(str(source), str(target), keys=KeyOptions(only="all", clean=False, nest=False))
    assert report.ok and report.compared > 0, report.summary()
    died = [e for e in server.log_events() if e["event"] == "job.process_died" and e.get("job_id") == job["id"]]
    assert len(died) == 1 and "SIGKILL" in died[0]["reason"] and died[0]["now"] == "queued"


def test_killed_job_fails_with_the_reason_after_max_attempts(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    server = make_server(tmp_path / "data", read_roots=[source.parent], write_roots=[out], workers=1,
                         extra_env={**SLOW, "CKPT_MAX_ATTEMPTS": "1"}).start()
    try:
        target = out / "doomed.safetensors"
        with server.client() as client:
            job = client.submit(slow_convert(source, target))
            running = running_with_progress(server, job["id"])
            os.kill(running["pid"], signal.SIGKILL)
            final = server.wait_job(job["id"], ("succeeded", "failed"), timeout=30)
            assert final["state"] == "failed" and final["attempt"] == 1 and final["max_attempts"] == 1
            assert final["error"]["type"] == "WorkerLost"
            assert f"job process {running['pid']} was killed by SIGKILL" in final["error"]["message"]
            assert "attempt 1 of 1" in final["error"]["message"]
            assert leftovers(target) == []
            # the server and its slot are fine: the next job runs
            after = client.submit(job_spec("inspect", source))
            assert client.wait(after["id"], timeout=30)["state"] == "succeeded"
    finally:
        server.stop()


def test_a_symlink_swapped_in_after_queueing_is_refused_when_the_job_starts(server: Server, source: Path,
                                                                           tmp_path: Path) -> None:
    out: Path = server.out  # type: ignore[attr-defined]
    inside: Path = server.swap / "ckpt"  # type: ignore[attr-defined]
    outside = tmp_path / "outside"
    shutil.copytree(source, inside)
    shutil.copytree(source, outside)
    with server.client() as client:
        blocker = client.submit(slow_convert(source, out / "blocker.safetensors"))
        running_with_progress(server, blocker["id"])
        job = client.submit(job_spec("inspect", inside))  # checked and queued while `inside` is a real folder
        shutil.rmtree(inside)
        inside.symlink_to(outside)
        client.cancel(blocker["id"])
        final = client.wait(job["id"], timeout=30)
    assert final["state"] == "failed" and final["error"]["type"] == "OutsideRoots", final
    assert "outside the storage roots" in final["error"]["message"]
