"""/v1/whoami: who the caller's token is, so a client (the dashboard) can offer only what it may do."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

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
