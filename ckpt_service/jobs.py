"""The job model: what a client submits (`JobSpec`), how the store keeps it (`JobRecord`), what it sees (`JobView`).

A spec's `options` are those of its kind's request model (`job_requests`), which mirror the `ckptctl`
flags one to one (`--max-shard-size` is `max_shard_size`, `--from` is `source_format`, `--keep-keys` is
`clean_keys: false`); unset options take that kind's defaults, and a queued job's spec shows them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal, Optional, get_args, get_type_hints

from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, create_model

from . import job_kinds
from .job_requests import Format, JobRequest, build, shape, shared_default
from .units import when

__all__ = ["APPLIES", "KINDS", "STATES", "TERMINAL", "WRITE_TARGET_KINDS", "WRITING_KINDS", "Format", "JobOptions",
           "JobSpec"]

#: the job kinds (`job_kinds`), fixed from here on: the models below are built from them
_KINDS = job_kinds.freeze(__name__)
KINDS: tuple[str, ...] = job_kinds.names()
WRITING_KINDS = frozenset(job_kinds.names(writes=True))
#: the kinds whose target is written (an output, or an archive store): checked against the write roots
WRITE_TARGET_KINDS = frozenset(k.name for k in _KINDS.values() if k.writes_target)
REQUESTS: dict[str, type[JobRequest]] = {kind.name: kind.request for kind in _KINDS.values()}
#: Which options each kind takes; setting another is a 422 naming the option.
APPLIES: dict[str, frozenset[str]] = {name: frozenset(model.model_fields) for name, model in REQUESTS.items()}
if TYPE_CHECKING:
    #: A declared kind's name. Kinds are declared at run time (`job_kinds.declare`), so to a type checker a
    #: kind is a string; the schema and validation see the Literal of the kinds declared at import.
    Kind = str
else:
    Kind = Literal[KINDS]
State = Literal["queued", "running", "succeeded", "failed", "cancelled"]
STATES: tuple[str, ...] = get_args(State)
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})


def _options_model() -> type[BaseModel]:
    """Every option of every kind, typed and described as in its request model (which kinds take it is said
    in its description), each optional: null, or unset, is the kind's default. An option's default here is
    the one its kinds share (`memory_limit`), or null where they differ (`only`)."""
    fields: dict[str, Any] = {}
    for model in REQUESTS.values():
        hints = get_type_hints(model, include_extras=True)
        for name, info in model.model_fields.items():
            if name in fields:
                continue
            kinds = ", ".join(k for k in REQUESTS if name in APPLIES[k])
            default, value = shared_default(name), shape(hints[name])
            # flags, tolerances and lists always have a value (as before); the rest may be null
            valued = default is not None and not value.optional and value.kind in ("bool", "float", "list")
            annotation = hints[name] if valued else Optional[hints[name]]  # noqa: UP045 (built at run time)
            fields[name] = (annotation, Field(default, description=f"{info.description} ({kinds})"))
    return create_model("JobOptions", __config__=ConfigDict(extra="forbid"), **fields)


if TYPE_CHECKING:
    class JobOptions(BaseModel):
        """Every option of every declared kind (`_options_model`). The kinds, so the fields, are known only at
        run time: to a type checker an option is any value."""

        def __getattr__(self, name: str) -> Any: ...
else:
    JobOptions = _options_model()


def request_of(kind: str, options: BaseModel) -> JobRequest:
    """The kind's request model from a spec's options (null and other kinds' options left out; the API has
    already refused options that do not apply)."""
    values = options.model_dump(exclude_none=True)
    return build(kind, {k: v for k, v in values.items() if k in APPLIES[kind]})


class JobSpec(BaseModel):
    """A job request. `target` is the output for convert/export/reshard and the second checkpoint for verify."""

    model_config = ConfigDict(extra="forbid")

    kind: Kind
    source: str = Field(min_length=1, max_length=4096, description="Checkpoint path or URI.")
    target: str | None = Field(None, min_length=1, max_length=4096)
    options: JobOptions = Field(default_factory=JobOptions)
    callback_url: AnyHttpUrl | None = Field(None, description="POSTed the final job document once the job ends.")


class JobProgress(BaseModel):
    done_bytes: int = 0
    total_bytes: int = 0
    done_tensors: int = 0
    total_tensors: int = 0
    fraction: float | None = None
    throughput_bytes_per_s: float | None = None
    eta_seconds: float | None = None


class JobError(BaseModel):
    type: str
    message: str


class JobView(BaseModel):
    """The job document: GET /v1/jobs/{id}, SSE events, callbacks and `ckptctl status --json`."""

    id: str
    kind: Kind
    state: State
    spec: JobSpec
    attempt: int
    max_attempts: int
    cancel_requested: bool = False
    progress: JobProgress | None = None
    error: JobError | None = None
    result: dict[str, Any] | None = None
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    updated_at: datetime
    worker: str | None = None
    pid: int | None = None
    submitted_by: str | None = None


@dataclass
class JobRecord:
    """One row of the jobs table, JSON columns decoded."""

    id: str
    kind: str
    state: State
    spec: dict[str, Any]
    attempt: int
    max_attempts: int
    cancel_requested: bool
    worker: str | None
    lease_until: float | None
    pid: int | None
    progress: dict[str, Any] | None
    result: dict[str, Any] | None
    error_type: str | None
    error_message: str | None
    target: str | None
    callback_url: str | None
    submitted_by: str | None
    created_at: float
    started_at: float | None
    attempt_started_at: float | None
    finished_at: float | None
    updated_at: float

    @classmethod
    def from_row(cls, row: Any) -> JobRecord:
        keys = row.keys()

        def get(name: str, default: Any = None) -> Any:
            return row[name] if name in keys else default

        def decode(name: str) -> Any:
            value = get(name)
            return json.loads(value) if value else None

        return cls(id=row["id"], kind=row["kind"], state=row["state"], spec=json.loads(row["spec"]),
                   attempt=row["attempt"], max_attempts=row["max_attempts"],
                   cancel_requested=bool(get("cancel_requested", 0)), worker=row["worker"],
                   lease_until=row["lease_until"], pid=row["pid"], progress=decode("progress"),
                   result=decode("result"), error_type=row["error_type"], error_message=row["error_message"],
                   target=get("target"), callback_url=get("callback_url"), submitted_by=get("submitted_by"),
                   created_at=row["created_at"], started_at=row["started_at"],
                   attempt_started_at=row["attempt_started_at"], finished_at=row["finished_at"],
                   updated_at=row["updated_at"])

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def progress_view(self) -> JobProgress | None:
        if not self.progress:
            return None
        p = self.progress
        view = JobProgress(done_bytes=p.get("done_bytes", 0), total_bytes=p.get("total_bytes", 0),
                           done_tensors=p.get("done_tensors", 0), total_tensors=p.get("total_tensors", 0))
        if view.total_bytes:
            view.fraction = round(view.done_bytes / view.total_bytes, 4)
        elapsed = (p.get("at") or 0) - (self.attempt_started_at or 0)
        if elapsed > 0 and view.done_bytes:
            view.throughput_bytes_per_s = round(view.done_bytes / elapsed, 1)
            if self.state == "running":
                view.eta_seconds = round((view.total_bytes - view.done_bytes) / view.throughput_bytes_per_s, 1)
        return view

    def view(self) -> JobView:
        error = JobError(type=self.error_type, message=self.error_message or "") if self.error_type else None
        return JobView(id=self.id, kind=self.kind, state=self.state, spec=JobSpec.model_validate(self.spec),
                       attempt=self.attempt, max_attempts=self.max_attempts, cancel_requested=self.cancel_requested,
                       progress=self.progress_view(), error=error, result=self.result,
                       created_at=when(self.created_at), started_at=when(self.started_at),
                       finished_at=when(self.finished_at), updated_at=when(self.updated_at),
                       worker=self.worker, pid=self.pid, submitted_by=self.submitted_by)

    def document(self) -> dict[str, Any]:
        return self.view().model_dump(mode="json")
