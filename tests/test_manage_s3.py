"""A rule and a policy over the loopback S3 server: DCP checkpoints uploaded one by one (one without its
`.metadata` first), each exported once to the bucket, then GC deletes the expected prefixes only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from .s3server import S3, s3_fixture, s3_server_fixture  # noqa: F401  (fixtures s3 and s3_server)
from .service_harness import make_server, wait_for

pytestmark = pytest.mark.slow  # a real server and S3 server: the full suite (CI), not the edit loop


def staged(tmp_path: Path, step: int) -> Path:
    torch.manual_seed(step)
    folder = tmp_path / "staging" / f"step_{step}"
    dcp.save({"w": torch.randn(16, 8), "b": torch.randn(16)}, checkpoint_id=str(folder))
    return folder


def test_rule_and_gc_over_s3(s3: S3, tmp_path: Path) -> None:
    runs, exports = s3.uri("runs"), s3.uri("exports")
    server = make_server(tmp_path / "data", read_roots=[runs, exports], write_roots=[runs, exports],  # type: ignore[list-item]
                         workers=1, extra_env={"CKPT_DISCOVER_SECONDS": "0.3"}).start()
    try:
        with server.http() as http:
            rule = {"name": "s3-export", "pattern": f"{runs}/*/step_*",
                    "job": {"kind": "export", "target": f"{exports}/{{run}}/{{step}}",
                            "options": {"dtype": "bfloat16"}}}
            assert http.post("/v1/rules", json=rule).status_code == 201

            def states() -> dict[str, str]:
                found = http.get("/v1/rules/s3-export/triggers").json()
                return {t["uri"].rsplit("/", 1)[-1]: t["state"] for t in found}

            s3.upload(staged(tmp_path, 1), "runs/r/step_1")
            second = staged(tmp_path, 2)
            s3.client.upload_file(str(next(second.glob("*.distcp"))), s3.bucket,
                                  f"runs/r/step_2/{next(second.glob('*.distcp')).name}")  # no .metadata yet
            s3.upload(staged(tmp_path, 3), "runs/r/step_3")
            wait_for(lambda: states().get("step_1") == states().get("step_3") == "done", 90, "steps 1 and 3",
                     interval=0.3)
            assert "step_2" not in states()
            s3.upload(second, "runs/r/step_2")
            wait_for(lambda: states().get("step_2") == "done", 90, "step 2", interval=0.3)
            assert states() == {"step_1": "done", "step_2": "done", "step_3": "done"}
            jobs = http.get("/v1/jobs", params={"kind": "export"}).json()["items"]
            assert sorted(j["spec"]["source"] for j in jobs) == [f"{runs}/r/step_{n}" for n in (1, 2, 3)]
            assert http.get("/v1/runs/r/latest").json()["step"] == 3

            assert http.post("/v1/policies", json={"name": "last1", "run": "r", "keep_last": 1}).status_code == 201
            dry = http.post("/v1/gc", json={"dry_run": True}).json()
            expected = sorted([f"{runs}/r/step_1", f"{runs}/r/step_2", f"{exports}/r/1", f"{exports}/r/2"])
            assert sorted(p["uri"] for p in dry["plan"]) == expected
            done = http.post("/v1/gc", json={"dry_run": False}).json()
            assert sorted(p["uri"] for p in done["plan"]) == expected and len(done["deleted"]) == 4
            assert s3.keys("runs/r/step_1") == s3.keys("runs/r/step_2") == s3.keys("exports/r/1") == []
            assert s3.keys("runs/r/step_3") == [".metadata", "__0_0.distcp"]
            assert "ckpt-manifest.json" in s3.keys("exports/r/3")
            log = http.get("/v1/deletions").json()
            assert sorted(d["uri"] for d in log) == expected and all(d["bytes"] > 0 for d in log)
    finally:
        server.stop()
