"""/v1/checkpoints: register (inspects the URI), list, show, lineage, unregister (optionally purge)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request
from pydantic import Field

from ckpt_service.auth import Principal, Scope
from ckpt_service.integrity import IntegrityView, integrity
from ckpt_service.registry import CheckpointView, LineageView, RegisterRequest

from .schemas import CheckpointPage, errors
from .security import Reader, Writer, may_read_job, visible_checkpoint, visible_lineage

router = APIRouter(prefix="/v1/checkpoints", tags=["checkpoints"])
# an id, or a name, NAME@RUN, ALIAS@RUN (`CkptService.checkpoint` resolves them)
CheckpointId = Annotated[str, Path(min_length=1, max_length=130, pattern=r"^[A-Za-z0-9_.@-]+$")]


def _check(request: Request, principal: Principal, checkpoint_id: str, needed: Scope) -> None:
    """403 (one line) unless the caller holds `needed` over the checkpoint's URI (static tokens: their scope,
    already checked, holds everywhere)."""
    if principal.roots is not None:
        uri = request.app.state.service.checkpoint(checkpoint_id).uri
        principal.check(uri, needed, f"checkpoint {checkpoint_id}")


@router.post("", status_code=201, response_model=CheckpointView,
             responses=errors(400, 401, 403, 409, 413, 422, 503), summary="Register a checkpoint")
def register(body: RegisterRequest, request: Request, principal: Writer) -> CheckpointView:
    """Inspect the URI (metadata only) and record it with a name, tags and metadata, owned by the caller."""
    service = request.app.state.service
    principal.check(body.uri, "write", "uri")
    return service.register(body, principal.name)


@router.get("", response_model=CheckpointPage, responses=errors(401, 403, 422, 503), summary="List checkpoints")
def list_checkpoints(request: Request, principal: Reader,
                     name: Annotated[str | None, Query(max_length=200)] = None,
                     tag: Annotated[str | None, Query(max_length=64)] = None,
                     format: Annotated[str | None, Query(max_length=32)] = None,
                     limit: Annotated[int, Query(ge=1, le=200)] = 50,
                     cursor: Annotated[str | None, Query(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")] = None,
                     archived: Annotated[bool, Query(description="Instead of the live checkpoints, those an archive "
                                                     "store holds, live or with their files deleted (restorable).")
                                         ] = False
                     ) -> CheckpointPage:
    """Live checkpoints (not those GC or a purge deleted), each with the archives that hold it; `?archived=true`:
    the archived ones, restorable even when their files were deleted. `unreadable` names damaged entries left out."""
    # the store filters by the caller's readable roots, so a page is full; the check after it stays exact
    items, next_cursor, unreadable = request.app.state.service.checkpoints(name, tag, format, limit, cursor,
                                                                           principal.readable(), archived)
    jobs = may_read_job(request, principal)
    items = [visible_checkpoint(principal, view, jobs) for view in items if principal.may(view.uri, "read")]
    return CheckpointPage(items=items, next_cursor=next_cursor, unreadable=unreadable)


@router.get("/{checkpoint_id}", response_model=CheckpointView, responses=errors(401, 403, 404, 422, 503),
            summary="Show a checkpoint")
def show(checkpoint_id: CheckpointId, request: Request, principal: Reader,
         tensors: bool = False) -> CheckpointView:
    """The stored summary; `?tensors=true` re-reads the metadata and adds the tensor table. A checkpoint whose
    data GC or a purge deleted is still shown, with `deleted_at` set."""
    _check(request, principal, checkpoint_id, "read")
    view = request.app.state.service.checkpoint(checkpoint_id, tensors)
    return visible_checkpoint(principal, view, may_read_job(request, principal))


@router.get("/{checkpoint_id}/stats", responses=errors(401, 403, 404, 422, 503), summary="A checkpoint's statistics")
def stats(checkpoint_id: CheckpointId, request: Request, principal: Reader) -> dict[str, Any]:
    """Per-tensor statistics (counts of NaN, +Inf, -Inf and zeros, min, max, mean, std, L2 norm) from the newest
    succeeded `scan` job of the checkpoint's URI; 404 until one has run."""
    _check(request, principal, checkpoint_id, "read")
    result: dict[str, Any] = request.app.state.service.stats(checkpoint_id)
    return result


@router.get("/{checkpoint_id}/integrity", response_model=IntegrityView, responses=errors(401, 403, 404, 422, 503),
            summary="A checkpoint's certificate and scrub status")
def integrity_status(checkpoint_id: CheckpointId, request: Request, principal: Reader) -> IntegrityView:
    """Whether its manifest carries a conversion certificate (what it covers), its newest scrub job and that
    job's outcome, and whether a scrub marked it `damaged`: one look-up, no checkpoint data read."""
    _check(request, principal, checkpoint_id, "read")
    return integrity(request.app.state.service, checkpoint_id)


class ScopedLineage(LineageView):
    hidden: int = Field(0, description="Ancestors and descendants left out: they lie under roots the caller may "
                                       "not read (CKPT_OIDC_GROUP_ROLES); never named.")


@router.get("/{checkpoint_id}/lineage", response_model=ScopedLineage, responses=errors(401, 403, 404, 422, 503),
            summary="Walk a checkpoint's lineage")
def lineage(checkpoint_id: CheckpointId, request: Request, principal: Reader) -> ScopedLineage:
    """Ancestors (what it was derived from, recursively) and descendants, each with the job that made it. Only
    checkpoints the caller may read are shown (`hidden` counts the others; the walk goes through them), and an
    edge's job id (and a checkpoint's made_by_job) only when the caller may read that job."""
    _check(request, principal, checkpoint_id, "read")
    service = request.app.state.service
    shown, hidden = visible_lineage(principal, service.lineage(checkpoint_id), may_read_job(request, principal))
    return ScopedLineage(**dict(shown), hidden=hidden)


@router.delete("/{checkpoint_id}", response_model=CheckpointView, responses=errors(401, 403, 404, 409, 422, 503),
               summary="Unregister a checkpoint")
def delete(checkpoint_id: CheckpointId, request: Request, principal: Writer,
           purge: Annotated[bool, Query(description="Delete the data too (admin; only under a write root)")] = False
           ) -> CheckpointView:
    """Unregister (the token that registered it, or an admin). With `purge` (admin) the data is deleted
    through the deletion log like GC, and the entry stays with `deleted_at` (409 when the path is now a
    symlink or another folder: nothing is deleted)."""
    if purge:
        principal = request.app.state.checker.require(request.headers.get("authorization"), "admin")
    _check(request, principal, checkpoint_id, "write")
    view = request.app.state.service.delete(checkpoint_id, purge, principal)
    return visible_checkpoint(principal, view, may_read_job(request, principal))
