"""Response shapes of the API that are not job or checkpoint documents themselves."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from ckpt_service.jobs import JobView
from ckpt_service.registry import CheckpointView


class ErrorDetail(BaseModel):
    type: str
    message: str
    fields: list[dict[str, str]] | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


class JobPage(BaseModel):
    items: list[JobView]
    next_cursor: str | None = None
    unreadable: list[str] = Field(default_factory=list, description="Ids of jobs on this page whose stored "
                                  "entry cannot be read (damaged); they are left out of items.")


class CheckpointPage(BaseModel):
    items: list[CheckpointView]
    next_cursor: str | None = None
    unreadable: list[str] = Field(default_factory=list, description="Ids of checkpoints on this page whose stored "
                                  "entry cannot be read (damaged); they are left out of items.")


class Health(BaseModel):
    status: str


class Ready(BaseModel):
    status: str
    checks: dict[str, Any]


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for the error statuses a route can return."""
    return {status: {"model": ErrorBody} for status in statuses}
