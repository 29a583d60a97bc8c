"""Checkpoint management: tags, aliases, runs (catalog), retention policies, GC and the deletion log
(retention), rules and `POST /v1/notify` (rules). Deleting data (GC without dry_run, policies) takes admin."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Path, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from ckpt_service.auth import Principal, Scope
from ckpt_service.catalog import AliasChange, ManagedView, RunView
from ckpt_service.job_requests import BoundText
from ckpt_service.retention import DeletionView, GcReport, PolicySpec, PolicyView, Retention
from ckpt_service.rules import NotifyResult, Rules, RuleSpec, RuleView, Scheduler, TriggerView
from ckpt_service.service_errors import Forbidden, NotFound

from .schemas import errors
from .security import Reader, Writer, check_rule, may_read_job, may_rule, visible_checkpoint

router = APIRouter(prefix="/v1", tags=["manage"])
Id = Annotated[str, Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]


class TagUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    set: dict[Annotated[str, Field(min_length=1, max_length=64)], Annotated[str, Field(max_length=64)]] = Field(
        default_factory=dict, max_length=32, description="key -> value; replaces a tag with the same key.")
    remove: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field(default_factory=list, max_length=32,
                                                                             description="Keys to remove.")


class Tags(BaseModel):
    checkpoint_id: str
    tags: list[str]


class AliasTarget(BaseModel):
    model_config = ConfigDict(extra="forbid")

    checkpoint_id: str = Field(min_length=1, max_length=64)
    require_finite: bool = Field(False, description="Move only when the checkpoint's newest scan found no NaN or "
                                                    "Inf (409 saying why otherwise).")
    require: list[BoundText] = Field(default_factory=list, max_length=32,
                                     description="Move only when the checkpoint's newest scan holds every bound: "
                                                 "finite, or STAT<=LIMIT[:GLOB] / STAT>=LIMIT[:GLOB] with STAT "
                                                 "max_abs, l2 or std (409 naming the tensors otherwise).")


class GcRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dry_run: bool = True


class NotifyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    uri: str = Field(min_length=1, max_length=4096)


def _admin(request: Request) -> Principal:
    return request.app.state.checker.require(request.headers.get("authorization"), "admin")


def _checkpoint(request: Request, principal: Principal, checkpoint_id: str, needed: Scope) -> None:
    """403 (one line) unless the caller holds `needed` over the checkpoint's URI (static tokens: their scope,
    already checked, holds everywhere)."""
    if principal.roots is None:
        return
    uri = request.app.state.service.checkpoint(checkpoint_id).uri
    principal.check(uri, needed, f"checkpoint {checkpoint_id}")


def _shown(request: Request, principal: Principal, views: list[ManagedView]) -> list[ManagedView]:
    """Readable checkpoints' views with the jobs the caller may not read blanked (`visible_checkpoint`)."""
    if principal.roots is None:
        return views
    jobs = may_read_job(request, principal)
    return [view.model_copy(update={"checkpoint": visible_checkpoint(principal, view.checkpoint, jobs)})
            for view in views]


def _rules(request: Request) -> Rules:
    return request.app.state.rules


def _retention(request: Request) -> Retention:
    return request.app.state.retention


# -- tags, aliases, runs ---------------------------------------------------------------------------

@router.get("/checkpoints/{checkpoint_id}/tags", response_model=Tags, responses=errors(401, 403, 404, 422, 503),
            summary="A checkpoint's tags")
def get_tags(checkpoint_id: Id, request: Request, principal: Reader) -> Tags:
    _checkpoint(request, principal, checkpoint_id, "read")
    return Tags(checkpoint_id=checkpoint_id, tags=request.app.state.service.registry.get(checkpoint_id).tags)


@router.post("/checkpoints/{checkpoint_id}/tags", response_model=Tags,
             responses=errors(400, 413, 401, 403, 404, 422, 503), summary="Set or remove tags")
def set_tags(checkpoint_id: Id, body: TagUpdate, request: Request, principal: Writer) -> Tags:
    """`key=value` tags replace the tag with the same key; `pin` protects a checkpoint from GC. A tag key
    belongs to the token that set it: changing or removing it is for that token or an admin (403)."""
    _checkpoint(request, principal, checkpoint_id, "write")
    return Tags(checkpoint_id=checkpoint_id,
                tags=request.app.state.service.catalog.set_tags(checkpoint_id, body.set, body.remove, principal))


@router.get("/checkpoints/{checkpoint_id}/managed", response_model=ManagedView,
            responses=errors(401, 403, 404, 422, 503), summary="A checkpoint with its run, step, aliases and rule")
def managed(checkpoint_id: Id, request: Request, principal: Reader) -> ManagedView:
    _checkpoint(request, principal, checkpoint_id, "read")
    return _shown(request, principal, [request.app.state.service.catalog.managed(checkpoint_id)])[0]


@router.get("/aliases", responses=errors(401, 403, 422, 503), summary="List aliases")
def list_aliases(request: Request, principal: Reader,
                 namespace: Annotated[str | None, Query(max_length=64)] = None) -> list[dict[str, Any]]:
    """Only aliases naming a checkpoint the caller may read."""
    service = request.app.state.service
    found: list[dict[str, Any]] = service.catalog.aliases(namespace)
    if principal.roots is None:
        return found
    return [a for a in found if principal.may(service.registry.get(a["checkpoint_id"]).uri, "read")]


@router.get("/aliases/{namespace}/{name}", response_model=ManagedView, responses=errors(401, 403, 404, 422, 503),
            summary="The checkpoint an alias names")
def get_alias(namespace: Id, name: Id, request: Request, principal: Reader) -> ManagedView:
    catalog = request.app.state.service.catalog
    view: ManagedView = catalog.managed(catalog.resolve(namespace, name))
    principal.check(view.checkpoint.uri, "read", f"alias {name}@{namespace}")
    return _shown(request, principal, [view])[0]


@router.put("/aliases/{namespace}/{name}", response_model=ManagedView,
            responses=errors(400, 413, 401, 403, 404, 409, 422, 503), summary="Point an alias at a checkpoint")
def put_alias(namespace: Id, name: Id, body: AliasTarget, request: Request, principal: Writer) -> ManagedView:
    """Moves the alias atomically (its history keeps every move). An existing alias is moved by the token that
    made it or an admin (403). With `require_finite` or bounds in `require`, only a checkpoint whose newest scan
    holds them moves it (409 naming the tensors, statistics and bounds)."""
    service = request.app.state.service
    _checkpoint(request, principal, body.checkpoint_id, "write")
    if body.require_finite or body.require:
        service.check_scan(body.checkpoint_id, ["finite"] * body.require_finite + body.require,
                           f"alias {name}@{namespace} not moved")
    moved = service.catalog.set_alias(namespace, name, body.checkpoint_id, principal.name, principal)
    return _shown(request, principal, [moved])[0]


@router.delete("/aliases/{namespace}/{name}", status_code=204, responses=errors(401, 403, 404, 422, 503),
               summary="Remove an alias")
def delete_alias(namespace: Id, name: Id, request: Request, principal: Writer) -> None:
    if principal.roots is not None:
        _checkpoint(request, principal, request.app.state.service.catalog.resolve(namespace, name), "write")
    request.app.state.service.catalog.remove_alias(namespace, name, principal.name, principal)


@router.get("/aliases/{namespace}/{name}/history", response_model=list[AliasChange],
            responses=errors(401, 403, 404, 422, 503), summary="Every move of an alias")
def alias_history(namespace: Id, name: Id, request: Request, principal: Reader) -> list[AliasChange]:
    """Every move; a move to or from a checkpoint under a root the caller may not read is left out."""
    service = request.app.state.service
    changes: list[AliasChange] = service.catalog.history(namespace, name)
    if principal.roots is None:
        return changes
    _checkpoint(request, principal, service.catalog.resolve(namespace, name), "read")
    readable: dict[str, bool] = {}

    def may(checkpoint_id: str | None) -> bool:
        if checkpoint_id is None:
            return True
        if checkpoint_id not in readable:
            try:
                readable[checkpoint_id] = principal.may(service.registry.get(checkpoint_id).uri, "read")
            except NotFound:  # unregistered since: nothing left to show
                readable[checkpoint_id] = True
        return readable[checkpoint_id]

    return [change for change in changes if may(change.checkpoint_id) and may(change.previous_id)]


@router.get("/runs", response_model=list[RunView], responses=errors(401, 403, 503), summary="List runs")
def runs(request: Request, principal: Reader) -> list[RunView]:
    """Each run's steps the caller may read (counted, and the latest among them); a run with none is left out."""
    found: list[RunView] = request.app.state.service.catalog.runs(principal.readable())
    return [run for run in found if principal.roots is None
            or (run.latest_id and principal.may(request.app.state.service.registry.get(run.latest_id).uri, "read"))]


@router.get("/runs/{run}", response_model=list[ManagedView], responses=errors(401, 403, 404, 422, 503),
            summary="A run's checkpoints by step")
def run_steps(run: Id, request: Request, principal: Reader) -> list[ManagedView]:
    """The steps the caller may read."""
    steps: list[ManagedView] = request.app.state.service.catalog.steps(run)
    return _shown(request, principal, [step for step in steps if principal.may(step.checkpoint.uri, "read")])


@router.get("/runs/{run}/stats", responses=errors(401, 403, 404, 422, 503), summary="A run's statistics by step")
def run_stats(run: Id, request: Request, principal: Reader) -> list[dict[str, Any]]:
    """Per scanned step: each layer's weight norm, its relative change from the step before, and the NaN/Inf
    count (from the newest scan job of each step's checkpoint)."""
    if principal.roots is None:
        points: list[dict[str, Any]] = request.app.state.service.run_stats(run)
        return points
    # an OpenID caller: its newest readable step must exist, and only its readable steps are plotted
    latest = request.app.state.service.catalog.latest(run, principal.readable())
    _checkpoint(request, principal, latest.checkpoint.id, "read")
    return list(request.app.state.service.run_stats(run, lambda uri: principal.may(uri, "read")))


@router.get("/runs/{run}/latest", response_model=ManagedView, responses=errors(401, 403, 404, 422, 503),
            summary="The latest step of a run")
def run_latest(run: Id, request: Request, principal: Reader) -> ManagedView:
    """The newest step the caller may read."""
    view: ManagedView = request.app.state.service.catalog.latest(run, principal.readable())
    principal.check(view.checkpoint.uri, "read", f"run {run}")
    return _shown(request, principal, [view])[0]


# -- retention and GC ------------------------------------------------------------------------------

@router.get("/policies", response_model=list[PolicyView], responses=errors(401, 403, 503), summary="List policies")
def list_policies(request: Request, _: Reader) -> list[PolicyView]:
    return _retention(request).policies()


@router.post("/policies", status_code=201, response_model=PolicyView,
             responses=errors(400, 413, 401, 403, 409, 422, 503), summary="Add a retention policy (admin)")
def add_policy(body: PolicySpec, request: Request) -> PolicyView:
    return _retention(request).add_policy(body, _admin(request).name)


@router.delete("/policies/{policy_id}", response_model=PolicyView, responses=errors(401, 403, 404, 422, 503),
               summary="Remove a retention policy (admin)")
def remove_policy(policy_id: Id, request: Request) -> PolicyView:
    _admin(request)
    return _retention(request).remove_policy(policy_id)


@router.post("/gc", response_model=GcReport, responses=errors(400, 413, 401, 403, 422, 503), summary="Garbage-collect")
def gc(body: GcRequest, request: Request, principal: Reader) -> GcReport:
    """The plan (what, which policy and why, bytes); without `dry_run` (admin) it is carried out."""
    if not body.dry_run:
        principal = _admin(request)
    elif not principal.everywhere("read"):
        raise Forbidden(f"{principal.name} may read some roots only; a GC plan covers every root (read of \"*\" "
                        "in CKPT_OIDC_GROUP_ROLES)")
    return _retention(request).run(body.dry_run, principal.name)


@router.get("/deletions", response_model=list[DeletionView], responses=errors(401, 403, 422, 503),
            summary="The deletion log")
def deletions(request: Request, principal: Reader,
              state: Annotated[str | None, Query(pattern="^(pending|done|refused)$")] = None,
              limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> list[DeletionView]:
    """Only deletions under roots the caller may read (filtered in the query, so `limit` of them come back)."""
    found: list[DeletionView] = _retention(request).deletions(state, limit, principal.readable())
    return [item for item in found if principal.may(item.uri, "read")]


# -- rules -----------------------------------------------------------------------------------------

@router.get("/rules", response_model=list[RuleView], responses=errors(401, 403, 503), summary="List rules")
def list_rules(request: Request, principal: Reader) -> list[RuleView]:
    """Only rules whose pattern the caller may read."""
    return [rule for rule in _rules(request).all() if may_rule(principal, rule.spec)]


@router.post("/rules", status_code=201, response_model=RuleView, responses=errors(400, 413, 401, 403, 409, 422, 503),
             summary="Add a rule")
def add_rule(body: RuleSpec, request: Request, principal: Writer) -> RuleView:
    check_rule(principal, body, "write")
    return _rules(request).add(body, principal.name)


@router.get("/rules/{rule_id}", response_model=RuleView, responses=errors(401, 403, 404, 422, 503),
            summary="Show a rule")
def get_rule(rule_id: Id, request: Request, principal: Reader) -> RuleView:
    rule = _rules(request).get(rule_id)
    check_rule(principal, rule.spec, "read")
    return rule


@router.delete("/rules/{rule_id}", response_model=RuleView, responses=errors(401, 403, 404, 422, 503),
               summary="Remove a rule")
def remove_rule(rule_id: Id, request: Request, principal: Writer) -> RuleView:
    """Its creator or an admin (403 otherwise)."""
    check_rule(principal, _rules(request).get(rule_id).spec, "write")
    return _rules(request).remove(rule_id, principal)


@router.post("/rules/{rule_id}/pause", response_model=RuleView, responses=errors(401, 403, 404, 422, 503),
             summary="Pause a rule")
def pause_rule(rule_id: Id, request: Request, principal: Writer) -> RuleView:
    """Its creator or an admin (403 otherwise)."""
    check_rule(principal, _rules(request).get(rule_id).spec, "write")
    return _rules(request).pause(rule_id, True, principal)


@router.post("/rules/{rule_id}/resume", response_model=RuleView, responses=errors(401, 403, 404, 422, 503),
             summary="Resume a rule")
def resume_rule(rule_id: Id, request: Request, principal: Writer) -> RuleView:
    """Its creator or an admin (403 otherwise)."""
    check_rule(principal, _rules(request).get(rule_id).spec, "write")
    return _rules(request).pause(rule_id, False, principal)


@router.get("/rules/{rule_id}/triggers", response_model=list[TriggerView], responses=errors(401, 403, 404, 422, 503),
            summary="What a rule fired on")
def rule_triggers(rule_id: Id, request: Request, principal: Reader) -> list[TriggerView]:
    check_rule(principal, _rules(request).get(rule_id).spec, "read")
    return _rules(request).triggers(rule_id)


@router.post("/notify", response_model=NotifyResult, responses=errors(400, 413, 401, 403, 409, 422, 503),
             summary="A checkpoint finished writing")
def notify(body: NotifyRequest, request: Request, principal: Writer) -> NotifyResult:
    """Registers the checkpoint (409 while it is incomplete) and fires the rules whose pattern matches it."""
    principal.check(body.uri, "write", "uri")
    return _rules(request).notify(body.uri, principal.name)


def install(app: FastAPI) -> Scheduler:
    """Add the routes and the managers to `app`; returns the discovery/GC scheduler (not started)."""
    service, settings = app.state.service, app.state.settings
    app.state.rules, app.state.retention = Rules(service), Retention(service)
    app.include_router(router)
    return Scheduler(app.state.rules, app.state.retention, settings.discover_seconds, settings.gc_seconds)
