"""The auth dependency: `Depends(require("write"))` gives the caller's Principal or raises 401/403."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from ckpt_service.auth import Principal, Scope
from ckpt_service.jobs import JobView
from ckpt_service.registry import CheckpointView, LineageEdge, LineageView
from ckpt_service.rules import RuleSpec, _fixed_part, render
from ckpt_service.service_errors import NotFound

bearer = HTTPBearer(auto_error=False, description="A token from `ckptctl token create`.")


Credentials = Annotated[HTTPAuthorizationCredentials | None, Security(bearer)]


def require(scope: Scope) -> Callable[..., Principal]:
    def dependency(request: Request, _: Credentials) -> Principal:
        return request.app.state.checker.require(request.headers.get("authorization"), scope)

    return dependency


Reader = Annotated[Principal, Depends(require("read"))]
Writer = Annotated[Principal, Depends(require("write"))]


# -- per-root permissions (CKPT_OIDC_GROUP_ROLES; static tokens hold their scope over every root) ------------

#: options naming paths a job reads besides its source (an export's side files, a merge's base model)
READ_OPTIONS = ("config_from", "base")


def job_uris(job: JobView, needed: Scope) -> list[str]:
    """What a job is judged by: to read it, its source, its target and the paths its options read
    (READ_OPTIONS); to change it, its target (else its source)."""
    if needed == "read":
        read = [getattr(job.spec.options, option, None) for option in READ_OPTIONS]
        return [job.spec.source, *([job.spec.target] if job.spec.target else []), *(uri for uri in read if uri)]
    return [job.spec.target or job.spec.source]


def may_job(principal: Principal, job: JobView) -> bool:
    return all(principal.may(uri, "read") for uri in job_uris(job, "read"))


def check_job(principal: Principal, job: JobView, needed: Scope) -> None:
    for uri in job_uris(job, needed):
        principal.check(uri, needed, f"job {job.id}")


def job_reader(principal: Principal, job: Callable[[str], JobView]) -> Callable[[str], bool]:
    """`may_read_job(job_id)` for one request: whether `principal` may read that job (False for a job gone
    since), each job looked up once."""
    known: dict[str, bool] = {}

    def may_read_job(job_id: str) -> bool:
        if principal.roots is None:
            return True
        if job_id not in known:
            try:
                known[job_id] = may_job(principal, job(job_id))
            except NotFound:
                known[job_id] = False
        return known[job_id]

    return may_read_job


def may_read_job(request: Request, principal: Principal) -> Callable[[str], bool]:
    """`job_reader` over the service's jobs, for one request."""
    service = request.app.state.service
    return job_reader(principal, lambda job_id: service.job(job_id).view())


def visible_checkpoint(principal: Principal, view: CheckpointView, may_read_job: Callable[[str], bool]
                       ) -> CheckpointView:
    """A readable checkpoint as `principal` may see it: `made_by_job`, and the job `registered_via` names,
    blanked when that job reads or writes a root the caller may not read."""
    if principal.roots is None:
        return view
    update: dict[str, object] = {}
    if view.made_by_job is not None and not may_read_job(view.made_by_job):
        update["made_by_job"] = None
    via = view.registered_via or {}
    if "job" in via and not may_read_job(via["job"]):
        update["registered_via"] = {key: value for key, value in via.items() if key != "job"}
    return view.model_copy(update=update) if update else view


def visible_lineage(principal: Principal, view: LineageView, may_read_job: Callable[[str], bool]
                    ) -> tuple[LineageView, int]:
    """A readable checkpoint's lineage as `principal` may see it, and how many checkpoints were left out.

    Ancestors and descendants under roots the caller may not read are dropped (not named, not counted by id):
    the walk itself goes through them, so a readable grandparent still shows at depth 2, and the count tells
    that something was left out. An edge's job id is kept only when the caller may read that job."""
    if principal.roots is None:
        return view, 0
    hidden = 0

    def keep(edges: list[LineageEdge]) -> list[LineageEdge]:
        nonlocal hidden
        kept = []
        for edge in edges:
            if not principal.may(edge.checkpoint.uri, "read"):
                hidden += 1
                continue
            job_id = edge.job_id if edge.job_id is None or may_read_job(edge.job_id) else None
            kept.append(edge.model_copy(update={"job_id": job_id,
                                                "checkpoint": visible_checkpoint(principal, edge.checkpoint,
                                                                                 may_read_job)}))
        return kept

    shown = LineageView(checkpoint=visible_checkpoint(principal, view.checkpoint, may_read_job),
                        ancestors=keep(view.ancestors), descendants=keep(view.descendants))
    return shown, hidden


def rule_uris(spec: RuleSpec) -> tuple[str, ...]:
    """A rule's pattern folder (read) and a target it would write (none for a scan or scrub rule)."""
    if spec.job.target is None:
        return (_fixed_part(spec.pattern),)
    return _fixed_part(spec.pattern), render(spec.job.target, "run", 1, "name")


def check_rule(principal: Principal, spec: RuleSpec, needed: Scope) -> None:
    """To see a rule, read its pattern folder and where its jobs write (its target template names that root);
    to change it, also `needed` over that target."""
    if principal.roots is None:
        return
    pattern, *target = rule_uris(spec)
    principal.check(pattern, "read", f"rule {spec.name} pattern")
    if target:
        principal.check(target[0], "read" if needed == "read" else needed, f"rule {spec.name} job.target")
    elif needed != "read":  # a scan or scrub rule writes nothing: changing it is `needed` over what it reads
        principal.check(pattern, needed, f"rule {spec.name} pattern")


def may_rule(principal: Principal, spec: RuleSpec) -> bool:
    if principal.roots is None:
        return True
    return all(principal.may(uri, "read") for uri in rule_uris(spec))
