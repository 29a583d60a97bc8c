"""The auth dependency: `Depends(require("write"))` gives the caller's Principal or raises 401/403."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from ckpt_service.auth import Principal, Scope

bearer = HTTPBearer(auto_error=False, description="A token from `ckptctl token create`.")


Credentials = Annotated[HTTPAuthorizationCredentials | None, Security(bearer)]


def require(scope: Scope) -> Callable[..., Principal]:
    def dependency(request: Request, _: Credentials) -> Principal:
        return request.app.state.checker.require(request.headers.get("authorization"), scope)

    return dependency


Reader = Annotated[Principal, Depends(require("read"))]
Writer = Annotated[Principal, Depends(require("write"))]
