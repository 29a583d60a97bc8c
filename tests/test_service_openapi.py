"""The live server's /openapi.json is a valid OpenAPI document, and schemathesis (a bounded run against the
live server, with an admin token) finds no 5xx, no undocumented status and no response off its schema."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openapi_spec_validator import validate

from converters.formats import READERS

from .service_harness import Server, Tokens, make_server

pytestmark = pytest.mark.slow  # real FSDP samples, servers or containers: the full suite (CI), not the edit loop

MANAGE = {"/v1/checkpoints/{checkpoint_id}/tags", "/v1/checkpoints/{checkpoint_id}/managed", "/v1/aliases",
          "/v1/aliases/{namespace}/{name}", "/v1/aliases/{namespace}/{name}/history", "/v1/runs", "/v1/runs/{run}",
          "/v1/runs/{run}/latest", "/v1/runs/{run}/stats", "/v1/policies", "/v1/policies/{policy_id}", "/v1/gc",
          "/v1/deletions",
          "/v1/rules", "/v1/rules/{rule_id}", "/v1/rules/{rule_id}/pause", "/v1/rules/{rule_id}/resume",
          "/v1/rules/{rule_id}/triggers", "/v1/notify"}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Tokens]]:
    base = tmp_path_factory.mktemp("openapi")
    data = base / "roots"
    data.mkdir()
    tokens = Tokens.make()
    server = make_server(base / "state", read_roots=[data], write_roots=[data], workers=1, tokens=tokens.entries)
    yield server.start(), tokens
    server.stop()


def refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from refs(item)


def enums(node: Any) -> Iterator[list[Any]]:
    if isinstance(node, dict):
        if "enum" in node:
            yield node["enum"]
        for value in node.values():
            yield from enums(value)
    elif isinstance(node, list):
        for item in node:
            yield from enums(item)


def test_openapi_document_is_valid(served: tuple[Server, Tokens]) -> None:
    server, _ = served
    document = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    assert document["openapi"].startswith("3.1")
    for ref in set(refs(document)):  # every reference resolves
        node: Any = document
        for part in ref.removeprefix("#/").split("/"):
            node = node[part]
    assert {"/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/cancel", "/v1/jobs/{job_id}/events",
            "/v1/jobs/{job_id}/logs",
            "/v1/checkpoints", "/v1/checkpoints/{checkpoint_id}", "/v1/checkpoints/{checkpoint_id}/lineage",
            "/v1/checkpoints/{checkpoint_id}/stats", "/v1/checkpoints/{checkpoint_id}/integrity",
            "/healthz", "/readyz", "/metrics", "/v1/whoami", "/v1/audit", "/v1/session/config", "/v1/session/login",
            "/v1/session/callback", "/v1/session/handoff", "/v1/session/logout",
            "/v1/session/ended"} | MANAGE == set(document["paths"])
    post = document["paths"]["/v1/jobs"]["post"]
    assert {"202", "401", "403", "409", "422", "429"} <= set(post["responses"])
    assert document["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    options = document["components"]["schemas"]["JobOptions"]["properties"]
    assert list(READERS) in list(enums(options["source_format"]))  # the API's format names are the engine's
    validate(document)  # openapi-spec-validator is a test dependency: this always runs


def test_schemathesis_finds_no_server_errors(served: tuple[Server, Tokens], tmp_path: Path) -> None:
    server, tokens = served
    checks = "not_a_server_error,status_code_conformance,response_schema_conformance,content_type_conformance"
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{server.url}/openapi.json", "--max-examples", "20",
           "--checks", checks, "--request-timeout", "10", "--workers", "1", "--seed", "20240601",
           "-H", f"Authorization: Bearer {tokens.admin}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "5xx" not in proc.stdout
    with server.http() as http:
        assert http.get("/healthz").status_code == 200  # still serving


def test_docs_are_served_offline_under_a_strict_csp(served: tuple[Server, Tokens]) -> None:
    """/docs loads nothing from another origin (a CDN is a blank page air-gapped): every script and stylesheet
    it names is this server's and answers 200, the CSP allows no other origin, and no inline script is needed."""
    import re

    server, _ = served
    page = httpx.get(f"{server.url}/docs", timeout=15)
    assert page.status_code == 200
    urls = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert len(urls) >= 3 and re.search(r"<script>|<script [^>]*>[^<]+</script>|<style", page.text) is None
    for url in urls:
        assert url.startswith("/") and not url.startswith("//"), url
        asset = httpx.get(f"{server.url}{url}", timeout=15)
        assert asset.status_code == 200 and asset.content, url
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "style-src 'self'" in csp
    assert not re.search(r"https?:|\*|'unsafe-inline'", csp), csp
    init = httpx.get(f"{server.url}/docs/init.js", timeout=15)
    assert '"/openapi.json"' in init.text and init.headers["content-security-policy"] == csp
    assert httpx.get(f"{server.url}/redoc", timeout=15).status_code == 404
