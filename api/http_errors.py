"""One table from exceptions to HTTP statuses, and the handlers that apply it.

Error bodies are `{"error": {"type", "message", "fields"?}}`. Messages come from our own exception
messages (one line, no secrets); anything unexpected becomes a 500 whose body names only a request
id: the stack trace goes to the log, never to the client.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import converters as ce
from ckpt_service import logs
from ckpt_service import service_errors as se

#: exception class -> (HTTP status, error type). The first match in order wins (subclasses first).
STATUS: list[tuple[type[BaseException], int, str]] = [
    (se.InvalidRequest, 422, "invalid_request"),
    (se.Unauthorized, 401, "unauthorized"),
    (se.OutsideRoots, 403, "outside_storage_roots"),
    (se.Forbidden, 403, "forbidden"),
    (se.NotFound, 404, "not_found"),
    (se.Conflict, 409, "conflict"),
    (se.PayloadTooLarge, 413, "payload_too_large"),
    (se.QueueFull, 429, "queue_full"),
    (se.TooManyStreams, 429, "too_many_streams"),
    (se.StoreDamaged, 503, "store_damaged"),
    (se.SchemaTooNew, 503, "store_schema_too_new"),
    (se.StoreError, 503, "store_unavailable"),
    (se.ServiceError, 500, "service_error"),
    (ce.TargetError, 409, "target_error"),
    (ce.SourceError, 422, "source_error"),
    (ce.OptionError, 422, "option_error"),
    (ce.CkptError, 422, "checkpoint_error"),
]


def status_for(exc: BaseException) -> tuple[int, str]:
    for cls, status, kind in STATUS:
        if isinstance(exc, cls):
            return status, kind
    return 500, "internal"


def body(kind: str, message: str, fields: list[dict[str, str]] | None = None) -> dict[str, Any]:
    error: dict[str, Any] = {"type": kind, "message": message}
    if fields:
        error["fields"] = fields
    return {"error": error}


async def _known(request: Request, exc: Exception) -> JSONResponse:
    status, kind = status_for(exc)
    field = getattr(exc, "field", None)
    fields = [{"field": field, "message": str(exc)}] if field else None
    headers = {}
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    if isinstance(exc, se.TooMany):
        headers["Retry-After"] = str(exc.retry_after)
    if status >= 500:
        logs.event("http.error", path=request.url.path, status=status, error=str(exc))
    return JSONResponse(body(kind, str(exc), fields), status_code=status, headers=headers)


def _field_name(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:] if len(parts) > 1 else parts
    return ".".join(parts) or "body"


async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    # never echo `input`: it may hold a token or a huge value
    fields = [{"field": _field_name(tuple(e.get("loc", ()))), "message": str(e.get("msg", "invalid"))}
              for e in exc.errors()][:50]
    first = fields[0] if fields else {"field": "body", "message": "invalid request"}
    return JSONResponse(body("validation_error", f"{first['field']}: {first['message']}", fields), status_code=422)


async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    message = exc.detail if isinstance(exc.detail, str) else "request refused"
    return JSONResponse(body(kind, message), status_code=exc.status_code, headers=getattr(exc, "headers", None))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    request_id = uuid.uuid4().hex[:12]
    logs.event("http.internal_error", path=request.url.path, method=request.method, request_id=request_id,
               exc_info=True)
    return JSONResponse(body("internal", f"internal error; the server log has the details (request id {request_id})"),
                        status_code=500)


def install(app: FastAPI) -> None:
    app.add_exception_handler(se.ServiceError, _known)
    app.add_exception_handler(ce.CkptError, _known)
    # Starlette types a handler as taking any Exception; these take the one class they are registered for
    app.add_exception_handler(RequestValidationError, _validation)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected)
