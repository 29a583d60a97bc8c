"""Run one job: map its spec to the engine call the offline command makes, store progress (throttled),
and record the outcome with the registry entries of its output, in one transaction.

This runs inside the job's own process (`python -m ckpt_service.worker_main`); `worker.py` starts and
watches that process. `engine_call` is also used at submit time to reject bad options before queueing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

from converters import storage
from converters.errors import CkptError

from . import logs, roots
from .errors import ServiceError
from .jobs import DEFAULT_CLEAN, DEFAULT_ONLY, WRITING_KINDS, JobSpec
from .registry import Registry
from .store import JobStore

EngineCall = Callable[[Callable[[Any], None] | None], Any]


class VerifyFailed(Exception):
    """A verify job found differences: the job fails, and its result keeps the report."""

    def __init__(self, report: Any) -> None:
        super().__init__(report.summary())
        self.report = report


def key_options(spec: JobSpec) -> Any:
    from converters.transforms import KeyOptions

    opts = spec.options
    clean = DEFAULT_CLEAN[spec.kind] if opts.clean_keys is None else opts.clean_keys
    return KeyOptions(only=opts.only or DEFAULT_ONLY[spec.kind], clean=clean,  # type: ignore[arg-type]
                      renames=KeyOptions.parse_renames(opts.rename), include=list(opts.include),
                      exclude=list(opts.exclude))


def engine_call(spec: JobSpec) -> EngineCall:
    """The engine call for `spec`, with its option objects built (so bad options raise OptionError now)."""
    opts, source, target = spec.options, spec.source, spec.target or ""
    if spec.kind == "inspect":
        from converters.api import inspect

        from .summary import summarize

        return lambda _progress: summarize(inspect(source, opts.source_format), opts.tensors)
    keys = key_options(spec)
    memory_limit = int(opts.memory_limit)
    if spec.kind == "verify":
        from converters.api import verify

        keys.nest = False

        def run_verify(_progress: Callable[[Any], None] | None) -> Any:
            report = verify(source, target, keys=keys, atol=opts.atol, rtol=opts.rtol, a_format=opts.source_format,
                            b_format=opts.target_format, memory_limit=memory_limit)
            if not report.ok:
                raise VerifyFailed(report)
            return report
        return run_verify
    if spec.kind == "reshard":
        from converters.layouts import parse_dim_rules
        from converters.reshard import ReshardOptions, reshard

        reshard_options = ReshardOptions(world_size=opts.world_size or 0, layout=opts.layout or "fsdp2",
                                         dim_rules=parse_dim_rules(opts.shard_dim_rule), keys=keys,
                                         source_format=opts.source_format, dtype=opts.dtype,
                                         dtype_optim=opts.dtype_optim, memory_limit=memory_limit,
                                         overwrite=opts.overwrite, verify=opts.verify)
        return lambda progress: reshard(source, target, reshard_options, progress)
    from converters.api import DEFAULT_SHARD_SIZE, ConvertOptions, convert

    to = "safetensors" if spec.kind == "export" else (opts.to or "safetensors")
    convert_options = ConvertOptions(to=to, source_format=opts.source_format, keys=keys,  # type: ignore[arg-type]
                                     dtype=opts.dtype, max_shard_size=int(opts.max_shard_size or DEFAULT_SHARD_SIZE),
                                     memory_limit=memory_limit, overwrite=opts.overwrite,
                                     drop_tied=list(opts.drop_tied), verify=opts.verify,
                                     export=spec.kind == "export")
    return lambda progress: convert(source, target, convert_options, progress)


class ProgressWriter:
    """The engine's progress callback: stores at most one update per `interval` seconds (and the last one
    on `flush`); with `max_bytes_per_second`, holds the engine back to that rate (a bandwidth cap)."""

    def __init__(self, store: JobStore, job_id: str, attempt: int, interval: float,
                 max_bytes_per_second: int = 0) -> None:
        self.store, self.job_id, self.attempt, self.interval = store, job_id, attempt, interval
        self.rate = max_bytes_per_second
        self.start = time.monotonic()
        self.last = 0.0
        self.latest: dict[str, Any] | None = None

    def __call__(self, p: Any) -> None:
        self.latest = {"done_bytes": p.done_bytes, "total_bytes": p.total_bytes, "done_tensors": p.done_tensors,
                       "total_tensors": p.total_tensors}
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.last = now
            self.flush()
        if self.rate:
            ahead = p.done_bytes / self.rate - (now - self.start)
            if ahead > 0:
                time.sleep(min(ahead, 1.0))

    def flush(self) -> None:
        if self.latest is not None:
            self.store.set_progress(self.job_id, self.attempt, {**self.latest, "at": time.time()})


def clean_target(target: str | None, overwrite: bool) -> list[str]:
    """Remove what an interrupted attempt may have left: the engine's temporary siblings of `target`
    (`.NAME.tmp-XXXXXXXX`), and, unless the job overwrites, the target itself (the API refused the job if
    it existed before, so it can only be this job's own, unrecorded output)."""
    if not target or not storage.is_local(target):
        return []
    path = os.path.abspath(storage.local_path(target))
    parent, base = os.path.split(path)
    found = []
    if os.path.isdir(parent):
        found = [os.path.join(parent, n) for n in os.listdir(parent) if n.startswith(f".{base}.tmp-")]
    if not overwrite and os.path.lexists(path):
        found.append(path)
    for item in found:
        if os.path.isdir(item) and not os.path.islink(item):
            shutil.rmtree(item, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(item)
    return found


class _Lost(Exception):
    """The attempt is no longer current (requeued or failed elsewhere): roll back and record nothing."""


def _summary(uri: str, source_format: str | None = None) -> dict[str, Any] | None:
    from converters.api import inspect

    from .summary import summarize

    try:
        return summarize(inspect(uri, source_format))
    except CkptError as exc:
        logs.event("registry.inspect_failed", uri=uri, error=str(exc))
        return None


def _succeed(store: JobStore, spec: JobSpec, job_id: str, attempt: int, value: Any) -> bool:
    result: dict[str, Any]
    output = None
    if spec.kind == "inspect":
        result = value
    elif spec.kind == "verify":
        result = {**value.to_dict(), "summary": value.summary()}
    else:
        result = value.to_dict()
        result["total_bytes"] = sum(o["bytes"] for o in result["outputs"])
        if value.verify is not None:
            result["verify_summary"] = value.verify.summary()
        output = _summary(spec.target or "")
    registry = Registry(store)
    source_summary = None
    if output is not None and registry.find_uri(spec.source) is None:
        source_summary = _summary(spec.source, spec.options.source_format)
    try:
        with store.transaction() as conn:
            if output is not None:
                result["checkpoint_id"] = registry.record_output(conn, uri=spec.target or "", summary=output,
                                                                 job_id=job_id, source_uri=spec.source,
                                                                 source_summary=source_summary)
            if not store.finish(conn, job_id, attempt, "succeeded", result=result):
                raise _Lost
    except _Lost:
        return False
    return True


def recheck_roots(spec: JobSpec, read: list[roots.Location], write: list[roots.Location]) -> None:
    """Check the roots again where the job runs: a symlink swapped in since the job was queued is caught."""
    roots.check(spec.source, read, field="source", purpose="read")
    if spec.target is not None:
        writing = spec.kind in WRITING_KINDS
        roots.check(spec.target, write if writing else read, field="target", purpose="write" if writing else "read")


def run_job(store: JobStore, job_id: str, attempt: int, progress_seconds: float = 0.5,
            max_bytes_per_second: int = 0,
            allowed: tuple[list[roots.Location], list[roots.Location]] | None = None) -> int:
    """Run attempt `attempt` of `job_id` to the end and record it. Returns 0, or 3 when the job was not ours.

    `allowed` (read roots, write roots) makes the job check its paths again before it starts."""
    job = store.get(job_id)
    if job.state != "running" or job.attempt != attempt:
        logs.event("job.not_current", job_id=job_id, attempt=attempt, state=job.state)
        return 3
    spec = JobSpec.model_validate(job.spec)
    writer = ProgressWriter(store, job_id, attempt, progress_seconds, max_bytes_per_second)
    started = time.monotonic()
    logs.event("job.started", job_id=job_id, attempt=attempt, kind=spec.kind, source=spec.source,
               target=spec.target, pid=os.getpid())
    try:
        if allowed is not None:
            recheck_roots(spec, *allowed)
        value = engine_call(spec)(writer)
        writer.flush()
        ok = _succeed(store, spec, job_id, attempt, value)
        logs.event("job.succeeded" if ok else "job.not_current", job_id=job_id, attempt=attempt,
                   seconds=round(time.monotonic() - started, 3))
        return 0 if ok else 3
    except VerifyFailed as exc:
        report = {**exc.report.to_dict(), "summary": exc.report.summary()}
        store.finish_now(job_id, attempt, "failed", result=report, error=("VerifyError", f"checkpoints differ: {exc}"))
        logs.event("job.failed", job_id=job_id, attempt=attempt, error_type="VerifyError")
    except (CkptError, ServiceError) as exc:
        store.finish_now(job_id, attempt, "failed", error=(type(exc).__name__, str(exc)))
        logs.event("job.failed", job_id=job_id, attempt=attempt, error_type=type(exc).__name__, error=str(exc))
    except Exception as exc:  # a bug, or an OS error the engine did not wrap: fail the job, keep the trace in the log
        message = f"{type(exc).__name__}: {exc}"[:500]
        store.finish_now(job_id, attempt, "failed", error=("InternalError", message))
        logs.event("job.failed", job_id=job_id, attempt=attempt, error_type="InternalError", exc_info=True)
    return 0
