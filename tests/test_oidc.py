"""OpenID Connect sign-in against the real `oidc-provider` npm package on loopback and a real `ckptctl serve`."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
import torch
from cryptography.hazmat.primitives import serialization
from safetensors.torch import save_file

from ckpt_service.oidc import OidcConfig, OidcVerifier, fetch_json
from ckpt_service.service_errors import Unauthorized

from .oidc.provider import Client, Provider, private_jwk, sign_in
from .service_harness import Server, Tokens, job_spec, make_server

pytestmark = pytest.mark.slow  # a node process and a server: the full suite (CI), not the edit loop

AUDIENCE = "urn:ckpt"
PIPELINE = Client("pipeline", "pipeline-secret", ["ml-writers"])
STRANGER = Client("stranger", "stranger-secret", ["marketing"])
TEAM_A = Client("team-a-ci", "a-secret", ["team-a", "team-a-leads"])
TEAM_B = Client("team-b-ci", "b-secret", ["team-b", "marketing"])
ADMIN = Client("platform", "admin-secret", ["platform-admins"])


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
    source = root / "in" / "model.safetensors"
    source.parent.mkdir()
    save_file({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, str(source))
    tokens = Tokens.make()
    server = make_server(root / "data", read_roots=[source.parent], write_roots=[root / "data"], workers=1,
                         tokens=tokens.entries)
    dashboard = Client("dashboard", "", [], [f"{server.url}/v1/session/callback"],
                       [f"{server.url}/v1/session/ended"])
    # provider 1 signs with the same keys under another issuer URL: its tokens differ only in `iss`
    provider = Provider(root, AUDIENCE, [PIPELINE, STRANGER, TEAM_A, TEAM_B, ADMIN, dashboard],
                        users={"alice": ["ml-writers"], "mallory": ["marketing"]}).start([keys, keys])
    server.env.update({"CKPT_OIDC_ISSUER": provider.issuer(0), "CKPT_OIDC_AUDIENCE": AUDIENCE,
                       "CKPT_OIDC_GROUP_ROLES": json.dumps({"ml-writers": {"*": "write"}}),
                       "CKPT_OIDC_CLIENT_ID": "dashboard",
                       "CKPT_OIDC_LEEWAY_SECONDS": "1", "CKPT_OIDC_REFETCH_SECONDS": "0.5"})
    try:
        server.start()
        yield Site(provider, server, tokens, source, keys)
    finally:
        server.stop()
        provider.stop()


@dataclass
class Teams:
    server: Server
    shared: Path
    a: Path
    b: Path


@pytest.fixture(scope="module")
def teams(site: Site, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Teams]:
    """Team A writes root a (its leads administer it) and reads the shared root, team B likewise with root b;
    platform admins do all."""
    root = tmp_path_factory.mktemp("teams")
    shared, a, b = root / "shared", root / "a", root / "b"
    for folder in (shared, a, b):
        folder.mkdir()
        save_file({"w": torch.ones(2, 2)}, str(folder / "model.safetensors"))
    roles = {"team-a": {str(a): "write", str(shared): "read"}, "team-a-leads": {str(a): "admin"},
             "team-b": {str(b): "write", str(shared): "read"},
             "platform-admins": {"*": "admin"}}
    server = make_server(root / "data", read_roots=[shared], write_roots=[a, b], workers=1,
                         extra_env={"CKPT_OIDC_ISSUER": site.provider.issuer(0), "CKPT_OIDC_AUDIENCE": AUDIENCE,
                                    "CKPT_OIDC_GROUP_ROLES": json.dumps(roles)})
    try:
        server.start()
        yield Teams(server, shared, a, b)
    finally:
        server.stop()


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


def test_a_person_signs_in_with_the_authorization_code_flow_and_pkce(site: Site) -> None:
    with site.server.http() as http:
        assert http.get("/v1/session/config").json() == {"sso": True}
        with httpx.Client(timeout=15.0) as browser:
            done = sign_in(browser, f"{site.server.url}/v1/session/login", "alice")
            assert done.status_code == 303, done.text
            location = done.headers["location"]
            assert location.startswith("/#/sso/") and "." not in location  # a handoff id, never the token
            handoff = location.removeprefix("/#/sso/")
            first = http.post("/v1/session/handoff", json={"handoff": handoff})
            assert first.status_code == 200, first.text
            assert (first.json()["name"], first.json()["expires_in"]) == ("oidc:alice", 300)
            again = http.post("/v1/session/handoff", json={"handoff": handoff})  # one use only
            assert again.status_code == 401
            assert again.json()["error"]["message"] == (
                "sign-in handoff unknown, used or expired (60 s): sign in again")
            token = first.json()["access_token"]
            me = http.get("/v1/whoami", headers={"Authorization": f"Bearer {token}"}).json()
            assert (me["name"], me["scope"]) == ("oidc:alice", "write")
            assert (me["groups"], me["roots"]) == (["ml-writers"], [
                {"root": "*", "role": "write", "groups": ["ml-writers"]}])
            # signing out: the issuer's end_session_endpoint with the ID token as hint, back to the dashboard
            id_token = first.json()["id_token"]
            assert jwt.decode(id_token, options={"verify_signature": False})["sub"] == "alice"
            logout = http.post("/v1/session/logout", json={"id_token_hint": id_token}).json()["url"]
            end = httpx.URL(logout)
            assert str(end.copy_with(query=None)) == f"{site.provider.issuer(0)}/session/end"
            assert dict(end.params) == {"client_id": "dashboard", "id_token_hint": id_token,
                                        "post_logout_redirect_uri": f"{site.server.url}/v1/session/ended"}
            back = http.get("/v1/session/ended")
            assert (back.status_code, back.headers["location"]) == (303, "/#/jobs")
        # a person whose groups map to no role is refused at the callback, in one line (a fresh browser: the
        # provider remembers alice's session)
        with httpx.Client(timeout=15.0) as browser:
            refused = sign_in(browser, f"{site.server.url}/v1/session/login", "mallory")
            assert refused.status_code == 403
            assert refused.json()["error"]["message"].startswith("oidc:mallory has no group that")
            # a forged or replayed state is refused
            stale = http.get("/v1/session/callback", params={"code": "x", "state": "made-up"})
            assert stale.status_code == 422
            assert stale.json()["error"]["message"] == (
                "sign-in state unknown or expired (over 10 minutes, or already used): sign in again")


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


def test_two_teams_see_and_change_only_their_roots_and_an_admin_sees_all(site: Site, teams: Teams) -> None:
    http = {c.client_id: teams.server.http(site.provider.token(c)) for c in (TEAM_A, TEAM_B, ADMIN)}
    a, b, admin = http["team-a-ci"], http["team-b-ci"], http["platform"]
    try:
        def refused(reply: Any) -> str:
            assert reply.status_code == 403, reply.text
            message = reply.json()["error"]["message"]
            assert "\n" not in message
            return str(message)

        # jobs: read the shared root and one's own, write only one's own
        job_a = a.post("/v1/jobs", json=job_spec("convert", teams.shared / "model.safetensors",
                                                 teams.a / "out.safetensors"))
        assert job_a.status_code == 202, job_a.text
        assert refused(a.post("/v1/jobs", json=job_spec("convert", teams.shared / "model.safetensors",
                                                        teams.b / "out.safetensors"))) == (
            f"target: oidc:team-a-ci may not write {teams.b}/out.safetensors (its groups give no role there; "
            "CKPT_OIDC_GROUP_ROLES maps groups to roots)")
        assert refused(b.post("/v1/jobs", json=job_spec("inspect", teams.a / "model.safetensors"))) == (
            f"source: oidc:team-b-ci may not read {teams.a}/model.safetensors (its groups give no role there; "
            "CKPT_OIDC_GROUP_ROLES maps groups to roots)")
        job_b = b.post("/v1/jobs", json=job_spec("inspect", teams.b / "model.safetensors")).json()
        job_id = job_a.json()["id"]
        assert teams.server.wait_job(job_id, ("succeeded",), token=site.provider.token(ADMIN))["state"] == "succeeded"
        assert [j["id"] for j in a.get("/v1/jobs").json()["items"]] == [job_id]
        assert [j["id"] for j in b.get("/v1/jobs").json()["items"]] == [job_b["id"]]
        assert {j["id"] for j in admin.get("/v1/jobs").json()["items"]} == {job_id, job_b["id"]}
        assert refused(b.get(f"/v1/jobs/{job_id}")).startswith(f"job {job_id}: oidc:team-b-ci may not read ")
        assert refused(b.post(f"/v1/jobs/{job_id}/cancel")).startswith(f"job {job_id}: oidc:team-b-ci may not write ")
        # checkpoints: registered into one's own root; listings show what one may read
        ca = a.post("/v1/checkpoints", json={"uri": str(teams.a / "model.safetensors"), "name": "ma"})
        cb = b.post("/v1/checkpoints", json={"uri": str(teams.b / "model.safetensors"), "name": "mb"})
        assert (ca.status_code, cb.status_code) == (201, 201), (ca.text, cb.text)
        ida = ca.json()["id"]
        assert refused(b.post("/v1/checkpoints", json={"uri": str(teams.a / "model.safetensors")})).startswith(
            "uri: oidc:team-b-ci may not write ")
        assert refused(a.post("/v1/checkpoints", json={"uri": str(teams.shared / "model.safetensors")})) == (
            f"uri: oidc:team-a-ci may not write {teams.shared}/model.safetensors (its groups give read there; "
            "CKPT_OIDC_GROUP_ROLES maps groups to roots)")
        # the convert job registered its source (shared) and its output (in a) as a lineage pair
        shared, out = str(teams.shared / "model.safetensors"), str(teams.a / "out.safetensors")
        listed = {name: {c["uri"] for c in client.get("/v1/checkpoints").json()["items"]}
                  for name, client in http.items()}
        assert listed["team-a-ci"] == {shared, out, ca.json()["uri"]}
        assert listed["team-b-ci"] == {shared, cb.json()["uri"]}
        assert listed["platform"] == {shared, out, ca.json()["uri"], cb.json()["uri"]}
        assert refused(b.get(f"/v1/checkpoints/{ida}")).startswith(f"checkpoint {ida}: oidc:team-b-ci may not read")
        assert a.get(f"/v1/checkpoints/{cb.json()['id']}").status_code == 403
        assert refused(b.delete(f"/v1/checkpoints/{ida}")).startswith(f"checkpoint {ida}: oidc:team-b-ci may not")
        # tags and aliases follow the checkpoint's root
        assert refused(b.post(f"/v1/checkpoints/{ida}/tags", json={"set": {"stage": "x"}})).startswith(
            f"checkpoint {ida}: oidc:team-b-ci may not write")
        assert a.put("/v1/aliases/team-a/prod", json={"checkpoint_id": ida}).status_code == 200
        assert refused(b.put("/v1/aliases/team-b/prod", json={"checkpoint_id": ida})).startswith(
            f"checkpoint {ida}: oidc:team-b-ci may not write")
        assert refused(b.delete("/v1/aliases/team-a/prod")).startswith(f"checkpoint {ida}: oidc:team-b-ci may not")
        assert [x["name"] for x in a.get("/v1/aliases").json()] == ["prod"]
        assert b.get("/v1/aliases").json() == []
        assert refused(b.get("/v1/aliases/team-a/prod")).startswith("alias prod@team-a: oidc:team-b-ci may not read")
        # rules: a pattern one may read, a target one may write
        rule = {"name": "a-exports", "pattern": f"{teams.a}/runs/*/step_*",
                "job": {"kind": "convert", "target": f"{teams.a}/exports/{{run}}/{{step}}"}}
        added = a.post("/v1/rules", json=rule)
        assert added.status_code == 201, added.text
        assert refused(b.post("/v1/rules", json={**rule, "name": "b-steals"})).startswith(
            "rule b-steals pattern: oidc:team-b-ci may not read ")
        assert [r["spec"]["name"] for r in a.get("/v1/rules").json()] == ["a-exports"]
        assert b.get("/v1/rules").json() == []
        assert [r["spec"]["name"] for r in admin.get("/v1/rules").json()] == ["a-exports"]
        assert refused(b.post("/v1/rules/a-exports/pause")).startswith("rule a-exports pattern: oidc:team-b-ci")
        # service-wide admin routes need admin of every root
        assert refused(a.post("/v1/gc", json={"dry_run": False})) == (
            "oidc:team-a-ci is admin of some roots only; this needs admin of every root (\"*\" in "
            "CKPT_OIDC_GROUP_ROLES)")
        assert refused(b.post("/v1/gc", json={"dry_run": True})) == (
            "oidc:team-b-ci may read some roots only; a GC plan covers every root (read of \"*\" in "
            "CKPT_OIDC_GROUP_ROLES)")
        assert admin.post("/v1/gc", json={"dry_run": True}).status_code == 200
        assert admin.get("/v1/policies").status_code == 200
    finally:
        for client in http.values():
            client.close()


def test_whoami_lineage_alias_history_rules_and_pages_show_only_readable_roots(site: Site, teams: Teams) -> None:
    """Responses that embed other checkpoints and jobs leave out those under roots the caller may not read;
    listings are filtered in the store query, so every page is full."""
    http = {c.client_id: teams.server.http(site.provider.token(c)) for c in (TEAM_A, TEAM_B, ADMIN)}
    a, b, admin = http["team-a-ci"], http["team-b-ci"], http["platform"]
    try:
        # whoami: the groups and, per root, the strongest role and the groups that give it
        me = a.get("/v1/whoami").json()
        assert (me["name"], me["scope"], me["groups"]) == ("oidc:team-a-ci", "admin", ["team-a", "team-a-leads"])
        assert me["roots"] == [{"root": str(teams.a), "role": "admin", "groups": ["team-a-leads"]},
                               {"root": str(teams.shared), "role": "read", "groups": ["team-a"]}]
        assert admin.get("/v1/whoami").json()["roots"] == [{"root": "*", "role": "admin",
                                                            "groups": ["platform-admins"]}]
        with site.server.http(site.tokens.read) as static:
            mine = static.get("/v1/whoami").json()
            assert (mine["groups"], mine["roots"]) == ([], [{"root": "*", "role": "read", "groups": []}])
        # one shared checkpoint, converted by each team into its own root
        source = teams.shared / "lineage.safetensors"
        save_file({"w": torch.arange(4, dtype=torch.float32)}, str(source))
        shared = admin.post("/v1/checkpoints", json={"uri": str(source), "name": "lineage-src"})
        assert shared.status_code == 201, shared.text
        made = {}
        for name, client, folder in (("a", a, teams.a), ("b", b, teams.b)):
            job = client.post("/v1/jobs", json=job_spec("convert", source, folder / "lineage-out.safetensors"))
            assert job.status_code == 202, job.text
            made[name] = teams.server.wait_job(job.json()["id"], ("succeeded",), token=site.provider.token(ADMIN))
        out = {name: str(folder / "lineage-out.safetensors") for name, folder in (("a", teams.a), ("b", teams.b))}

        def lineage(client: httpx.Client) -> tuple[list[tuple[str, str | None]], int]:
            found = client.get(f"/v1/checkpoints/{shared.json()['id']}/lineage").json()
            assert found["ancestors"] == []
            return sorted((e["checkpoint"]["uri"], e["job_id"]) for e in found["descendants"]), found["hidden"]

        assert lineage(a) == ([(out["a"], made["a"]["id"])], 1)
        assert lineage(b) == ([(out["b"], made["b"]["id"])], 1)
        assert lineage(admin) == (sorted([(out["a"], made["a"]["id"]), (out["b"], made["b"]["id"])]), 0)
        ids = {name: admin.get("/v1/checkpoints", params={"limit": 200}).json()["items"] for name in ("all",)}["all"]
        by_uri = {c["uri"]: c["id"] for c in ids}
        child = b.get(f"/v1/checkpoints/{by_uri[out['b']]}/lineage").json()
        assert ([e["checkpoint"]["uri"] for e in child["ancestors"]], child["hidden"]) == ([str(source)], 0)
        # alias history: a move to or from another team's checkpoint is left out
        assert a.put("/v1/aliases/team-a/lineage", json={"checkpoint_id": by_uri[out["a"]]}).status_code == 200
        for target in (out["b"], out["a"]):
            moved = admin.put("/v1/aliases/team-a/lineage", json={"checkpoint_id": by_uri[target]})
            assert moved.status_code == 200, moved.text
        moves = [(m["previous_id"], m["checkpoint_id"]) for m in admin.get("/v1/aliases/team-a/lineage/history").json()]
        assert moves == [(None, by_uri[out["a"]]), (by_uri[out["a"]], by_uri[out["b"]]),
                         (by_uri[out["b"]], by_uri[out["a"]])]
        assert [(m["previous_id"], m["checkpoint_id"]) for m in a.get("/v1/aliases/team-a/lineage/history").json()
                ] == moves[:1]
        # a rule watching the shared root but writing into team A's is team A's alone
        rule = {"name": "shared-to-a", "pattern": f"{teams.shared}/runs/*/step_*",
                "job": {"kind": "convert", "target": f"{teams.a}/from-shared/{{run}}/{{step}}"}}
        assert a.post("/v1/rules", json=rule).status_code == 201
        assert "shared-to-a" in [r["spec"]["name"] for r in a.get("/v1/rules").json()]
        assert "shared-to-a" not in [r["spec"]["name"] for r in b.get("/v1/rules").json()]
        refused = b.get("/v1/rules/shared-to-a")
        assert refused.status_code == 403 and refused.json()["error"]["message"] == (
            f"rule shared-to-a job.target: oidc:team-b-ci may not read {teams.a}/from-shared/run/1 (its groups give "
            "no role there; CKPT_OIDC_GROUP_ROLES maps groups to roots)")
        # pages of one: each holds one of the caller's checkpoints (and jobs), none comes back empty
        for client in (a, b):
            assert client.post("/v1/jobs", json=job_spec("inspect", source)).status_code == 202
            for path, key in (("/v1/checkpoints", "uri"), ("/v1/jobs", "id")):
                everything = [item[key] for item in client.get(path, params={"limit": 200}).json()["items"]]
                paged, cursor = [], None
                while True:
                    page = client.get(path, params={"limit": 1, **({"cursor": cursor} if cursor else {})}).json()
                    assert len(page["items"]) == 1, (path, page)
                    paged.append(page["items"][0][key])
                    cursor = page["next_cursor"]
                    if cursor is None:
                        break
                assert paged == everything and len(everything) >= 2
    finally:
        for client in http.values():
            client.close()


@contextmanager
def browser_page(url: str) -> Iterator[tuple[Any, list[str]]]:
    """A page of Debian's chromium (headless, driven by Playwright) opened at `url`, and the script errors it
    raises."""
    chromium_path = Path("/usr/bin/chromium")
    if not chromium_path.exists():
        pytest.fail("/usr/bin/chromium is missing: install Debian's chromium (.ci/run does) for the browser tests")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(chromium_path), args=["--no-sandbox",
                                              "--disable-gpu", "--disable-background-networking", "--no-first-run"])
        try:
            page = chromium.new_context().new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.set_default_timeout(20_000)
            page.goto(url)
            yield page, errors
        finally:
            chromium.close()


def test_the_dashboard_signs_in_through_the_issuer_in_a_real_browser(site: Site) -> None:
    with browser_page(f"{site.server.url}/") as (page, errors):
        page.wait_for_selector("#view-signin:not([hidden])")
        page.click("#sso-link")  # to the issuer, with PKCE
        page.wait_for_selector("input[name=login]")
        assert page.url.startswith(f"{site.provider.issuer(0)}/interaction/")
        page.fill("input[name=login]", "alice")
        page.fill("input[name=password]", "x")
        page.click("button[type=submit]")
        page.wait_for_url(f"{site.provider.issuer(0)}/interaction/**")
        page.click("button[type=submit]")  # consent
        page.wait_for_selector("#view-jobs:not([hidden])")
        assert page.text_content("#who") == "oidc:alice · write"
        assert page.url == f"{site.server.url}/#/jobs"  # the handoff id is gone from the address bar
        stored = page.evaluate("() => [sessionStorage.getItem('ckpt-token'), localStorage.length]")
        assert stored[1] == 0 and stored[0].count(".") == 2  # the JWT, in this tab's session storage only
        assert jwt.decode(stored[0], options={"verify_signature": False})["sub"] == "alice"
        assert page.evaluate("() => sessionStorage.getItem('ckpt-id-token')").count(".") == 2
        # signing out ends the issuer's session too (RP-initiated logout), then returns to the dashboard
        page.click("#sign-out")
        page.wait_for_url(f"{site.provider.issuer(0)}/session/end**")
        page.click("button[name=logout][value=yes]")  # the issuer's own confirmation
        page.wait_for_url(f"{site.server.url}/#/jobs")
        page.wait_for_selector("#view-signin:not([hidden])")
        assert page.evaluate("() => [sessionStorage.getItem('ckpt-token'), sessionStorage.getItem("
                             "'ckpt-id-token')]") == [None, None]
        # the issuer forgot alice: signing in again asks for the login, not straight back with a token
        page.click("#sso-link")
        page.wait_for_selector("input[name=login]")
        assert page.url.startswith(f"{site.provider.issuer(0)}/interaction/")
        assert errors == []


def test_the_audit_log_names_each_team_and_holds_the_refused_attempts(site: Site, teams: Teams) -> None:
    """Changes by OpenID principals are audited under oidc:SUB, cross-team attempts as refused rows with the
    line the caller got; only an admin of every root reads the log."""
    folder = teams.a / "audited"
    folder.mkdir()
    save_file({"w": torch.zeros(2, 2)}, str(folder / "model.safetensors"))
    http = {c.client_id: teams.server.http(site.provider.token(c)) for c in (TEAM_A, TEAM_B, ADMIN)}
    a, b, admin = http["team-a-ci"], http["team-b-ci"], http["platform"]
    try:
        since = time.time()
        made = a.post("/v1/checkpoints", json={"uri": str(folder), "name": "audited"})
        assert made.status_code == 201, made.text
        tagged = b.post(f"/v1/checkpoints/{made.json()['id']}/tags", json={"set": {"stage": "x"}})
        stolen = b.post("/v1/jobs", json=job_spec("inspect", folder))
        assert (tagged.status_code, stolen.status_code) == (403, 403)
        log = admin.get("/v1/audit", params={"since": since}).json()["items"][::-1]
        assert [(r["principal"], r["action"], r["object"], r["outcome"], r["detail"]) for r in log] == [
            ("oidc:team-a-ci", "checkpoint.register", f"checkpoint:{made.json()['id']}", "done", None),
            ("oidc:team-b-ci", "checkpoint.tag", f"checkpoint:{made.json()['id']}", "refused",
             "HTTP 403: " + tagged.json()["error"]["message"]),
            ("oidc:team-b-ci", "job.submit", "job:(new)", "refused", "HTTP 403: " + stolen.json()["error"]["message"])]
        assert log[0]["after"]["uri"] == str(folder) and log[1]["before"] == []
        assert a.get("/v1/audit").json()["error"]["message"] == (
            "oidc:team-a-ci is admin of some roots only; this needs admin of every root (\"*\" in "
            "CKPT_OIDC_GROUP_ROLES)")
        assert b.get("/v1/audit").json()["error"]["message"] == (
            "token 'oidc:team-b-ci' has scope write; this needs admin")
    finally:
        for client in http.values():
            client.close()


def test_jobs_reading_other_roots_runs_deletions_and_job_ids_follow_readable_roots(site: Site, teams: Teams) -> None:
    """A job's config_from and base are read paths (submitting or seeing the job needs read there); a
    checkpoint names the job that made or found it only to callers who may read that job; runs count readable
    steps; a page of the deletion log holds the caller's deletions however many of others' are newer."""
    root = teams.a.parent
    for folder in ("shared/hf", "b/hf", "b/found", "shared/found", "a/r1", "b/r1"):
        (root / folder).mkdir()
    for path in ("b/found/model.safetensors", "shared/found/model.safetensors", "a/r1/m.safetensors",
                 "b/r1/m.safetensors"):
        save_file({"w": torch.full((2,), 3.0)}, str(root / path))
    http = {c.client_id: teams.server.http(site.provider.token(c)) for c in (TEAM_A, TEAM_B, ADMIN)}
    a, b, admin = http["team-a-ci"], http["team-b-ci"], http["platform"]
    admin_token = site.provider.token(ADMIN)
    rule = "(its groups give no role there; CKPT_OIDC_GROUP_ROLES maps groups to roots)"
    try:
        # 1. config_from and base: read paths of the job
        export = job_spec("export", teams.shared / "model.safetensors", teams.a / "exported",
                          config_from=str(teams.b / "hf"))
        refused = a.post("/v1/jobs", json=export)
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["message"] == (
            f"options.config_from: oidc:team-a-ci may not read {teams.b}/hf {rule}")
        merge = job_spec("export", teams.shared / "model.safetensors", teams.a / "merged", merge_adapter=True,
                         base=str(teams.b / "hf"))
        assert a.post("/v1/jobs", json=merge).json()["error"]["message"] == (
            f"options.base: oidc:team-a-ci may not read {teams.b}/hf {rule}")
        theirs = admin.post("/v1/jobs", json=export)
        assert theirs.status_code == 202, theirs.text
        job_id = theirs.json()["id"]
        assert a.get(f"/v1/jobs/{job_id}").json()["error"]["message"] == (
            f"job {job_id}: oidc:team-a-ci may not read {teams.b}/hf {rule}")
        assert job_id not in [j["id"] for j in a.get("/v1/jobs", params={"limit": 200}).json()["items"]]
        assert job_id in [j["id"] for j in admin.get("/v1/jobs", params={"limit": 200}).json()["items"]]
        ok = a.post("/v1/jobs", json={**export, "target": str(teams.a / "exported-2"),
                                      "options": {"config_from": str(teams.shared / "hf")}})
        assert ok.status_code == 202, ok.text
        # 2. job ids a checkpoint names: an output made from team B's root, a shared source found by B's job
        made = {}
        for name, source, target in (("a-from-b", root / "b/found/model.safetensors",
                                      teams.a / "from-b.safetensors"),
                                     ("b-from-shared", root / "shared/found/model.safetensors",
                                      teams.b / "from-shared.safetensors")):
            job = admin.post("/v1/jobs", json=job_spec("convert", source, target))
            assert job.status_code == 202, job.text
            made[name] = teams.server.wait_job(job.json()["id"], ("succeeded",), token=admin_token)["id"]
        everything = {c["uri"]: c for c in admin.get("/v1/checkpoints", params={"limit": 200}).json()["items"]}
        output = everything[str(teams.a / "from-b.safetensors")]
        shared = everything[str(root / "shared/found/model.safetensors")]
        assert (output["made_by_job"], output["registered_via"]) == (made["a-from-b"],
                                                                     {"how": "output", "job": made["a-from-b"]})
        assert shared["registered_via"] == {"how": "source", "job": made["b-from-shared"]}
        for seen in (a.get(f"/v1/checkpoints/{output['id']}").json(),
                     a.get(f"/v1/checkpoints/{output['id']}/managed").json()["checkpoint"],
                     a.get(f"/v1/checkpoints/{output['id']}/lineage").json()["checkpoint"],
                     next(c for c in a.get("/v1/checkpoints", params={"limit": 200}).json()["items"]
                          if c["id"] == output["id"])):
            assert (seen["made_by_job"], seen["registered_via"]) == (None, {"how": "output"})
        assert a.get(f"/v1/checkpoints/{shared['id']}").json()["registered_via"] == {"how": "source"}
        assert b.get(f"/v1/checkpoints/{shared['id']}").json()["registered_via"] == shared["registered_via"]
        # 3. runs: each team counts its own steps of a run both write to
        for client, folder, step in ((a, teams.a, 1), (b, teams.b, 2)):
            registered = client.post("/v1/checkpoints", json={"uri": str(folder / "r1/m.safetensors"),
                                                              "metadata": {"run": "both", "step": step}})
            assert registered.status_code == 201, registered.text
        runs = {name: {r["run"]: (r["checkpoints"], r["latest_step"]) for r in client.get("/v1/runs").json()}
                for name, client in http.items()}
        assert (runs["team-a-ci"]["both"], runs["team-b-ci"]["both"], runs["platform"]["both"]) == ((1, 1), (1, 2),
                                                                                                     (2, 2))
        for client, folder in ((a, teams.a), (b, teams.b)):
            scan = client.post("/v1/jobs", json=job_spec("scan", folder / "r1/m.safetensors"))
            assert scan.status_code == 202, scan.text
            teams.server.wait_job(scan.json()["id"], ("succeeded",), token=admin_token)
        for name, want in (("team-a-ci", [1]), ("team-b-ci", [2]), ("platform", [1, 2])):
            assert http[name].get("/v1/runs/both/latest").json()["step"] == want[-1]
            assert [p["step"] for p in http[name].get("/v1/runs/both/stats").json()] == want
        # 4. deletions: team A's one purge is its page of one, though team B's is newer
        steps = [teams.a / "r1/m.safetensors", teams.b / "r1/m.safetensors"]
        assert admin.delete("/v1/aliases/both/latest").status_code == 204
        for uri in steps:  # b's purge is the newer
            purged = admin.delete(f"/v1/checkpoints/{uri_id(admin, uri)}", params={"purge": "true"})
            assert purged.status_code == 200, purged.text
        for client, uri in ((a, steps[0]), (b, steps[1])):
            assert [d["uri"] for d in client.get("/v1/deletions", params={"limit": 1}).json()] == [str(uri)]
        assert [d["uri"] for d in admin.get("/v1/deletions", params={"limit": 2}).json()] == [str(steps[1]),
                                                                                              str(steps[0])]
    finally:
        for client in http.values():
            client.close()


def uri_id(client: httpx.Client, uri: Path) -> str:
    return str(next(c["id"] for c in client.get("/v1/checkpoints", params={"limit": 200}).json()["items"]
                    if c["uri"] == str(uri)))


def test_the_dashboard_lineage_says_how_many_checkpoints_it_leaves_out(site: Site, teams: Teams) -> None:
    """Team A, signed in to the dashboard with its token, sees its own output of a shared checkpoint in the
    lineage picture and a line counting team B's output, which is not drawn."""
    source = teams.shared / "pictured.safetensors"
    save_file({"w": torch.arange(3, dtype=torch.float32)}, str(source))
    admin_token, token_a = site.provider.token(ADMIN), site.provider.token(TEAM_A)
    with teams.server.http(admin_token) as admin:
        for folder in (teams.a, teams.b):
            job = admin.post("/v1/jobs", json=job_spec("convert", source, folder / "pictured.safetensors"))
            assert job.status_code == 202, job.text
            teams.server.wait_job(job.json()["id"], ("succeeded",), token=admin_token)
        shared_id = uri_id(admin, source)
    with browser_page(f"{teams.server.url}/") as (page, errors):
        page.wait_for_selector("#view-signin:not([hidden])")
        page.fill("#token", token_a)
        page.press("#token", "Enter")
        page.wait_for_selector("#view-jobs:not([hidden])")
        assert page.text_content("#who") == "oidc:team-a-ci · admin"
        page.goto(f"{teams.server.url}/#/checkpoints/{shared_id}")
        page.wait_for_selector("#view-checkpoint:not([hidden]) svg.lineage-graph")
        assert page.text_content("#lineage-hidden") == "1 checkpoint under roots you cannot read is not shown."
        labels = page.eval_on_selector_all("svg.lineage-graph a.node-checkpoint", "ns => ns.map(n => "
                                           "n.getAttribute('href'))")
        assert sorted(labels) == sorted([f"#/checkpoints/{shared_id}",
                                         f"#/checkpoints/{uri_id_with(token_a, teams, teams.a)}"])
        assert errors == []


def uri_id_with(token: str, teams: Teams, folder: Path) -> str:
    with teams.server.http(token) as client:
        return uri_id(client, folder / "pictured.safetensors")
