"""/v1/jobs: submit (202), list, read, cancel, and follow a job's events."""

from __future__ import annotations

from typing import Annotated

import anyio
from fastapi import APIRouter, Header, Path, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from ckpt_service import joblogs
from ckpt_service.jobs import JobSpec, JobView, Kind, State

from .events import SlotStream, job_events
from .schemas import JobPage, errors
from .security import Reader, Writer, check_job, may_job

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
JobId = Annotated[str, Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]


@router.post("", status_code=202, response_model=JobView,
             responses=errors(400, 401, 403, 409, 413, 422, 429, 503), summary="Submit a job")
def submit(spec: JobSpec, request: Request, response: Response, principal: Writer,
           idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key", pattern=r"^[\x21-\x7e]{1,200}$",
                                                         description="Retries with the same key return the "
                                                                     "same job.")] = None) -> JobView:
    """Validate, authorise and queue a job. Returns 202 with the job; with a repeated `Idempotency-Key`,
    the job the first request made (header `Idempotent-Replayed: true`)."""
    job, created = request.app.state.service.submit(spec, principal, idempotency_key)
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    if not created:
        response.headers["Idempotent-Replayed"] = "true"
    return job


@router.get("", response_model=JobPage, responses=errors(401, 403, 422, 503), summary="List jobs")
def list_jobs(request: Request, principal: Reader, state: State | None = None,
              kind: Kind | None = None, limit: Annotated[int, Query(ge=1, le=200)] = 50,
              cursor: Annotated[str | None, Query(pattern=r"^[0-9]{1,18}$", description="next_cursor of the "
                                                                                       "previous page")] = None
              ) -> JobPage:
    """Newest first, only jobs whose source and target the caller may read; `unreadable` names damaged entries
    left out."""
    # the store filters by the caller's readable roots, so a page is full; the check after it stays exact
    items, next_cursor, unreadable = request.app.state.service.jobs(state, kind, limit, cursor, principal.readable())
    items = [job for job in items if may_job(principal, job)]
    return JobPage(items=items, next_cursor=next_cursor, unreadable=unreadable)


@router.get("/{job_id}", response_model=JobView, responses=errors(401, 403, 404, 422, 503), summary="Read a job")
def get_job(job_id: JobId, request: Request, principal: Reader) -> JobView:
    job = request.app.state.service.job(job_id).view()
    check_job(principal, job, "read")
    return job


@router.post("/{job_id}/cancel", response_model=JobView, responses=errors(401, 403, 404, 409, 422, 503),
             summary="Cancel a job")
def cancel(job_id: JobId, request: Request, principal: Writer) -> JobView:
    """A queued job is cancelled at once; a running job's process is stopped within seconds and its
    partial output removed (the job shows `cancel_requested` until then). Only the token name that
    submitted the job, or an admin, may cancel it (403 otherwise)."""
    check_job(principal, request.app.state.service.job(job_id).view(), "write")
    return request.app.state.service.cancel(job_id, principal)


class JobLogs(BaseModel):
    job_id: str
    text: str = Field(description="The job process's own output (stdout and stderr), newest last; every attempt "
                                  "after a `--- attempt N ---` line. Empty before the job started.")
    truncated: bool = Field(description="Older output was left out (the last 256 KiB are kept).")


@router.get("/{job_id}/logs", response_model=JobLogs, responses=errors(401, 403, 404, 422, 503),
            summary="A job's output")
def job_logs(job_id: JobId, request: Request, principal: Reader) -> JobLogs:
    """What the job's process printed, as kept by the worker that ran it (on this server's data directory)."""
    check_job(principal, request.app.state.service.job(job_id).view(), "read")  # 404 for an unknown job
    text, truncated = joblogs.read_tail(request.app.state.settings.data_dir, job_id)
    return JobLogs(job_id=job_id, text=text, truncated=truncated)


@router.get("/{job_id}/events", responses={200: {"content": {"text/event-stream": {}},
                                                 "description": "SSE: state, progress, end"},
                                           **errors(401, 403, 404, 422, 429, 503)},
            response_class=StreamingResponse, summary="Follow a job")
async def events(job_id: JobId, request: Request, principal: Reader) -> StreamingResponse:
    """Server-sent events until the job ends: `state` (the job document), `progress`, and `end`. Open
    streams are capped per token and in total (429 past either cap)."""
    service = request.app.state.service
    job = await anyio.to_thread.run_sync(service.job, job_id)  # 404 before the stream starts
    check_job(principal, job.view(), "read")
    give_back = request.app.state.streams.take(principal.name)
    return SlotStream(job_events(service, job_id, request.app.state.settings.poll_seconds), give_back,
                      media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
