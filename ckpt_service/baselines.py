"""Baselines: checksums the registry keeps for checkpoints that carry none (a trainer's DCP step, DeepSpeed folder,
torch file). The first scrub job of such a registered checkpoint records one (`converters.baseline`: each file's
size, mtime, CRC-32 and one per 16 MiB block; a scrub reads every byte anyway) and succeeds; later scrubs compare
with it and name each file and byte range that differs. Nothing is written into the checkpoint's folder."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from converters import BaselineReport, CertificateReport, NoChecksums, compare_baseline, record_baseline, scrub

from . import logs

if TYPE_CHECKING:
    from .store import JobStore


def recorded(store: JobStore, checkpoint_id: str) -> dict[str, Any] | None:
    """The baseline row of a checkpoint (recorded_at, job_id, files, bytes, baseline as JSON text), or None."""
    rows = store.query("SELECT recorded_at, job_id, files, bytes, baseline FROM checkpoint_baselines "
                       "WHERE checkpoint_id = ?", (checkpoint_id,))
    return dict(rows[0]) if rows else None


def scrub_with_baseline(store: JobStore, uri: str, job_id: str | None, memory_limit: int) -> CertificateReport:
    """`converters.scrub` of an output; for a checkpoint without a manifest, its baseline's record (first time)
    or comparison (later). An unregistered checkpoint without a manifest is refused (NoChecksums)."""
    from .registry import Registry

    try:
        return scrub(uri, memory_limit=memory_limit)
    except NoChecksums:
        view = Registry(store).find_uri(uri.rstrip("/"))
        if view is None:
            raise NoChecksums(f"{uri}: no recorded checksums (no manifest) and not registered, so no baseline can "
                              f"be kept for it; register it (ckptctl register {uri}) and scrub again",
                              uri=uri) from None
        row = recorded(store, view.id)
    if row is not None:
        return compare_baseline(uri, json.loads(row["baseline"]), float(row["recorded_at"]))
    at = time.time()
    baseline = record_baseline(uri)
    files = baseline["files"]
    total = sum(int(f["bytes"]) for f in files.values())
    with store.transaction() as conn:  # two first scrubs at once: the first one's stays
        conn.execute("INSERT INTO checkpoint_baselines (checkpoint_id, recorded_at, job_id, files, bytes, baseline) "
                     "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (checkpoint_id) DO NOTHING",
                     (view.id, at, job_id, len(files), total, json.dumps(baseline, separators=(",", ":"))))
    logs.event("registry.baseline", uri=uri, checkpoint_id=view.id, files=len(files), bytes=total)
    report = BaselineReport(uri.rstrip("/"), files=len(files), recorded_at=at, recorded_now=True)
    report.notes.append(f"no manifest: recorded a baseline of {len(files)} files ({total} bytes); later scrubs "
                        "compare with it")
    return report


def scrub_job(store: JobStore, source: str, job_id: str, memory_limit: int) -> Callable[[Any], Any]:
    """The engine call of a scrub job run by the service: raises VerifyError carrying the report on damage."""
    from converters import VerifyError

    def run(_progress: Any) -> Any:
        report = scrub_with_baseline(store, source, job_id, memory_limit)
        if not report.ok:
            raise VerifyError(report.summary() + ": " + "; ".join(report.damaged[:5]), report=report)
        return report
    return run
