"""Bearer tokens: made once, stored only as SHA-256 hashes in settings, each with a scope.

A token is `ckpt_` + 43 URL-safe characters (256 random bits), so a plain SHA-256 is a safe hash
(nothing to brute-force). A settings entry is `NAME:SCOPE:sha256:HEX` (NAME optional). Scopes nest:
`admin` can do what `write` can, `write` what `read` can.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, cast

from .service_errors import Forbidden, Unauthorized

if TYPE_CHECKING:
    from .oidc import OidcVerifier

Scope = Literal["read", "write", "admin"]
SCOPES: tuple[Scope, ...] = ("read", "write", "admin")
TOKEN_PREFIX = "ckpt_"
_ENTRY = re.compile(r"^(?:(?P<name>[A-Za-z0-9_.-]{1,64}):)?(?P<scope>read|write|admin):sha256:(?P<hex>[0-9a-f]{64})$")


@dataclass(frozen=True)
class TokenEntry:
    name: str
    scope: Scope
    digest: str  # hex sha256 of the token

    def line(self) -> str:
        return f"{self.name}:{self.scope}:sha256:{self.digest}"


@dataclass(frozen=True)
class Principal:
    """Who is calling: a token's name and scope (`anonymous` with admin scope when auth is off). An OpenID
    Connect principal (`oidc:SUB`) also carries its groups and the (root URI prefix, role) pairs they map to;
    `roots` None: every root (static tokens)."""

    name: str
    scope: Scope
    groups: tuple[str, ...] = ()
    roots: tuple[tuple[str, Scope], ...] | None = None

    def allows(self, needed: Scope) -> bool:
        return SCOPES.index(self.scope) >= SCOPES.index(needed)

    def role_at(self, uri: str) -> Scope | None:
        """The strongest role this principal holds over `uri` (a normalised URI or path); None: none."""
        if self.roots is None:
            return self.scope
        from . import roots

        try:
            where = roots.parse(uri, resolve=False)
        except Exception:  # a stored URI that no longer parses grants nothing
            return None
        found = [role for prefix, role in self.roots
                 if prefix == "*" or roots.parse(prefix, resolve=False).contains(where)]
        return max(found, key=SCOPES.index) if found else None

    def may(self, uri: str | None, needed: Scope) -> bool:
        role = self.role_at(uri) if uri else (self.scope if self.roots is None else None)
        return role is not None and SCOPES.index(role) >= SCOPES.index(needed)

    def check(self, uri: str, needed: Scope, what: str) -> None:
        """Raise Forbidden (one line) unless this principal holds `needed` over `uri`."""
        if not self.may(uri, needed):
            held = self.role_at(uri)
            raise Forbidden(f"{what}: {self.name} may not {needed} {uri} (its groups give "
                            f"{held or 'no role'} there; CKPT_OIDC_GROUP_ROLES maps groups to roots)")

    def readable(self) -> list[str] | None:
        """The root URI prefixes this principal may read, for a store query to filter by (every role reads);
        None: every root (static tokens, or a "*" entry)."""
        if self.roots is None or any(prefix == "*" for prefix, _ in self.roots):
            return None
        return sorted({prefix for prefix, _ in self.roots})

    def everywhere(self, needed: Scope) -> bool:
        """Holds `needed` over every root (static tokens by scope; OpenID principals through a "*" entry)."""
        if self.roots is None:
            return self.allows(needed)
        return any(prefix == "*" and SCOPES.index(role) >= SCOPES.index(needed) for prefix, role in self.roots)


ANONYMOUS = Principal("anonymous", "admin")


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def parse_entry(text: str) -> TokenEntry:
    match = _ENTRY.match(text.strip())
    if not match:
        # never echo the entry: it may be a raw token pasted by mistake
        raise ValueError("token entries look like NAME:SCOPE:sha256:HEX (make one with `ckptctl token create`)")
    scope = cast(Scope, match.group("scope"))  # _ENTRY matches the three scopes only
    return TokenEntry(match.group("name") or scope, scope, match.group("hex"))


def create(scope: Scope, name: str | None = None) -> tuple[str, TokenEntry]:
    """A new token and the settings entry that admits it; the token itself is never stored."""
    if scope not in SCOPES:
        raise ValueError(f"scope {scope!r}: choose read, write or admin")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    entry = TokenEntry(name or scope, scope, digest(token))
    parse_entry(entry.line())  # the name must round-trip
    return token, entry


class TokenChecker:
    """Turns an `Authorization` header into a Principal, or raises Unauthorized/Forbidden."""

    def __init__(self, entries: list[TokenEntry], anonymous: bool, oidc: OidcVerifier | None = None) -> None:
        self.entries = entries
        self.anonymous = anonymous
        self.oidc = oidc

    def principal(self, authorization: str | None) -> Principal:
        if self.anonymous and not authorization:
            return ANONYMOUS
        if not authorization:
            raise Unauthorized("missing bearer token: send 'Authorization: Bearer <token>'")
        kind, _, token = authorization.partition(" ")
        if kind.lower() != "bearer" or not token.strip():
            raise Unauthorized("malformed Authorization header: expected 'Bearer <token>'")
        token = token.strip()
        if self.oidc is not None and not token.startswith(TOKEN_PREFIX) and token.count(".") == 2:
            return self.oidc.principal(token)
        found = digest(token)
        match = None
        for entry in self.entries:  # compare with every entry, in constant time each
            if hmac.compare_digest(entry.digest, found):
                match = entry
        if match is None:
            if self.anonymous:
                raise Unauthorized("unknown token (this server also accepts requests without one)")
            raise Unauthorized("unknown or revoked token")
        return Principal(match.name, match.scope)

    def require(self, authorization: str | None, scope: Scope) -> Principal:
        who = self.principal(authorization)
        if not who.allows(scope):
            raise Forbidden(f"token {who.name!r} has scope {who.scope}; this needs {scope}")
        if scope == "admin" and not who.everywhere("admin"):
            raise Forbidden(f"{who.name} is admin of some roots only; this needs admin of every root (\"*\" in "
                            "CKPT_OIDC_GROUP_ROLES)")
        return who
