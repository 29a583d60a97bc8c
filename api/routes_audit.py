"""`GET /v1/audit`: the audit log, newest first, for admins; there is no route that changes it."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request

from ckpt_service.audit import AuditPage, Outcome

from .schemas import errors
from .security import Credentials

router = APIRouter(prefix="/v1", tags=["audit"])


@router.get("/audit", response_model=AuditPage, responses=errors(401, 403, 422, 503), summary="The audit log (admin)")
def audit(request: Request, _: Credentials,
          principal: Annotated[str | None, Query(max_length=200, description="Exactly, or a prefix ending "
                                                                            "with *")] = None,
          action: Annotated[str | None, Query(max_length=100, description="e.g. alias.move, or rule.*")] = None,
          object: Annotated[str | None, Query(max_length=500, description="KIND:ID, or a prefix ending with *")
                            ] = None,
          outcome: Outcome | None = None,
          since: Annotated[float | None, Query(ge=0, description="Unix time, inclusive")] = None,
          until: Annotated[float | None, Query(ge=0, description="Unix time, inclusive")] = None,
          limit: Annotated[int, Query(ge=1, le=1000)] = 100,
          cursor: Annotated[str | None, Query(pattern=r"^[0-9]{1,18}$", description="next_cursor of the "
                                                                                   "previous page")] = None
          ) -> AuditPage:
    """Each change (who, when, what, the object before and after) and each refused attempt (with the line the
    caller got)."""
    # admin of every root: the log covers them all (TokenChecker.require refuses an admin of some roots only)
    request.app.state.checker.require(request.headers.get("authorization"), "admin")
    return request.app.state.audit.entries(principal, action, object, since, until, outcome, limit,
                                           int(cursor) if cursor else None)
