"""A checkpoint's integrity at a glance (the dashboard's checkpoint page): whether its manifest carries a
conversion certificate and what it covers (recorded in the summary when the checkpoint was inspected), its
newest scrub job and that job's outcome, and whether a scrub tagged it `damaged`."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from .catalog import when
from .executor import DAMAGED
from .jobs import JobRecord

if TYPE_CHECKING:
    from .service import CkptService

MAX_NAMED = 5  # damaged ranges named per scrub


class CertificateCover(BaseModel):
    tensors: int = Field(description="Output tensors whose CRC-32 (and source ranges) the certificate records.")
    files: int = Field(description="Output files with a CRC-32 in the manifest.")
    source_files: int = Field(description="Source files the certificate names byte ranges of.")
    stats: bool = Field(description="The statistics of source and output are recorded side by side.")


class ScrubView(BaseModel):
    job_id: str
    state: str
    submitted_by: str | None
    created_at: datetime
    finished_at: datetime | None
    summary: str | None = Field(None, description="The scrub's one-line report (or its error).")
    damaged: list[str] = Field(default_factory=list, description=f"The first {MAX_NAMED} mismatches: file and "
                               "byte range.")


class IntegrityView(BaseModel):
    checkpoint_id: str
    uri: str
    damaged: bool = Field(description=f"A scrub found it differs from its checksums (the `{DAMAGED}` tag).")
    certificate: CertificateCover | None = Field(description="None: no certificate in a manifest (a checkpoint "
                                                 "a trainer wrote, or an output from before certificates).")
    last_scrub: ScrubView | None = Field(description="The newest scrub job of its URI; None until one ran.")
    baseline: str | None = Field(None, description="For a checkpoint without a manifest: \"baseline recorded at T "
                                 "(N files, B bytes)\", the checksums its first scrub recorded in the registry, "
                                 "which later scrubs compare with; None when there is none.")


def last_scrub(service: CkptService, uri: str) -> JobRecord | None:
    rows = service.store.query("SELECT * FROM jobs WHERE kind = 'scrub' AND json_extract(spec, '$.source') = ? "
                               "ORDER BY seq DESC LIMIT 1", (uri,))
    return JobRecord.from_row(rows[0]) if rows else None


def _scrub_view(job: JobRecord) -> ScrubView:
    result: dict[str, Any] = job.result or {}
    summary = result.get("summary") if isinstance(result.get("summary"), str) else job.error_message
    named = [str(d) for d in result.get("damaged") or []][:MAX_NAMED]
    return ScrubView(job_id=job.id, state=job.state, submitted_by=job.submitted_by, created_at=when(job.created_at),
                     finished_at=when(job.finished_at) if job.finished_at is not None else None,
                     summary=summary, damaged=named)


def integrity(service: CkptService, checkpoint_id: str) -> IntegrityView:
    view = service.checkpoint(checkpoint_id)
    cover = (view.summary or {}).get("certificate")
    job = last_scrub(service, view.uri)
    rows = service.store.query("SELECT recorded_at, files, bytes FROM checkpoint_baselines WHERE checkpoint_id = ?",
                               (view.id,))
    baseline = (f"baseline recorded at {when(rows[0]['recorded_at']).isoformat()} ({rows[0]['files']} files, "
                f"{rows[0]['bytes']} bytes)") if rows else None
    return IntegrityView(checkpoint_id=view.id, uri=view.uri, damaged=DAMAGED in view.tags,
                         certificate=CertificateCover.model_validate(cover) if isinstance(cover, dict) else None,
                         last_scrub=_scrub_view(job) if job is not None else None, baseline=baseline)
