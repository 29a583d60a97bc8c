"""Durability: SIGKILL the server in the middle of a job, start it again on the same data dir.

The running job's process dies with the server; on restart the job is requeued (attempt 2) from a
clean target and completes exactly once; the job that was still queued runs once as well.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from ckpt_service.store import JobStore
from ckpt_service.worker import pid_alive
from converters import verify
from converters.transforms import KeyOptions

from .service_harness import job_spec, leftovers, make_server, wait_for

pytestmark = pytest.mark.slow  # real FSDP samples, servers or containers: the full suite (CI), not the edit loop


def test_sigkill_mid_job_then_restart_completes_each_job_once(fsdp2: dict, tmp_path: Path) -> None:
    source = fsdp2["fsdp2-dcp"].path
    out = tmp_path / "out"
    out.mkdir()
    server = make_server(tmp_path / "data", read_roots=[source.parent], write_roots=[out], workers=1,
                         extra_env={"CKPT_JOB_MAX_BYTES_PER_SECOND": "150000"})
    slow_target, queued_target = out / "slow.safetensors", out / "queued"
    server.start()
    try:
        with server.client() as client:
            slow = client.submit(job_spec("convert", source, slow_target, only="all"))
            queued = client.submit(job_spec("export", source, queued_target))
            running = wait_for(lambda: (job := client.job(slow["id"]))["state"] == "running"
                               and (job["progress"] or {}).get("done_bytes") and job, 30, "the slow job to run")
        server.kill()
        wait_for(lambda: not pid_alive(running["pid"]), 10, "the orphaned job process to die with the server")
        partial = leftovers(slow_target)
        assert partial and all(".tmp-" in name for name in partial)  # killed mid-write

        store = JobStore(server.data_dir / "ckpt.db")
        assert store.get(slow["id"]).state == "running"  # nobody recorded anything: the server just vanished
        assert store.get(queued["id"]).state == "queued"

        server.start()
        done_slow = server.wait_job(slow["id"], ("succeeded", "failed"), timeout=60)
        done_queued = server.wait_job(queued["id"], ("succeeded", "failed"), timeout=60)
    finally:
        server.stop()

    assert done_slow["state"] == "succeeded" and done_slow["attempt"] == 2, done_slow
    assert done_queued["state"] == "succeeded" and done_queued["attempt"] == 1, done_queued
    assert leftovers(slow_target) == ["slow.safetensors"]
    report = verify(str(source), str(slow_target), keys=KeyOptions(only="all", clean=False, nest=False))
    assert report.ok and report.compared > 0, report.summary()

    events = server.log_events()
    succeeded = [e["job_id"] for e in events if e["event"] == "job.succeeded"]
    assert sorted(succeeded) == sorted([slow["id"], queued["id"]])  # each exactly once
    lost = [e for e in events if e["event"] == "job.worker_lost"]
    assert [(e["job_id"], e["now"]) for e in lost] == [(slow["id"], "queued")]
    rows = store.query("SELECT COUNT(*) AS n FROM checkpoints WHERE uri = ?", (str(slow_target.resolve()),))
    assert rows[0]["n"] == 1


def test_sigterm_puts_the_running_job_back_without_using_an_attempt(fsdp2: dict, tmp_path: Path) -> None:
    source = fsdp2["fsdp2-dcp"].path
    out = tmp_path / "out"
    out.mkdir()
    server = make_server(tmp_path / "data", read_roots=[source.parent], write_roots=[out], workers=1,
                         extra_env={"CKPT_JOB_MAX_BYTES_PER_SECOND": "150000"})
    target = out / "released.safetensors"
    server.start()
    try:
        with server.client() as client:
            job = client.submit(job_spec("convert", source, target, only="all"))
            running = wait_for(lambda: (j := client.job(job["id"]))["state"] == "running"
                               and (j["progress"] or {}).get("done_bytes") and j, 30, "the job to run")
    finally:
        server.stop()  # SIGTERM: graceful
    assert server.proc is not None and server.proc.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises it
    assert not pid_alive(running["pid"])
    back = JobStore(server.data_dir / "ckpt.db").get(job["id"])
    assert (back.state, back.attempt) == ("queued", 0)
    assert leftovers(target) == []
    released = [e for e in server.log_events() if e["event"] == "job.released"]
    assert [e["job_id"] for e in released] == [job["id"]]
