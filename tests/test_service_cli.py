"""The client commands against a live server (`ckptctl submit/status/jobs/cancel/checkpoints/token`), and a
standalone `ckptctl worker` doing the work for an API-only server on the same data dir."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from converters.api import verify
from converters.transforms import KeyOptions

from .service_harness import Server, Tokens, make_server

pytestmark = pytest.mark.slow  # real FSDP samples, servers or containers: the full suite (CI), not the edit loop


def ckptctl(server: Server, token: str | None, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    env.update({"CKPT_SERVER": server.url, "COLUMNS": "200"})
    if token:
        env["CKPT_TOKEN"] = token
    proc = subprocess.run([sys.executable, "-m", "ckpt_service.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"ckptctl {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def api_only(fsdp2: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Tokens, Path, Path]]:
    source = fsdp2["fsdp2-dcp"].path
    out = tmp_path_factory.mktemp("cli-out")
    tokens = Tokens.make()
    server = make_server(tmp_path_factory.mktemp("cli-data"), read_roots=[source.parent], write_roots=[out],
                         workers=0, tokens=tokens.entries)
    yield server.start(), tokens, source, out
    server.stop()


def test_submit_with_a_standalone_worker_then_status_jobs_and_checkpoints(
        api_only: tuple[Server, Tokens, Path, Path]) -> None:
    server, tokens, source, out = api_only
    target = out / "export-bf16"
    job_id = ckptctl(server, tokens.write, "submit", "export", str(source), str(target), "--dtype", "bfloat16",
                     "--max-shard-size", "100KB").stdout.strip()
    assert job_id.startswith("job_")
    queued = json.loads(ckptctl(server, tokens.read, "status", job_id, "--json").stdout)
    assert queued["state"] == "queued"  # the API server has no job slots
    assert queued["spec"]["options"]["dtype"] == "bfloat16" and queued["spec"]["options"]["clean_keys"] is True

    worker = subprocess.Popen([sys.executable, "-m", "ckpt_service.cli", "worker", "--workers", "1", "--data-dir",
                               str(server.data_dir)], env=server.env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        followed = ckptctl(server, tokens.read, "status", job_id, "--follow")
        assert "succeeded" in followed.stdout and "registered as ckpt_" in followed.stdout
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)
    assert worker.returncode == 0
    assert len(list(target.glob("model-*-of-*.safetensors"))) > 1  # sharded at 100KB
    report = verify(str(source), str(target), keys=KeyOptions(only="model", nest=False), atol=0.01)
    assert report.ok, report.summary()

    listed = ckptctl(server, tokens.read, "jobs", "--state", "succeeded").stdout
    assert job_id in listed
    checkpoints = json.loads(ckptctl(server, tokens.read, "checkpoints", "list", "--json").stdout)["items"]
    made = next(c for c in checkpoints if c["made_by_job"] == job_id)
    shown = ckptctl(server, tokens.read, "checkpoints", "show", made["id"], "--tensors").stdout
    assert "bfloat16" in shown
    lineage = ckptctl(server, tokens.read, "checkpoints", "lineage", made["id"]).stdout
    assert "derived from" in lineage and str(source.resolve()) in lineage


def test_register_cancel_and_errors(api_only: tuple[Server, Tokens, Path, Path], fsdp2: dict) -> None:
    server, tokens, _, out = api_only
    safetensors = fsdp2["safetensors"].path
    registered = json.loads(ckptctl(server, tokens.write, "checkpoints", "register", str(safetensors), "--name",
                                    "llama-2000", "--tag", "eval", "--meta", "step=2000", "--json").stdout)
    assert registered["name"] == "llama-2000" and registered["metadata"] == {"step": 2000}
    found = json.loads(ckptctl(server, tokens.read, "checkpoints", "list", "--tag", "eval", "--json").stdout)
    assert [c["id"] for c in found["items"]] == [registered["id"]]

    job_id = ckptctl(server, tokens.write, "submit", "reshard", str(safetensors), str(out / "ws3"),
                     "--world-size", "3").stdout.strip()
    cancelled = ckptctl(server, tokens.write, "cancel", job_id).stdout
    assert "cancelled" in cancelled
    again = ckptctl(server, tokens.read, "status", job_id, "--follow", check=False)
    assert again.returncode == 1 and "cancelled" in again.stdout

    denied = ckptctl(server, tokens.read, "submit", "inspect", str(safetensors), check=False)
    assert denied.returncode == 2 and "HTTP 403" in denied.stderr
    outside = ckptctl(server, tokens.write, "submit", "export", "/etc", str(out / "x"), check=False)
    assert outside.returncode == 2 and "outside the storage roots" in outside.stderr
    made = ckptctl(server, None, "token", "create", "--scope", "write", "--name", "ci")
    assert made.stdout.startswith("ckpt_") and "ci:write:sha256:" in made.stderr
