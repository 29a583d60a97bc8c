"""The dashboard's sign-in: the authorization-code flow with PKCE (S256), run by the server for the page.

The page's Content-Security-Policy lets it talk only to its own origin, so the server does the exchange:
`start` makes a state and a code verifier (kept here, in memory, for `PENDING_SECONDS`) and the issuer URL to
send the browser to; the issuer sends the browser back with a code, `finish` exchanges it (with the verifier)
for an access token, checks that token like any other bearer token, and keeps it under a one-time handoff id
for `HANDOFF_SECONDS`. The browser comes back to `/#/sso/HANDOFF`: the fragment never reaches a server or a
Referer, and the page trades the id once (`take`) for the token, which it keeps in sessionStorage as it does a
pasted token. So no access token is ever in a URL. Signing out ends the issuer's session too where it offers
an `end_session_endpoint` (`end_session`): the page sends the browser there with the ID token as
`id_token_hint` (the one token RP-initiated logout puts in a URL, as the standard has it), and the issuer sends
it back to the dashboard. State is per API process: behind several replicas, route a
browser's sign-in to one replica (sticky sessions) or sign in with a pasted token.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import httpx

from .auth import Principal
from .oidc import OidcVerifier
from .service_errors import InvalidRequest, Unauthorized

PENDING_SECONDS = 600.0
HANDOFF_SECONDS = 60.0
MAX_PENDING = 1000


@dataclass(frozen=True)
class Handoff:
    token: str
    expires_in: int
    principal: Principal
    id_token: str | None = None  # for signing out at the issuer too (id_token_hint)


def _challenge(verifier: str) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).rstrip(b"=").decode()


class LoginFlows:
    def __init__(self, verifier: OidcVerifier, client_id: str) -> None:
        self.verifier = verifier
        self.client_id = client_id
        self._lock = threading.Lock()
        self._pending: dict[str, tuple[str, str, float]] = {}  # state -> (code verifier, redirect uri, made)
        self._handoffs: dict[str, tuple[Handoff, float]] = {}

    def _expire(self, now: float) -> None:
        self._pending = {k: v for k, v in self._pending.items() if now - v[2] < PENDING_SECONDS}
        self._handoffs = {k: v for k, v in self._handoffs.items() if now - v[1] < HANDOFF_SECONDS}

    def start(self, redirect_uri: str) -> str:
        """The issuer's authorization URL to send the browser to."""
        endpoint = self.verifier.document().get("authorization_endpoint")
        if not isinstance(endpoint, str):
            raise Unauthorized("the issuer's discovery document has no authorization_endpoint")
        state, code_verifier = secrets.token_urlsafe(32), secrets.token_urlsafe(48)
        with self._lock:
            now = time.monotonic()
            self._expire(now)
            if len(self._pending) >= MAX_PENDING:
                raise Unauthorized("too many sign-ins under way; try again in a few minutes")
            self._pending[state] = (code_verifier, redirect_uri, now)
        query = urlencode({"response_type": "code", "client_id": self.client_id, "redirect_uri": redirect_uri,
                           "scope": "openid", "state": state, "code_challenge": _challenge(code_verifier),
                           "code_challenge_method": "S256", "resource": self.verifier.config.audience})
        return f"{endpoint}?{query}"

    def finish(self, code: str, state: str) -> str:
        """Exchange the code; returns the one-time handoff id."""
        with self._lock:
            self._expire(time.monotonic())
            pending = self._pending.pop(state, None)
        if pending is None:
            raise InvalidRequest("sign-in state unknown or expired (over 10 minutes, or already used): sign in again",
                                 "state")
        code_verifier, redirect_uri, _ = pending
        endpoint = self.verifier.document().get("token_endpoint")
        if not isinstance(endpoint, str):
            raise Unauthorized("the issuer's discovery document has no token_endpoint")
        try:
            reply = httpx.post(endpoint, timeout=10.0, follow_redirects=False, data={
                "grant_type": "authorization_code", "code": code, "redirect_uri": redirect_uri,
                "client_id": self.client_id, "code_verifier": code_verifier,
                "resource": self.verifier.config.audience})
        except httpx.HTTPError as exc:
            raise Unauthorized(f"sign-in failed: the issuer's token endpoint is unreachable ({type(exc).__name__})"
                               ) from None
        body: Any = reply.json() if reply.headers.get("content-type", "").startswith("application/json") else {}
        token = body.get("access_token") if isinstance(body, dict) else None
        if reply.status_code != 200 or not isinstance(token, str):
            why = body.get("error_description") or body.get("error") if isinstance(body, dict) else None
            raise Unauthorized(f"sign-in failed: the issuer refused the code (HTTP {reply.status_code}"
                               f"{': ' + str(why)[:200] if why else ''})")
        principal = self.verifier.principal(token)  # the token this page will send is checked now, once
        handoff = secrets.token_urlsafe(32)
        with self._lock:
            id_token = body.get("id_token")
            self._handoffs[handoff] = (Handoff(token, int(body.get("expires_in") or 0), principal,
                                               id_token if isinstance(id_token, str) else None), time.monotonic())
        return handoff

    def take(self, handoff: str) -> Handoff:
        with self._lock:
            self._expire(time.monotonic())
            found = self._handoffs.pop(handoff, None)
        if found is None:
            raise Unauthorized("sign-in handoff unknown, used or expired (60 s): sign in again")
        return found[0]

    def end_session(self, id_token_hint: str | None, post_logout_redirect_uri: str) -> str | None:
        """Where to send the browser to end its session at the issuer too (OpenID Connect RP-initiated logout:
        the issuer's `end_session_endpoint` with the id token as hint, back to `post_logout_redirect_uri`, which
        the issuer must list for this client); None when the issuer offers no such endpoint."""
        endpoint = self.verifier.document().get("end_session_endpoint")
        if not isinstance(endpoint, str) or not endpoint.startswith(("https://", "http://")):
            return None
        query = {"client_id": self.client_id, "post_logout_redirect_uri": post_logout_redirect_uri}
        if id_token_hint:
            query["id_token_hint"] = id_token_hint
        return f"{endpoint}{'&' if '?' in endpoint else '?'}{urlencode(query)}"
