"""Tokens (401/403), storage-root escapes refused before queueing (403), queue limit (429), body limit (413),
and error bodies that never echo secrets. One API-only server (no job slots), so queued jobs stay queued."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from .service_harness import Server, Tokens, job_spec, make_server

pytestmark = pytest.mark.slow  # real FSDP samples, servers or containers: the full suite (CI), not the edit loop


@dataclass
class Env:
    server: Server
    tokens: Tokens
    source: Path  # a real checkpoint inside the read root
    read_root: Path
    write_root: Path
    outside: Path  # a real checkpoint outside every root


@pytest.fixture(scope="module")
def env(fsdp2: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    base = tmp_path_factory.mktemp("security")
    read_root, write_root = base / "data", base / "out"
    read_root.mkdir()
    write_root.mkdir()
    sample = fsdp2["fsdp2-dcp"].path
    source = read_root / "ckpt"
    os.symlink(sample, source)  # a link inside the root to a real checkpoint: the realpath is outside
    real_inside = read_root / "real"
    real_inside.mkdir()
    for item in sample.iterdir():
        (real_inside / item.name).write_bytes(item.read_bytes())
    (base / "data-other").mkdir()
    tokens = Tokens.make()
    server = make_server(base / "state", read_roots=[read_root], write_roots=[write_root], workers=0,
                         tokens=tokens.entries, extra_env={"CKPT_QUEUE_LIMIT": "2", "CKPT_MAX_REQUEST_BYTES": "8192"})
    yield Env(server.start(), tokens, real_inside, read_root, write_root, sample)
    server.stop()


def job_count(env: Env) -> int:
    with env.server.http(env.tokens.read) as http:
        return len(http.get("/v1/jobs", params={"limit": 200}).json()["items"])


def test_tokens_and_scopes(env: Env) -> None:
    spec = job_spec("inspect", env.source)
    with env.server.http() as anonymous:
        missing = anonymous.get("/v1/jobs")
        assert missing.status_code == 401 and missing.headers["WWW-Authenticate"] == "Bearer"
        assert anonymous.post("/v1/jobs", json=spec).status_code == 401
        assert anonymous.get("/healthz").status_code == 200 and anonymous.get("/readyz").status_code == 200
        assert anonymous.get("/metrics").status_code == 200  # public by default (CKPT_METRICS_PUBLIC)
        malformed = anonymous.get("/v1/jobs", headers={"Authorization": "Basic dXNlcjpwYXNz"})
        assert malformed.status_code == 401
    secret = "ckpt_" + "x" * 43
    with env.server.http(secret) as wrong:
        refused = wrong.get("/v1/jobs")
        assert refused.status_code == 401 and secret not in refused.text
    with env.server.http(env.tokens.read) as reader:
        assert reader.get("/v1/jobs").status_code == 200
        forbidden = reader.post("/v1/jobs", json=spec)
        assert forbidden.status_code == 403 and forbidden.json()["error"]["type"] == "forbidden"
        assert "write" in forbidden.json()["error"]["message"]
        assert env.tokens.read not in forbidden.text
        assert reader.post("/v1/checkpoints", json={"uri": str(env.source)}).status_code == 403
    with env.server.http(env.tokens.write) as writer:
        registered = writer.post("/v1/checkpoints", json={"uri": str(env.source), "tags": ["t"]})
        assert registered.status_code == 201, registered.text
        purge = writer.delete(f"/v1/checkpoints/{registered.json()['id']}", params={"purge": "true"})
        assert purge.status_code == 403  # deleting data needs admin
        assert writer.delete(f"/v1/checkpoints/{registered.json()['id']}").status_code == 200
    assert env.source.exists()


def test_storage_root_escapes_are_refused_before_queueing(env: Env) -> None:
    root, out = env.read_root, env.write_root
    escapes = [
        ("source", job_spec("inspect", f"{root}/../../{env.outside.relative_to(env.outside.parents[1])}")),
        ("source", job_spec("inspect", f"{root}/real/../../{root.name}/real")),  # '..' even when it lands inside
        ("source", job_spec("inspect", str(env.outside))),  # an absolute path elsewhere
        ("source", job_spec("inspect", f"file://{env.outside}")),
        ("source", job_spec("inspect", str(root / "ckpt"))),  # a symlink out of the root
        ("source", job_spec("inspect", str(root.parent / "data-other"))),  # sibling with the root as prefix
        ("source", job_spec("inspect", "s3://some-bucket/ckpt")),  # a bucket nobody configured
        ("target", job_spec("export", env.source, root.parent / "out-other" / "x")),  # sibling prefix
        ("target", job_spec("export", env.source, root / "exported")),  # readable is not writable
        ("target", job_spec("export", env.source, out)),  # the write root itself
        ("target", job_spec("export", env.source, f"{out}/../escape")),
    ]
    before = job_count(env)
    with env.server.http(env.tokens.admin) as http:
        for field, spec in escapes:
            response = http.post("/v1/jobs", json=spec)
            assert response.status_code == 403, (spec, response.text)
            error = response.json()["error"]
            assert error["type"] == "outside_storage_roots" and error["fields"][0]["field"] == field, (spec, error)
        link_out = http.post("/v1/checkpoints", json={"uri": str(root / "ckpt")})
        assert link_out.status_code == 403
    assert job_count(env) == before  # nothing was queued


def test_queue_full_is_429_and_body_limit_is_413(env: Env) -> None:
    with env.server.http(env.tokens.write) as http:
        queued = len(http.get("/v1/jobs", params={"state": "queued"}).json()["items"])
        statuses = [http.post("/v1/jobs", json=job_spec("inspect", env.source)).status_code
                    for _ in range(3 - queued)]
        assert statuses[:2 - queued] == [202] * (2 - queued)
        full = http.post("/v1/jobs", json=job_spec("inspect", env.source))
        assert full.status_code == 429 and full.headers["Retry-After"].isdigit()
        assert full.json()["error"]["type"] == "queue_full"
        huge = job_spec("export", env.source, env.write_root / "x", include=["*"] * 2000)
        too_big = http.post("/v1/jobs", content=json.dumps(huge), headers={"Content-Type": "application/json"})
        assert too_big.status_code == 413
        for job in http.get("/v1/jobs", params={"state": "queued"}).json()["items"]:
            assert http.post(f"/v1/jobs/{job['id']}/cancel").json()["state"] == "cancelled"
        assert http.post("/v1/jobs", json=job_spec("inspect", env.source)).status_code == 202


def test_error_bodies_carry_no_internals(env: Env) -> None:
    with env.server.http(env.tokens.write) as http:
        bad_json = http.post("/v1/jobs", content=b'{"kind": "export", "source": ', headers={
            "Content-Type": "application/json"})
        assert bad_json.status_code == 422
        assert "Traceback" not in bad_json.text
        with_input = http.post("/v1/jobs", json={"kind": "export", "source": "hunter2-secret" * 3, "bogus": 1})
        assert with_input.status_code == 422 and "hunter2" not in with_input.text  # inputs are not echoed
        missing = http.get("/v1/jobs/job_doesnotexist")
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found"
        unknown = http.get("/v2/anything")
        assert unknown.status_code == 404 and set(unknown.json()) == {"error"}
