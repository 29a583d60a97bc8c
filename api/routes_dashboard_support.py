"""/v1/whoami: who the caller's token is, so a client (the dashboard) can offer only what it may do; and
/v1/session/*: the dashboard's OpenID Connect sign-in (authorization code + PKCE, ckpt_service/oidc_login.py)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import RedirectResponse
from pydantic import BaseModel, Field

from ckpt_service.auth import SCOPES, Principal, Scope
from ckpt_service.oidc_login import LoginFlows
from ckpt_service.service_errors import InvalidRequest, NotFound

from .schemas import errors
from .security import Reader

GroupRoles = tuple[tuple[str, tuple[tuple[str, Scope], ...]], ...]  # OidcConfig.group_roles

router = APIRouter(prefix="/v1", tags=["session"])


class RootRole(BaseModel):
    root: str = Field(description="A storage root URI, or `*` for every root.")
    role: Literal["read", "write", "admin"]
    groups: list[str] = Field(description="The caller's groups that grant this role here (CKPT_OIDC_GROUP_ROLES); "
                                          "empty for a static token, whose scope holds over every root.")


class WhoAmI(BaseModel):
    name: str = Field(description="The token's name (jobs record it as `submitted_by`); `anonymous` without one.")
    scope: Literal["read", "write", "admin"] = Field(description="read: look only; write: submit, and cancel "
                                                                 "own jobs; admin: also cancel any job, purge. "
                                                                 "An OpenID caller: its strongest role anywhere.")
    groups: list[str] = Field(default_factory=list, description="The OpenID token's groups (empty for a static "
                                                                "token).")
    roots: list[RootRole] = Field(default_factory=list, description="Per root, the strongest role the caller "
                                                                    "holds there and the groups that give it.")
    anonymous_allowed: bool = Field(description="Whether this server accepts requests without a token.")
    version: str = Field(description="The server's version.")


def root_roles(principal: Principal, group_roles: GroupRoles) -> list[RootRole]:
    """Each root the principal holds a role over: its strongest role and the groups that grant exactly that."""
    if principal.roots is None:
        return [RootRole(root="*", role=principal.scope, groups=[])]
    strongest: dict[str, Scope] = {}
    for root, role in principal.roots:
        if root not in strongest or SCOPES.index(role) > SCOPES.index(strongest[root]):
            strongest[root] = role
    granting = {group: dict(entries) for group, entries in group_roles if group in principal.groups}
    return [RootRole(root=root, role=role, groups=sorted(g for g, entries in granting.items()
                                                         if entries.get(root) == role))
            for root, role in sorted(strongest.items())]


@router.get("/whoami", response_model=WhoAmI, responses=errors(401, 403), summary="Who am I")
def whoami(request: Request, principal: Reader) -> WhoAmI:
    """The name and scope of the bearer token sent (any valid token has at least read scope); for an OpenID
    token also its groups and, per storage root, the role they map to."""
    oidc = request.app.state.checker.oidc
    return WhoAmI(name=principal.name, scope=principal.scope, groups=list(principal.groups),
                  roots=root_roles(principal, oidc.config.group_roles if oidc is not None else ()),
                  anonymous_allowed=request.app.state.checker.anonymous, version=request.app.version)


class SessionConfig(BaseModel):
    sso: bool = Field(description="Whether GET /v1/session/login signs people in through the OpenID issuer.")


class HandoffRequest(BaseModel):
    handoff: str = Field(min_length=1, max_length=128)


class SessionToken(BaseModel):
    access_token: str
    expires_in: int = Field(description="Seconds the token lives (0: not said by the issuer).")
    name: str
    id_token: str | None = Field(None, description="The issuer's ID token: the page keeps it (sessionStorage) "
                                                   "only to sign out at the issuer too.")


class LogoutRequest(BaseModel):
    id_token_hint: str | None = Field(None, max_length=16384, description="The ID token the sign-in gave.")


class Logout(BaseModel):
    url: str | None = Field(description="Send the browser here to end the issuer's session too (it comes back to "
                                        "the dashboard); None: the issuer offers no end_session_endpoint.")


def _flows(request: Request) -> LoginFlows:
    flows: LoginFlows | None = getattr(request.app.state, "login_flows", None)
    if flows is None:
        settings, oidc = request.app.state.settings, request.app.state.checker.oidc
        if oidc is None or not settings.oidc_client_id:
            raise NotFound("this server has no OpenID sign-in (set CKPT_OIDC_ISSUER and CKPT_OIDC_CLIENT_ID)")
        flows = request.app.state.login_flows = LoginFlows(oidc, settings.oidc_client_id)
    return flows


def _redirect_uri(request: Request) -> str:
    return request.app.state.settings.oidc_redirect_uri or str(request.url_for("session_callback"))


def _ended_uri(request: Request) -> str:
    """Where the issuer sends the browser after signing out: beside the callback (register it with the issuer
    as this client's post-logout redirect URI)."""
    configured: str | None = request.app.state.settings.oidc_redirect_uri
    if configured and configured.endswith("/session/callback"):
        return configured.removesuffix("/callback") + "/ended"
    return str(request.url_for("session_ended"))


@router.get("/session/config", response_model=SessionConfig, summary="How the dashboard signs in")
def session_config(request: Request) -> SessionConfig:
    settings = request.app.state.settings
    return SessionConfig(sso=bool(request.app.state.checker.oidc is not None and settings.oidc_client_id))


@router.get("/session/login", status_code=303, responses=errors(404), summary="Sign in through the OpenID issuer")
def session_login(request: Request) -> RedirectResponse:
    """Sends the browser to the issuer (authorization code flow with PKCE S256)."""
    return RedirectResponse(_flows(request).start(_redirect_uri(request)), status_code=303)


@router.get("/session/callback", name="session_callback", status_code=303, responses=errors(400, 401, 403, 404),
            summary="Where the issuer sends the browser back")
def session_callback(request: Request, state: Annotated[str, Query(max_length=200)] = "",
                     code: Annotated[str, Query(max_length=4096)] = "",
                     error: Annotated[str, Query(max_length=200)] = "") -> RedirectResponse:
    """Exchanges the code for an access token and sends the browser to the dashboard with a one-time handoff id
    in the fragment (never the token)."""
    flows = _flows(request)
    if error or not code or not state:
        raise InvalidRequest(f"sign-in did not complete: the issuer answered {error or 'without a code'}", "code")
    return RedirectResponse(f"/#/sso/{flows.finish(code, state)}", status_code=303)


@router.post("/session/handoff", response_model=SessionToken, responses=errors(400, 401, 404, 422),
             summary="Trade a one-time sign-in handoff for the access token")
def session_handoff(body: HandoffRequest, request: Request) -> SessionToken:
    found = _flows(request).take(body.handoff)
    return SessionToken(access_token=found.token, expires_in=found.expires_in, name=found.principal.name,
                        id_token=found.id_token)


@router.post("/session/logout", response_model=Logout, responses=errors(400, 404, 422),
             summary="Where to end the issuer's session (RP-initiated logout)")
def session_logout(body: LogoutRequest, request: Request) -> Logout:
    """The issuer's end_session_endpoint with the ID token as `id_token_hint` and this dashboard as
    `post_logout_redirect_uri`; the page has already forgotten its tokens. Nothing here is secret to the
    caller: it only builds the address from the issuer's discovery document."""
    return Logout(url=_flows(request).end_session(body.id_token_hint, _ended_uri(request)))


@router.get("/session/ended", name="session_ended", status_code=303, response_class=RedirectResponse,
            summary="Back from signing out at the issuer")
def session_ended() -> RedirectResponse:
    return RedirectResponse("/#/jobs", status_code=303)
