"""End to end through a real `ckptctl serve`: submit, follow events, verify outputs, registry and lineage,
idempotency, paging, validation and metrics (callbacks: test_service_hardening.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from converters import verify
from converters.transforms import KeyOptions

from .pg_server import STORES, store_env
from .service_harness import Server, Tokens, job_spec, make_server

pytestmark = pytest.mark.slow  # real FSDP samples, servers or containers: the full suite (CI), not the edit loop


@pytest.fixture(scope="module", params=STORES)
def env(request: pytest.FixtureRequest, fsdp2: dict, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[tuple[Server, Tokens, Path, Path]]:
    tokens = Tokens.make()
    source = fsdp2["fsdp2-dcp"].path
    out = tmp_path_factory.mktemp("jobs-out")
    server = make_server(tmp_path_factory.mktemp("jobs-data"), read_roots=[source.parent], write_roots=[out],
                         tokens=tokens.entries, extra_env=store_env(request)).start()
    yield server, tokens, source, out
    server.stop()


def test_export_follow_events_then_verify_and_lineage(env: tuple[Server, Tokens, Path, Path]) -> None:
    server, tokens, source, out = env
    target = out / "export"
    with server.client(tokens.write) as client:
        job = client.submit(job_spec("export", source, target))
        assert job["state"] in ("queued", "running") and job["kind"] == "export"
        events = []
        final = client.wait(job["id"], lambda event, data: events.append((event, data)), timeout=60)
    names = [e for e, _ in events]
    assert names[0] == "state" and names[-1] == "end"
    assert [d["state"] for e, d in events if e == "state"][-1] == "succeeded"
    assert final["state"] == "succeeded" and final["attempt"] == 1 and final["error"] is None
    progress = final["progress"]
    assert progress["done_bytes"] == progress["total_bytes"] > 0
    assert progress["done_tensors"] == progress["total_tensors"] > 0
    assert final["result"]["total_bytes"] == (target / "model.safetensors").stat().st_size
    assert final["started_at"] and final["finished_at"] >= final["started_at"]

    report = verify(str(source), str(target), keys=KeyOptions(only="model", nest=False))
    assert report.ok, report.summary()

    checkpoint_id = final["result"]["checkpoint_id"]
    with server.client(tokens.read) as client:
        output = client.checkpoint(checkpoint_id)
        assert output["uri"] == str(target.resolve()) and output["made_by_job"] == job["id"]
        assert output["format"] == "safetensors" and output["has_optimizer"] is False
        up = client.lineage(checkpoint_id)
        assert [(e["checkpoint"]["uri"], e["job_id"], e["depth"]) for e in up["ancestors"]] == [
            (str(source.resolve()), job["id"], 1)]
        down = client.lineage(up["ancestors"][0]["checkpoint"]["id"])
        assert checkpoint_id in [e["checkpoint"]["id"] for e in down["descendants"]]
        assert down["ancestors"] == []
        with_tensors = client.checkpoint(checkpoint_id, tensors=True)
        assert len(with_tensors["summary"]["tensor_table"]) == output["tensors"]


def test_idempotent_retry_returns_the_same_job(env: tuple[Server, Tokens, Path, Path]) -> None:
    server, tokens, source, _out = env
    spec = job_spec("inspect", source)
    with server.http(tokens.write) as http:
        first = http.post("/v1/jobs", json=spec, headers={"Idempotency-Key": "pipeline-step-2000"})
        again = http.post("/v1/jobs", json=spec, headers={"Idempotency-Key": "pipeline-step-2000"})
        assert first.status_code == again.status_code == 202
        assert again.json()["id"] == first.json()["id"]
        assert again.headers["Idempotent-Replayed"] == "true" and "Idempotent-Replayed" not in first.headers
        other = http.post("/v1/jobs", json=job_spec("inspect", source, tensors=True),
                          headers={"Idempotency-Key": "pipeline-step-2000"})
        assert other.status_code == 409 and other.json()["error"]["type"] == "conflict"
        fresh = http.post("/v1/jobs", json=spec, headers={"Idempotency-Key": "another"})
        assert fresh.json()["id"] != first.json()["id"]
    done = server.wait_job(first.json()["id"], ("succeeded",), token=tokens.read)
    assert done["result"]["format"] == "dcp" and done["result"]["world_size"] == 2


def test_verify_jobs_report_same_and_different(env: tuple[Server, Tokens, Path, Path], fsdp2: dict) -> None:
    server, tokens, source, _ = env
    same_model = fsdp2["safetensors"].path
    with server.client(tokens.write) as client:
        same = client.submit(job_spec("verify", source, same_model, only="model"))
        differ = client.submit(job_spec("verify", source, same_model, only="all"))
        same = client.wait(same["id"], timeout=60)
        differ = client.wait(differ["id"], timeout=60)
    assert same["state"] == "succeeded" and same["result"]["ok"] is True
    assert differ["state"] == "failed" and differ["error"]["type"] == "VerifyError"
    assert differ["result"]["missing"], differ["result"]


def test_list_pages_and_filters(env: tuple[Server, Tokens, Path, Path]) -> None:
    server, tokens, source, _ = env
    with server.client(tokens.write) as client:
        ids = [client.submit(job_spec("inspect", source))["id"] for _ in range(3)]
        for job_id in ids:
            client.wait(job_id, timeout=60)
        first = client.jobs(kind="inspect", limit=2)
        second = client.jobs(kind="inspect", limit=2, cursor=first["next_cursor"])
        assert [j["id"] for j in first["items"]] == ids[::-1][:2]
        assert second["items"][0]["id"] == ids[0]
        assert all(j["kind"] == "inspect" for j in first["items"] + second["items"])
        assert client.jobs(state="running")["items"] == []


def test_validation_errors_name_the_field(env: tuple[Server, Tokens, Path, Path]) -> None:
    server, tokens, source, out = env
    cases = [
        (job_spec("export", source, out / "a", world_size=4), 422, "options.world_size"),
        (job_spec("export", source, out / "a", dtype="int8"), 422, "options.dtype"),
        (job_spec("export", source, out / "a", memory_limit="lots"), 422, "options.memory_limit"),
        (job_spec("reshard", source, out / "a"), 422, "options.world_size"),
        (job_spec("export", source), 422, "target"),
        ({"kind": "explode", "source": str(source)}, 422, "kind"),
        (job_spec("export", source, out / "a", rename=["(unclosed=x"]), 422, "options.rename"),
        (job_spec("export", "relative/path", out / "a"), 422, "source"),
    ]
    with server.http(tokens.write) as http:
        for spec, status, field in cases:
            response = http.post("/v1/jobs", json=spec)
            assert response.status_code == status, (spec, response.text)
            error = response.json()["error"]
            assert field in [f["field"] for f in error["fields"]], (spec, error)
        (out / "exists").mkdir()
        taken = http.post("/v1/jobs", json=job_spec("export", source, out / "exists"))
        assert taken.status_code == 409 and "overwrite" in taken.json()["error"]["message"]
        unknown_option = http.post("/v1/jobs", json=job_spec("export", source, out / "b", bogus=1))
        assert unknown_option.status_code == 422  # the overlap rule is tested in-process (test_requests.py)
        assert [f["field"] for f in unknown_option.json()["error"]["fields"]] == ["options.bogus"]


def test_health_ready_and_metrics(env: tuple[Server, Tokens, Path, Path]) -> None:
    server, _tokens, _, _ = env
    with server.http() as http:
        assert http.get("/healthz").json() == {"status": "ok"}
        ready = http.get("/readyz")
        assert ready.status_code == 200 and ready.json()["checks"]["workers"]["alive"] is True
        database = "postgresql" if "CKPT_DATABASE_URL" in server.env else "sqlite"
        assert (ready.json()["checks"]["database"], ready.json()["checks"]["store"]) == (database, "ok")
        metrics = http.get("/metrics")
    assert metrics.status_code == 200
    text = metrics.text
    for name in ('ckpt_jobs{state="succeeded"}', "ckpt_queue_depth", "ckpt_workers_busy", "ckpt_worker_slots 2.0",
                 "ckpt_job_duration_seconds_bucket", "ckpt_job_bytes_bucket", "ckpt_http_requests_total"):
        assert name in text, name
    events = [e for e in server.log_events() if e.get("job_id")]
    assert {"job.claimed", "job.started", "job.succeeded"} <= {e["event"] for e in events}


def test_delete_and_purge_need_the_right_root_and_scope(env: tuple[Server, Tokens, Path, Path]) -> None:
    server, tokens, source, out = env
    target = out / "purge-me"
    with server.client(tokens.write) as client:
        done = client.wait(client.submit(job_spec("export", source, target))["id"], timeout=60)
    checkpoint_id = done["result"]["checkpoint_id"]
    with server.http(tokens.admin) as http:
        source_id = http.get(f"/v1/checkpoints/{checkpoint_id}/lineage").json()["ancestors"][0]["checkpoint"]["id"]
        outside = http.delete(f"/v1/checkpoints/{source_id}", params={"purge": "true"})
        assert outside.status_code == 403 and source.exists()  # the source is readable, not writable
        purged = http.delete(f"/v1/checkpoints/{checkpoint_id}", params={"purge": "true"})
        assert purged.status_code == 200 and not target.exists()
        assert http.get(f"/v1/checkpoints/{checkpoint_id}").json()["deleted_at"] is not None  # the entry says so
        assert http.get(f"/v1/checkpoints/{source_id}/lineage").status_code == 200
