"""OpenID Connect sign-in against the real `oidc-provider` npm package on loopback and a real `ckptctl serve`."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
import pytest
import torch
from cryptography.hazmat.primitives import serialization
from safetensors.torch import save_file

from ckpt_service.oidc import OidcConfig, OidcVerifier, fetch_json
from ckpt_service.service_errors import Unauthorized

from .oidc.provider import Client, Provider, private_jwk
from .service_harness import Server, Tokens, job_spec, make_server

pytestmark = pytest.mark.slow  # a node process and a server: the full suite (CI), not the edit loop

AUDIENCE = "urn:ckpt"
PIPELINE = Client("pipeline", "pipeline-secret", ["ml-writers"])
STRANGER = Client("stranger", "stranger-secret", ["marketing"])


@dataclass
class Site:
    provider: Provider
    server: Server
    tokens: Tokens
    source: Path
    keys: list[dict[str, Any]]


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    root = tmp_path_factory.mktemp("oidc")
    keys = [private_jwk("ES256", "ec-1"), private_jwk("RS256", "rs-1")]
    # provider 1 signs with the same keys under another issuer URL: its tokens differ only in `iss`
    provider = Provider(root, AUDIENCE, [PIPELINE, STRANGER]).start([keys, keys])
    source = root / "in" / "model.safetensors"
    source.parent.mkdir()
    save_file({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, str(source))
    tokens = Tokens.make()
    server = make_server(root / "data", read_roots=[source.parent], write_roots=[root / "data"], workers=1,
                         tokens=tokens.entries,
                         extra_env={"CKPT_OIDC_ISSUER": provider.issuer(0), "CKPT_OIDC_AUDIENCE": AUDIENCE,
                                    "CKPT_OIDC_GROUP_ROLES": json.dumps({"ml-writers": {"*": "write"}}),
                                    "CKPT_OIDC_LEEWAY_SECONDS": "1", "CKPT_OIDC_REFETCH_SECONDS": "0.5"})
    try:
        server.start()
        yield Site(provider, server, tokens, source, keys)
    finally:
        server.stop()
        provider.stop()


def refusal(site: Site, token: str, status: int = 401) -> str:
    with site.server.http(token) as http:
        reply = http.get("/v1/whoami")
    assert reply.status_code == status, reply.text
    message = reply.json()["error"]["message"]
    assert "\n" not in message
    return str(message)


def test_a_pipeline_token_submits_a_job_and_static_tokens_still_work(site: Site) -> None:
    token = site.provider.token(PIPELINE)
    assert jwt.get_unverified_header(token)["kid"] == "ec-1"
    with site.server.http(token) as http:
        me = http.get("/v1/whoami").json()
        assert (me["name"], me["scope"]) == ("oidc:pipeline", "write")
        reply = http.post("/v1/jobs", json=job_spec("inspect", site.source))
        assert reply.status_code == 202, reply.text
        job = site.server.wait_job(reply.json()["id"], ("succeeded", "failed"), token=token)
    assert job["state"] == "succeeded" and job["submitted_by"] == "oidc:pipeline"
    with site.server.http(site.tokens.write) as http:
        assert http.get("/v1/whoami").json()["name"] == "test-write"
        assert http.post("/v1/jobs", json=job_spec("inspect", site.source)).status_code == 202
    # a valid token whose groups map to no role
    assert refusal(site, site.provider.token(STRANGER), 403) == (
        "oidc:stranger has no group that CKPT_OIDC_GROUP_ROLES maps to a role (its 'groups' claim: ['marketing'])")


def test_expired_wrong_audience_and_wrong_issuer_tokens_are_refused(site: Site) -> None:
    short = site.provider.token(PIPELINE, f"{AUDIENCE}:short")  # lives 1 s; the server allows 1 s of skew
    assert refusal(site, site.provider.token(PIPELINE, "urn:other")) == (
        "token audience is not 'urn:ckpt' (CKPT_OIDC_AUDIENCE): request a token for this service")
    other = site.provider.token(PIPELINE, index=1)
    assert jwt.get_unverified_header(other)["kid"] == "ec-1"  # the same key: only `iss` differs
    assert refusal(site, other) == f"token issuer is not {site.provider.issuer(0)!r} (CKPT_OIDC_ISSUER)"
    time.sleep(max(0.0, jwt.decode(short, options={"verify_signature": False})["exp"] + 2.2 - time.time()))
    assert refusal(site, short) == "token expired: get a new one from the issuer"


def test_alg_none_hmac_with_the_public_key_and_tampering_are_refused(site: Site) -> None:
    token = site.provider.token(PIPELINE)
    head, body, signature = token.split(".")
    claims = json.loads(unb64(body))
    none = b64(json.dumps({"alg": "none", "typ": "at+jwt", "kid": "ec-1"}).encode())
    assert refusal(site, f"{none}.{body}.") == (
        "token algorithm 'none' refused: this server accepts RS256, ES256, PS256 (CKPT_OIDC_ALGORITHMS)")
    # HS256 keyed with the issuer's public RSA key, as published in its JWKS (the classic confusion attack)
    public = jwt.PyJWK({k: v for k, v in site.keys[1].items() if k in ("kty", "n", "e", "kid")}).key
    pem = public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    hs_head = b64(json.dumps({"alg": "HS256", "typ": "at+jwt", "kid": "rs-1"}).encode())
    mac = b64(hmac.new(pem, f"{hs_head}.{body}".encode(), hashlib.sha256).digest())
    assert refusal(site, f"{hs_head}.{body}.{mac}").startswith("token algorithm 'HS256' refused")
    # the claims changed (another group), the issuer's signature kept
    forged = b64(json.dumps({**claims, "groups": ["admins"]}).encode())
    assert refusal(site, f"{head}.{forged}.{signature}") == "token signature does not verify"
    flipped = bytearray(unb64(signature))
    flipped[5] ^= 1
    assert refusal(site, f"{head}.{body}.{b64(bytes(flipped))}") == "token signature does not verify"
    # an ES256 header on the RSA key
    es_head = b64(json.dumps({"alg": "ES256", "typ": "at+jwt", "kid": "rs-1"}).encode())
    assert refusal(site, f"{es_head}.{body}.{signature}") == "token algorithm ES256 does not fit key 'rs-1' (RSA)"
    assert refusal(site, "a.b.c") == "malformed bearer token: not a JWT and not a ckpt_ token"


def test_unknown_key_ids_refetch_the_jwks_at_most_once_per_interval(site: Site) -> None:
    clock = [0.0]
    verifier = OidcVerifier(OidcConfig(site.provider.issuer(0), AUDIENCE, refetch_seconds=10.0,
                                       group_roles=OidcConfig.roles_tuple({"ml-writers": {"*": "write"}})),
                            fetch_json, lambda: clock[0])
    assert verifier.principal(site.provider.token(PIPELINE)).name == "oidc:pipeline"
    _, body, signature = site.provider.token(PIPELINE).split(".")
    for n in range(5):
        made_up = b64(json.dumps({"alg": "ES256", "kid": f"nope-{n}"}).encode())
        with pytest.raises(Unauthorized, match=f"token signed with key 'nope-{n}', which the issuer's JWKS"):
            verifier.claims(f"{made_up}.{body}.{signature}")
    assert verifier.fetches == 1
    clock[0] = 10.0
    with pytest.raises(Unauthorized):
        verifier.claims(f"{made_up}.{body}.{signature}")
    assert verifier.fetches == 2


def test_a_rotated_signing_key_is_picked_up(site: Site) -> None:
    with site.server.http(site.provider.token(PIPELINE)) as http:
        assert http.get("/v1/whoami").status_code == 200  # the server holds the JWKS of ec-1 and rs-1
    rotated = [private_jwk("ES256", "ec-2"), *site.keys]  # the new key signs; the old ones still verify
    site.provider.start([rotated, site.keys])
    token = site.provider.token(PIPELINE)
    assert jwt.get_unverified_header(token)["kid"] == "ec-2"
    time.sleep(0.6)  # past the server's CKPT_OIDC_REFETCH_SECONDS
    with site.server.http(token) as http:
        me = http.get("/v1/whoami")
    assert me.status_code == 200, me.text
    assert me.json()["name"] == "oidc:pipeline"
