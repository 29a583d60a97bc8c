"""The real `oidc-provider` npm package on loopback, for tests/test_oidc.py.

Installed once into ${CKPT_CI_CACHE:-~/.cache/ckpt-service}/oidc-node (`npm install --prefix`); a test skips with
the reason only when npm is missing or cannot reach the registry.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

from ckpt_service.helpers import free_port

VERSION = "9.13.3"
SCRIPT = Path(__file__).with_name("provider.mjs")


def node_dir() -> Path:
    cache = Path(os.environ.get("CKPT_CI_CACHE") or Path.home() / ".cache" / "ckpt-service") / "oidc-node"
    if (cache / "node_modules" / "oidc-provider" / "package.json").is_file():
        return cache
    if not shutil.which("node") or not shutil.which("npm"):
        pytest.skip("node and npm are needed to run the oidc-provider package (apt-get install nodejs npm)")
    done = subprocess.run(["npm", "install", "--prefix", str(cache), f"oidc-provider@{VERSION}"],
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        pytest.skip(f"npm could not install oidc-provider@{VERSION}: {done.stderr.strip()[-300:]}")
    return cache


def private_jwk(kind: str, kid: str) -> dict[str, Any]:
    """A fresh private signing key as a JWK: kind RS256 or ES256."""
    if kind == "RS256":
        jwk = json.loads(RSAAlgorithm.to_jwk(rsa.generate_private_key(65537, 2048)))
    else:
        jwk = json.loads(ECAlgorithm.to_jwk(ec.generate_private_key(ec.SECP256R1())))
    jwk.pop("key_ops", None)  # PyJWT writes ["sign"]: the provider would then not verify with it (id_token_hint)
    return {**jwk, "kid": kid, "use": "sig", "alg": kind}


@dataclass
class Client:
    client_id: str
    client_secret: str
    groups: list[str]
    redirect_uris: list[str] | None = None  # a public authorization-code client (PKCE) when given
    post_logout_redirect_uris: list[str] | None = None  # where RP-initiated logout may send the browser back


@dataclass
class Provider:
    """One node process serving one provider per entry of `issuers` (same clients and audience)."""

    folder: Path
    audience: str
    clients: list[Client]
    users: dict[str, list[str]] = field(default_factory=dict)  # login -> groups
    ports: list[int] = field(default_factory=list)
    proc: subprocess.Popen[str] | None = None

    def issuer(self, index: int = 0) -> str:
        return f"http://127.0.0.1:{self.ports[index]}"

    def start(self, keys: list[list[dict[str, Any]]]) -> Provider:
        """keys[i]: provider i's private JWKs (the first signs)."""
        self.stop()
        if not self.ports:
            self.ports = [free_port() for _ in keys]
        config = {"audience": self.audience, "clients": [c.__dict__ for c in self.clients], "users": self.users,
                  "providers": [{"port": port, "issuer": f"http://127.0.0.1:{port}", "keys": ks, "alg": ks[0]["alg"]}
                                for port, ks in zip(self.ports, keys, strict=True)]}
        path = self.folder / "provider.json"
        path.write_text(json.dumps(config))
        with open(self.folder / "provider.log", "a") as log:
            self.proc = subprocess.Popen(["node", str(SCRIPT), str(node_dir()), str(path)], stdout=subprocess.PIPE,
                                         stderr=log, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # bounded: node prints "ready" or exits
        if line.strip() != "ready":
            self.stop()
            raise AssertionError(f"oidc-provider did not start: {(self.folder / 'provider.log').read_text()[-2000:]}")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None

    def token(self, client: Client, resource: str | None = None, index: int = 0) -> str:
        """A client-credentials access token (a JWT) for `resource` (default: the audience)."""
        reply = httpx.post(f"{self.issuer(index)}/token", auth=(client.client_id, client.client_secret), timeout=10,
                           data={"grant_type": "client_credentials", "scope": "api",
                                 "resource": resource or self.audience})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["token_type"].lower() == "bearer"
        return str(body["access_token"])


def sign_in(browser: httpx.Client, start: str, login: str) -> httpx.Response:
    """Walk the provider's own login and consent pages (devInteractions) from `start` (the service's
    /v1/session/login) as a browser would, keeping cookies; returns the service's answer to the callback."""
    reply = browser.get(start)
    for _ in range(12):  # login, consent, and the redirects between them
        if reply.url.path == "/v1/session/callback":
            return reply
        if reply.status_code in (302, 303):
            reply = browser.get(reply.url.join(reply.headers["location"]))
            continue
        url = str(reply.url)
        if "/interaction/" not in url:
            return reply
        prompt = "login" if 'name="login"' in reply.text else "consent"
        data = {"prompt": prompt, **({"login": login, "password": "x"} if prompt == "login" else {})}
        reply = browser.post(url, data=data)
    raise AssertionError("the sign-in did not come back to the service")
