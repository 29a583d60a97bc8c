"""The job model: what a client submits (`JobSpec`), how the store keeps it (`JobRecord`), what it sees (`JobView`).

Options mirror the `ckptctl` flags one to one (`--max-shard-size` is `max_shard_size`, `--from` is
`source_format`, `--keep-keys` is `clean_keys: false`); unset options take the offline command's
defaults for that kind.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Annotated, Any, Literal

from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, field_validator

from .units import parse_size

Kind = Literal["convert", "export", "reshard", "verify", "inspect"]
State = Literal["queued", "running", "succeeded", "failed", "cancelled"]
KINDS: tuple[str, ...] = ("convert", "export", "reshard", "verify", "inspect")
STATES: tuple[str, ...] = ("queued", "running", "succeeded", "failed", "cancelled")
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
WRITING_KINDS = frozenset({"convert", "export", "reshard"})

#: The engine's reader names (`converters.formats.READERS`; a test keeps the two lists equal).
Format = Literal["dcp", "accelerate", "hf-dcp", "safetensors", "torch", "rank-files", "megatron", "lightning",
                 "deepspeed", "deepspeed-module"]
Text = Annotated[str, Field(min_length=1, max_length=1024)]
Texts = Annotated[list[Text], Field(max_length=256)]
Size = Annotated[int | str, Field(description="Bytes, or a size such as 5GB or 256MiB.")]

#: Which options each kind takes; setting another is a 422 naming the option.
APPLIES: dict[str, frozenset[str]] = {
    "convert": frozenset({"source_format", "to", "only", "clean_keys", "rename", "include", "exclude", "dtype",
                          "max_shard_size", "memory_limit", "overwrite", "drop_tied", "verify"}),
    "export": frozenset({"source_format", "only", "clean_keys", "rename", "include", "exclude", "dtype",
                         "max_shard_size", "memory_limit", "overwrite", "drop_tied", "verify"}),
    "reshard": frozenset({"source_format", "only", "clean_keys", "rename", "include", "exclude", "dtype",
                          "dtype_optim", "memory_limit", "overwrite", "verify", "world_size", "layout",
                          "shard_dim_rule"}),
    "verify": frozenset({"source_format", "target_format", "only", "clean_keys", "rename", "include", "exclude",
                         "memory_limit", "atol", "rtol"}),
    "inspect": frozenset({"source_format", "tensors"}),
}
#: The offline commands' defaults (`ckptctl export` keeps the model and cleans keys, `convert` keeps everything;
#: reshard keeps keys with `only: all`, a training state, and cleans them otherwise: None).
DEFAULT_ONLY = {"convert": "all", "export": "model", "reshard": "model", "verify": "all"}
DEFAULT_CLEAN: dict[str, bool | None] = {"convert": False, "export": True, "reshard": None, "verify": True}


class JobOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source_format: Format | None = Field(None, description="--from: force the source format.")
    target_format: Format | None = Field(None, description="verify --from-b: format of the target.")
    to: Literal["safetensors", "torch"] | None = Field(None, description="convert --to.")
    only: Literal["model", "optim", "all"] | None = None
    clean_keys: bool | None = Field(None, description="Strip wrapper prefixes (false is --keep-keys).")
    rename: Texts = Field(default_factory=list, description="REGEX=REPLACEMENT, applied in order.")
    include: Texts = Field(default_factory=list)
    exclude: Texts = Field(default_factory=list)
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    dtype_optim: bool = False
    max_shard_size: Size | None = None
    memory_limit: Size = 256 * 1024 * 1024
    overwrite: bool = False
    drop_tied: Texts = Field(default_factory=list)
    verify: bool = False
    world_size: int | None = Field(None, ge=1, le=65536)
    layout: Literal["fsdp2"] | None = None
    shard_dim_rule: Texts = Field(default_factory=list, description="REGEX=DIM.")
    atol: float = Field(0.0, ge=0, le=1e6)
    rtol: float = Field(0.0, ge=0, le=1e6)
    tensors: bool = Field(False, description="inspect: include the tensor table.")

    @field_validator("max_shard_size", "memory_limit", mode="after")
    @classmethod
    def _size(cls, value: int | str | None) -> int | None:
        if value is None:
            return None
        try:
            size = parse_size(value)
        except Exception:
            raise ValueError("write a number of bytes or a size such as 5GB or 256MiB") from None
        if size <= 0:
            raise ValueError("must be positive")
        return size


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


def _when(value: float | None) -> datetime | None:
    return None if value is None else datetime.fromtimestamp(value, tz=timezone.utc)


@dataclass
class JobRecord:
    """One row of the jobs table, JSON columns decoded."""

    id: str
    kind: str
    state: str
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
        return JobView(id=self.id, kind=self.kind, state=self.state, spec=JobSpec.model_validate(self.spec),  # type: ignore[arg-type]
                       attempt=self.attempt, max_attempts=self.max_attempts, cancel_requested=self.cancel_requested,
                       progress=self.progress_view(), error=error, result=self.result,
                       created_at=_when(self.created_at), started_at=_when(self.started_at),  # type: ignore[arg-type]
                       finished_at=_when(self.finished_at), updated_at=_when(self.updated_at),  # type: ignore[arg-type]
                       worker=self.worker, pid=self.pid, submitted_by=self.submitted_by)

    def document(self) -> dict[str, Any]:
        return self.view().model_dump(mode="json")
