"""/v1/whoami: who the caller's token is, so a client (the dashboard) can offer only what it may do; and
/v1/session/*: the dashboard's OpenID Connect sign-in (authorization code + PKCE, ckpt_service/oidc_login.py)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import RedirectResponse
from pydantic import BaseModel, Field

from ckpt_service.oidc_login import LoginFlows
from ckpt_service.service_errors import InvalidRequest, NotFound

from .schemas import errors
from .security import Reader

router = APIRouter(prefix="/v1", tags=["session"])


class WhoAmI(BaseModel):
    name: str = Field(description="The token's name (jobs record it as `submitted_by`); `anonymous` without one.")
    scope: Literal["read", "write", "admin"] = Field(description="read: look only; write: submit, and cancel "
                                                                 "own jobs; admin: also cancel any job, purge.")
    anonymous_allowed: bool = Field(description="Whether this server accepts requests without a token.")
    version: str = Field(description="The server's version.")


@router.get("/whoami", response_model=WhoAmI, responses=errors(401), summary="Who am I")
def whoami(request: Request, principal: Reader) -> WhoAmI:
    """The name and scope of the bearer token sent (any valid token has at least read scope)."""
    return WhoAmI(name=principal.name, scope=principal.scope, anonymous_allowed=request.app.state.checker.anonymous,
                  version=request.app.version)


class SessionConfig(BaseModel):
    sso: bool = Field(description="Whether GET /v1/session/login signs people in through the OpenID issuer.")


class HandoffRequest(BaseModel):
    handoff: str = Field(min_length=1, max_length=128)


class SessionToken(BaseModel):
    access_token: str
    expires_in: int = Field(description="Seconds the token lives (0: not said by the issuer).")
    name: str


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


@router.post("/session/handoff", response_model=SessionToken, responses=errors(401, 404, 422),
             summary="Trade a one-time sign-in handoff for the access token")
def session_handoff(body: HandoffRequest, request: Request) -> SessionToken:
    found = _flows(request).take(body.handoff)
    return SessionToken(access_token=found.token, expires_in=found.expires_in, name=found.principal.name)
