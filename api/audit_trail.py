"""Every change made through the API, and every attempt refused, goes into the audit log (ckpt_service/audit.py).

Plain ASGI middleware around the routes: a POST, PUT, PATCH or DELETE under /v1 is matched to its route first,
the object it names is read as it stands (`before`), the route runs, and then one row is appended: outcome
`done` with the answer as `after` for a 2xx, `refused` with the one-line message for a 401, 403 or 409. Reads
(GET, event streams) pass straight through untouched.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import FastAPI
from pydantic import BaseModel
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ckpt_service import logs
from ckpt_service.service_errors import ServiceError

CHANGES = {"POST", "PUT", "PATCH", "DELETE"}
REFUSALS = {401, 403, 409}
MAX_BODY = 256 * 1024  # an answer larger than this is audited without its `after`

Params = dict[str, Any]
Reader = Callable[[FastAPI, Params], Any]


def _dump(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list):
        return [_dump(v) for v in value]
    return value


def _job(app: FastAPI, p: Params) -> Any:
    return app.state.service.job(p["job_id"]).view()


def _checkpoint(app: FastAPI, p: Params) -> Any:
    return app.state.service.checkpoint(p["checkpoint_id"])


def _tags(app: FastAPI, p: Params) -> Any:
    return app.state.service.registry.get(p["checkpoint_id"]).tags


def _alias(app: FastAPI, p: Params) -> Any:
    catalog = app.state.service.catalog
    return catalog.managed(catalog.resolve(p["namespace"], p["name"]))


def _rule(app: FastAPI, p: Params) -> Any:
    return app.state.rules.get(p["rule_id"])


def _policy(app: FastAPI, p: Params) -> Any:
    return next((v for v in app.state.retention.policies() if v.id == p["policy_id"]), None)


@dataclass(frozen=True)
class Action:
    name: str
    object: Callable[[Params, Any, Any], str]  # (path parameters, answer, before) -> KIND:ID
    before: Reader | None = None
    refusals_only: bool = False
    bodies: bool = True  # False: the answer is not kept (a route this table does not know may answer secrets)


def _id(kind: str, param: str | None = None) -> Callable[[Params, Any, Any], str]:
    """KIND:ID with the id the answer (or else the object before the change) gives, so that a name in the path
    (`/v1/rules/nightly/pause`) and the id land under one object; `(new)` for a refused creation."""
    def name(params: Params, after: Any, before: Any) -> str:
        for view in (after, before):
            if isinstance(view, dict) and isinstance(view.get("id"), str):
                return f"{kind}:{view['id']}"
        return f"{kind}:{params[param]}" if param else f"{kind}:(new)"
    return name


def _alias_name(params: Params, after: Any, before: Any) -> str:
    return f"alias:{params['namespace']}/{params['name']}"


def _tagged(params: Params, after: Any, before: Any) -> str:
    found = after.get("checkpoint_id") if isinstance(after, dict) else None
    return f"checkpoint:{found or params['checkpoint_id']}"


def _notified(params: Params, after: Any, before: Any) -> str:
    found = after.get("checkpoint_id") if isinstance(after, dict) else None
    return f"checkpoint:{found or '(new)'}"


#: routes that change nothing of the service's state and answer secrets: never audited
#: (session_handoff trades the dashboard's one-time sign-in handoff for an access token; session_logout builds
#: the issuer's sign-out address around the ID token)
UNAUDITED = {"session_handoff", "session_logout"}

#: route name (the endpoint function's name) -> what the audit log calls it
ACTIONS: dict[str, Action] = {
    "submit": Action("job.submit", _id("job")),
    "cancel": Action("job.cancel", _id("job", "job_id"), _job),
    "register": Action("checkpoint.register", _id("checkpoint")),
    "delete": Action("checkpoint.unregister", _id("checkpoint", "checkpoint_id"), _checkpoint),
    "set_tags": Action("checkpoint.tag", _tagged, _tags),
    "notify": Action("checkpoint.notify", _notified),
    "put_alias": Action("alias.move", _alias_name, _alias),
    "delete_alias": Action("alias.remove", _alias_name, _alias),
    "add_rule": Action("rule.add", _id("rule")),
    "remove_rule": Action("rule.remove", _id("rule", "rule_id"), _rule),
    "pause_rule": Action("rule.pause", _id("rule", "rule_id"), _rule),
    "resume_rule": Action("rule.resume", _id("rule", "rule_id"), _rule),
    "add_policy": Action("policy.add", _id("policy")),
    "remove_policy": Action("policy.remove", _id("policy", "policy_id"), _policy),
    # a GC run itself is audited by Retention.run (the scheduler's runs too), each deletion by its removal
    "gc": Action("gc.run", lambda params, after, before: "gc", refusals_only=True),
}


def _read(reader: Reader | None, app: FastAPI, params: Params) -> Any:
    if reader is None:
        return None
    try:
        return _dump(reader(app, params))
    except ServiceError:  # not there (yet): the change creates it, or is refused below
        return None
    except Exception as exc:  # the audit never stands in the way of the request
        logs.event("audit.before_unread", error=f"{type(exc).__name__}: {exc}", level=logging.WARNING)
        return None


def _who(app: FastAPI, authorization: str | None) -> str:
    try:
        name: str = app.state.checker.principal(authorization).name
        return name
    except ServiceError:
        return "unauthenticated"


class AuditTrail:
    def __init__(self, app: ASGIApp, api: FastAPI) -> None:
        self.app = app
        self.api = api

    def _route(self, scope: Scope) -> tuple[str, Params] | None:
        for route in _flat(self.api.router.routes):
            match, child = route.matches(scope)
            if match == Match.FULL:
                return getattr(route, "name", "") or "", dict(child.get("path_params") or {})
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in CHANGES or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        found = self._route(scope)
        if found is None:
            await self.app(scope, receive, send)
            return
        name, params = found
        if name in UNAUDITED:
            await self.app(scope, receive, send)
            return
        action = ACTIONS.get(name) or Action(f"{scope['method']} {scope['path']}"[:100],
                                             lambda params, after, before: f"path:{scope['path']}", bodies=False)
        before = await anyio.to_thread.run_sync(_read, action.before, self.api, params)
        sent: list[bytes] = []
        request: list[bytes] = []
        status = 0
        replayed = False

        async def receiving() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                request.append(message.get("body", b""))
            return message

        async def sending(message: Message) -> None:
            nonlocal status, replayed
            if message["type"] == "http.response.start":
                status = message["status"]
                replayed = (b"idempotent-replayed", b"true") in list(message.get("headers") or [])
            elif message["type"] == "http.response.body" and sum(map(len, sent)) <= MAX_BODY:
                sent.append(message.get("body", b""))
            await send(message)

        await self.app(scope, receiving, sending)
        if not (200 <= status < 300 or status in REFUSALS) or replayed:
            return  # a replayed submit (Idempotency-Key) changed nothing: its first request is in the log
        asked = _loads(b"".join(request))
        if name == "gc" and not (isinstance(asked, dict) and asked.get("dry_run") is False):
            return  # a dry run changes nothing
        authorization = dict(scope.get("headers") or []).get(b"authorization")
        try:
            await anyio.to_thread.run_sync(self._record, action, params, status, before, b"".join(sent),
                                           authorization.decode("latin-1") if authorization else None)
        except Exception as exc:  # the answer is already sent; say so in the log, loudly
            logs.event("audit.unwritten", action=action.name, error=f"{type(exc).__name__}: {exc}",
                       level=logging.ERROR)

    def _record(self, action: Action, params: Params, status: int, before: Any, body: bytes,
                authorization: str | None) -> None:
        answer = _loads(body) if len(body) <= MAX_BODY else None
        if not action.bodies:
            answer = {"error": answer.get("error")} if isinstance(answer, dict) and "error" in answer else None
        who = _who(self.api, authorization)
        log = self.api.state.audit
        if 200 <= status < 300:
            if action.refusals_only:
                return
            after = answer if answer != {} else None  # 204: removed
            log.record(who, action.name, action.object(params, after, before), before=before, after=after)
            return
        error = answer.get("error") if isinstance(answer, dict) else None
        detail = str(error.get("message")) if isinstance(error, dict) else f"HTTP {status}"
        log.record(who, action.name, action.object(params, None, before), before=before, outcome="refused",
                   detail=f"HTTP {status}: {detail}")


def _flat(routes: list[BaseRoute]) -> Iterator[BaseRoute]:
    """The routes, those of included routers too (FastAPI 0.165 keeps an included router as one entry whose
    own match tells nothing of the route inside). The routers here carry their /v1 prefix themselves."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from _flat(inner.routes)
        else:
            yield route


def _loads(body: bytes) -> Any:
    try:
        value = json.loads(body) if body else {}
    except ValueError:
        return {}
    return value
