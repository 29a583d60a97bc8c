"""OpenID Connect bearer tokens: a JWT access token from the configured issuer becomes a Principal.

The issuer's discovery document names its JWKS; the keys are cached for `jwks_seconds` and fetched again
when a token names a key id (`kid`) the cache lacks (the issuer rotated its keys), at most once every
`refetch_seconds`, so a stream of made-up key ids cannot make the service hammer the issuer. Only the
asymmetric algorithms in `algorithms` are accepted, and only with a key of the matching type: `none` and
every HMAC algorithm are refused before any key is looked at (so an HS256 token "signed" with the issuer's
public key gets nowhere). `iss`, `aud` and `exp` are required and checked, `nbf` when present, with
`leeway` seconds of clock skew. Every refusal is an Unauthorized with one line.

The issuer is the operator's own setting (often an internal host), so it is fetched directly (not through
the callback guard of netguard.py), with a short timeout, no redirects and a size cap.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import jwt

from .auth import SCOPES, Principal, Scope
from .service_errors import Forbidden, Unauthorized

#: what a JWS `alg` needs as the key's `kty`
KEY_TYPES = {"RS256": "RSA", "RS384": "RSA", "RS512": "RSA", "PS256": "RSA", "PS384": "RSA", "PS512": "RSA",
             "ES256": "EC", "ES384": "EC", "ES512": "EC", "EdDSA": "OKP"}
DEFAULT_ALGORITHMS = ["RS256", "ES256", "PS256"]
MAX_DOCUMENT_BYTES = 512 * 1024
NAME_PREFIX = "oidc:"  # static token names never hold a colon, so the two kinds of principal never share a name

Fetch = Callable[[str], dict[str, Any]]
RoleMap = dict[str, dict[str, Scope]]


def fetch_json(url: str, timeout: float = 5.0) -> dict[str, Any]:
    """GET a JSON object (no redirects, at most MAX_DOCUMENT_BYTES); raises Unauthorized naming the URL."""
    try:
        with httpx.stream("GET", url, timeout=timeout, follow_redirects=False,
                          headers={"Accept": "application/json"}) as response:
            if response.status_code != 200:
                raise Unauthorized(f"cannot verify the token: {url} answered HTTP {response.status_code}")
            body = b""
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > MAX_DOCUMENT_BYTES:
                    raise Unauthorized(f"cannot verify the token: {url} sent more than {MAX_DOCUMENT_BYTES} bytes")
    except httpx.HTTPError as exc:
        raise Unauthorized(f"cannot verify the token: the issuer at {url} is unreachable ({type(exc).__name__})"
                           ) from None
    try:
        value = json.loads(body)
    except ValueError:
        raise Unauthorized(f"cannot verify the token: {url} sent no JSON") from None
    if not isinstance(value, dict):
        raise Unauthorized(f"cannot verify the token: {url} sent no JSON object")
    return value


@dataclass(frozen=True)
class OidcConfig:
    issuer: str
    audience: str
    groups_claim: str = "groups"
    algorithms: tuple[str, ...] = tuple(DEFAULT_ALGORITHMS)
    leeway: float = 30.0
    jwks_seconds: float = 300.0
    refetch_seconds: float = 10.0
    group_roles: tuple[tuple[str, tuple[tuple[str, Scope], ...]], ...] = ()

    @staticmethod
    def roles_tuple(mapping: RoleMap) -> tuple[tuple[str, tuple[tuple[str, Scope], ...]], ...]:
        return tuple((group, tuple(sorted(roots.items()))) for group, roots in sorted(mapping.items()))


class OidcVerifier:
    """Checks JWT access tokens against one issuer; thread-safe (FastAPI runs sync dependencies in threads)."""

    def __init__(self, config: OidcConfig, fetch: Fetch = fetch_json, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.config = config
        self._fetch = fetch
        self._clock = clock
        self._lock = threading.Lock()
        self._jwks_uri: str | None = None
        self._document: dict[str, Any] | None = None
        self._keys: dict[str, jwt.PyJWK] = {}
        self._fetched_at: float | None = None
        self.fetches = 0  # JWKS downloads so far (for tests and metrics)

    # -- keys ---------------------------------------------------------------------------------------------------

    def document(self) -> dict[str, Any]:
        """The issuer's discovery document (fetched once, checked to name the configured issuer)."""
        with self._lock:
            self._discover()
            assert self._document is not None
            return self._document

    def _discover(self) -> str:
        if self._jwks_uri is None:
            url = self.config.issuer.rstrip("/") + "/.well-known/openid-configuration"
            doc = self._fetch(url)
            if doc.get("issuer") != self.config.issuer:
                raise Unauthorized(f"cannot verify the token: {url} names issuer {str(doc.get('issuer'))[:200]!r}, "
                                   f"not the configured {self.config.issuer!r} (fix CKPT_OIDC_ISSUER)")
            uri = doc.get("jwks_uri")
            if not isinstance(uri, str) or not _same_security(uri, self.config.issuer):
                raise Unauthorized(f"cannot verify the token: {url} has no usable jwks_uri (https, or http on "
                                   "loopback like the issuer)")
            self._jwks_uri, self._document = uri, doc
        return self._jwks_uri

    def _load_keys(self) -> None:
        doc = self._fetch(self._discover())
        self.fetches += 1
        keys: dict[str, jwt.PyJWK] = {}
        for item in doc.get("keys") or []:
            if not isinstance(item, dict) or item.get("use", "sig") != "sig" or not isinstance(item.get("kid"), str):
                continue
            if item.get("kty") not in KEY_TYPES.values() or "d" in item or "k" in item:
                continue  # only public asymmetric keys; a JWKS that leaks private or symmetric keys gets no say
            try:
                keys[item["kid"]] = jwt.PyJWK(item)
            except jwt.PyJWTError:
                continue  # an algorithm this PyJWT lacks: the other keys still work
        self._keys = keys
        self._fetched_at = self._clock()

    def key(self, kid: str) -> jwt.PyJWK:
        with self._lock:
            now = self._clock()
            stale = self._fetched_at is None or now - self._fetched_at >= self.config.jwks_seconds
            may_refetch = self._fetched_at is None or now - self._fetched_at >= self.config.refetch_seconds
            if stale or (kid not in self._keys and may_refetch):
                self._load_keys()
            found = self._keys.get(kid)
        if found is None:
            raise Unauthorized(f"token signed with key {kid[:80]!r}, which the issuer's JWKS does not hold")
        return found

    # -- tokens -------------------------------------------------------------------------------------------------

    def claims(self, token: str) -> dict[str, Any]:
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise Unauthorized("malformed bearer token: not a JWT and not a ckpt_ token") from None
        alg = header.get("alg")
        if not isinstance(alg, str) or alg not in self.config.algorithms:
            raise Unauthorized(f"token algorithm {str(alg)[:20]!r} refused: this server accepts "
                               f"{', '.join(self.config.algorithms)} (CKPT_OIDC_ALGORITHMS)")
        kid = header.get("kid")
        if not isinstance(kid, str) or not kid:
            raise Unauthorized("token header has no key id (kid)")
        key = self.key(kid)
        if key.key_type != KEY_TYPES.get(alg) and not (key.key_type == "OKP" and alg == "EdDSA"):
            raise Unauthorized(f"token algorithm {alg} does not fit key {kid[:80]!r} ({key.key_type})")
        try:
            return jwt.decode(token, key.key, algorithms=[alg], audience=self.config.audience,
                              issuer=self.config.issuer, leeway=self.config.leeway,
                              options={"require": ["exp", "iss", "aud"], "verify_signature": True})
        except jwt.ExpiredSignatureError:
            raise Unauthorized("token expired: get a new one from the issuer") from None
        except jwt.ImmatureSignatureError:
            raise Unauthorized("token not valid yet (nbf/iat in the future beyond the clock skew)") from None
        except jwt.InvalidAudienceError:
            raise Unauthorized(f"token audience is not {self.config.audience!r} (CKPT_OIDC_AUDIENCE): request "
                               "a token for this service") from None
        except jwt.InvalidIssuerError:
            raise Unauthorized(f"token issuer is not {self.config.issuer!r} (CKPT_OIDC_ISSUER)") from None
        except jwt.InvalidSignatureError:
            raise Unauthorized("token signature does not verify") from None
        except jwt.MissingRequiredClaimError as exc:
            raise Unauthorized(f"token lacks the {exc.claim!r} claim") from None
        except jwt.PyJWTError as exc:
            raise Unauthorized(f"token refused: {str(exc)[:200]}") from None

    def principal(self, token: str) -> Principal:
        claims = self.claims(token)
        subject = claims.get("sub") or claims.get("client_id")
        if not isinstance(subject, str) or not subject:
            raise Unauthorized("token has neither a sub nor a client_id claim")
        groups = _groups(claims.get(self.config.groups_claim))
        roots: list[tuple[str, Scope]] = []
        for group, entries in self.config.group_roles:
            if group in groups:
                roots.extend(entries)
        name = NAME_PREFIX + subject
        if not roots:
            raise Forbidden(f"{name} has no group that CKPT_OIDC_GROUP_ROLES maps to a role (its "
                            f"{self.config.groups_claim!r} claim: {sorted(groups)[:10]})")
        scope = max((role for _, role in roots), key=SCOPES.index)
        return Principal(name, scope, groups=tuple(sorted(groups)), roots=tuple(sorted(set(roots))))


def _groups(value: Any) -> set[str]:
    if isinstance(value, str):
        return {value}
    if isinstance(value, list):
        return {item for item in value if isinstance(item, str)}
    return set()


def _same_security(uri: str, issuer: str) -> bool:
    """jwks_uri must be https, or http only when the issuer itself is plain http on loopback."""
    try:
        parsed = httpx.URL(uri)
    except httpx.InvalidURL:
        return False
    if parsed.scheme == "https":
        return True
    return parsed.scheme == "http" and httpx.URL(issuer).scheme == "http" and parsed.host == httpx.URL(issuer).host
