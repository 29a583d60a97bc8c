"""Many hosts on one PostgreSQL job store, on one machine: two API processes (`ckptctl serve --workers 0`)
and two worker processes (`ckptctl worker`) share one database. 50 small export jobs go in through both
APIs; one worker is SIGKILLed while it runs jobs. Every job ends exactly once, its output registered once.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckpt_service.store import JobStore
from ckpt_service.worker import pid_alive

from .pg_server import PgServer
from .service_harness import Server, job_spec, make_server, wait_for

JOBS = 50
#: each job moves ~40 KB of tensors at 20 KB/s: about two seconds, long enough to be killed mid-run
SLOW = {"CKPT_JOB_MAX_BYTES_PER_SECOND": "20000"}


def tiny_checkpoint(folder: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    folder.mkdir()
    state = {"layer.weight": torch.arange(9000, dtype=torch.float32).reshape(90, 100),
             "layer.bias": torch.arange(100, dtype=torch.float32) / 7}
    torch.save(state, folder / "model.pt")
    return folder / "model.pt", state


def start_worker(api: Server, name: str, slots: int) -> tuple[subprocess.Popen[bytes], Path]:
    log = api.data_dir.parent / f"{name}.log"
    data = api.data_dir.parent / name
    data.mkdir()
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-P", "-m", "ckptctl", "worker", "--workers", str(slots),
                                 "--data-dir", str(data)], env=api.env, stdout=out, stderr=subprocess.STDOUT)
    return proc, log


def events(log: Path) -> list[dict]:
    return [e for line in log.read_text(errors="replace").splitlines() if line.startswith("{")
            for e in [json.loads(line)]]


@pytest.mark.slow
def test_two_apis_two_workers_one_killed_every_job_ends_once(postgres: PgServer, tmp_path: Path) -> None:
    url = postgres.create_database()
    source, state = tiny_checkpoint(tmp_path / "src")
    out = tmp_path / "out"
    out.mkdir()
    env = {"CKPT_DATABASE_URL": url, **SLOW}
    apis = [make_server(tmp_path / f"api{i}", read_roots=[source.parent], write_roots=[out], workers=0,
                        extra_env=env) for i in (1, 2)]
    workers: list[tuple[subprocess.Popen[bytes], Path]] = []
    try:
        for api in apis:
            api.start()
        workers = [start_worker(apis[0], f"worker{i}", 2) for i in (1, 2)]
        clients = [api.client() for api in apis]
        ids = [clients[i % 2].submit(job_spec("export", source, out / f"o{i}"), idempotency_key=f"k{i}")["id"]
               for i in range(JOBS)]
        # the same key through the other replica is the same job
        assert clients[1].submit(job_spec("export", source, out / "o0"), idempotency_key="k0")["id"] == ids[0]

        victim = workers[0][0]

        def running_on_victim() -> list[dict]:
            jobs = clients[1].jobs(state="running", limit=JOBS)["items"]
            return [j for j in jobs if (j["worker"] or "").split(":")[1] == str(victim.pid)
                    and (j["progress"] or {}).get("done_bytes")]

        doomed = wait_for(running_on_victim, 120, "a job to make progress on worker 1", interval=0.1)
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        for job in doomed:
            wait_for(lambda job=job: not pid_alive(job["pid"]), 10, "the killed worker's job process to die")

        done = {job_id: apis[n % 2].wait_job(job_id, ("succeeded", "failed", "cancelled"), timeout=300)
                for n, job_id in enumerate(ids)}
    finally:
        for proc, _ in workers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
        for api in apis:
            api.stop()

    assert {job["state"] for job in done.values()} == {"succeeded"}, [j for j in done.values()
                                                                      if j["state"] != "succeeded"]
    retried = {job_id for job_id, job in done.items() if job["attempt"] == 2}
    assert {job["id"] for job in doomed} <= retried
    assert all(job["attempt"] in (1, 2) for job in done.values())

    logged = events(workers[0][1]) + events(workers[1][1])
    succeeded = sorted(e["job_id"] for e in logged if e["event"] == "job.succeeded")
    assert succeeded == sorted(ids)  # each job ended exactly once, across both workers
    started = [(e["job_id"], e["attempt"]) for e in logged if e["event"] == "job.claimed"]
    assert len(started) == len(set(started))  # no attempt was claimed twice
    lost = sorted(e["job_id"] for e in logged if e["event"] == "job.worker_lost")
    assert lost == sorted(retried)

    store = JobStore(url, migrate=False)
    rows = store.query("SELECT uri, COUNT(*) AS n FROM checkpoints GROUP BY uri")
    assert {r["uri"]: r["n"] for r in rows} == {str(source): 1, **{str(out / f"o{i}"): 1 for i in range(JOBS)}}
    assert store.query("SELECT COUNT(*) AS n FROM lineage")[0]["n"] == JOBS
    store.close()
    for i in range(JOBS):
        assert sorted(p.name for p in (out / f"o{i}").iterdir()) == ["ckpt-manifest.json", "model.safetensors"]
        got = load_file(out / f"o{i}" / "model.safetensors")
        assert set(got) == set(state) and all(torch.equal(got[k], state[k]) for k in state)
    assert sorted(p.name for p in out.iterdir()) == sorted(f"o{i}" for i in range(JOBS))  # no partial output left
