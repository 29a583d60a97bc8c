"""Run one job: map its spec to the engine call the offline command makes (its kind's `engine`, declared in
`job_kinds`; the engine functions are here), store progress (throttled), and record the outcome (its kind's
`result`) with the registry entries of its output, in one transaction.

This runs inside the job's own process (`python -m ckpt_service.worker_main`); `worker.py` starts and
watches that process. `engine_call` is also used at submit time to reject bad options before queueing,
and by the offline commands (`ckptctl convert ...`) to run in-process.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from converters import CkptError, OptionError, SourceError, VerifyError, manifest_sidecar, storage, tmp_prefix

from . import logs, roots
from .helpers import remove_tree
from .job_requests import (
    ArchiveRequest,
    ConvertRequest,
    DiffRequest,
    ExportRequest,
    ImportRequest,
    InspectRequest,
    JobRequest,
    KeyedRequest,
    ReshardRequest,
    RestoreRequest,
    ScanRequest,
    ScrubRequest,
    VerifyRequest,
)

if TYPE_CHECKING:  # the job-side modules (pydantic job models, the store) load only when a job runs
    from .jobs import JobSpec
    from .store import JobStore

#: The key options of a keyed request (left at their defaults, a verify compares an export as it was made).
KEY_FIELDS = ("only", "clean_keys", "rename", "include", "exclude")
EngineCall = Callable[[Callable[[Any], None] | None], Any]


def key_options(request: KeyedRequest) -> Any:
    from converters import KeyOptions

    return KeyOptions(only=request.only, clean=request.clean_keys, renames=KeyOptions.parse_renames(request.rename),
                      include=list(request.include), exclude=list(request.exclude))


def engine_call(request: JobRequest, source: str, target: str | None = None) -> EngineCall:
    """The engine call for a job of `request`'s kind (its declaration's `engine`, `job_kinds`): the one mapping
    from request models to the engine, used by the offline commands and by jobs. Option objects are built
    now, so bad options raise OptionError here; a verify whose checkpoints differ raises VerifyError carrying
    the report."""
    from .job_kinds import kind_of

    tag, weights = getattr(request, "tag", None), getattr(request, "weights", None)
    if tag is not None or weights is not None:
        from converters import deepspeed_source as source_for

        source, fmt = source_for(source, getattr(request, "source_format", None), tag, weights)
        request = request.model_copy(update={"source_format": fmt, "tag": None, "weights": None})
    call = kind_of(request.kind).engine(request, source, target)
    return finite_first(request, source, call)


def finite_first(request: JobRequest, source: str, call: EngineCall) -> EngineCall:
    """`call`, run only once a scan of `source` holds every bound the request requires (`require`, and
    `finite` for `require_finite`: a rule that sets them never exports a diverged or blown-up step);
    otherwise one SourceError naming the tensors, statistics and bounds. `call` itself without bounds."""
    texts, finite = getattr(request, "require", None) or [], getattr(request, "require_finite", False)
    if not texts and not finite:
        return call
    from converters import check_bounds, parse_bounds  # numpy loads only for a guard

    bounds = parse_bounds(texts, finite)

    def run(progress: Callable[[Any], None] | None) -> Any:
        from converters import scan

        broken = check_bounds(bounds, scan(source, source_format=getattr(request, "source_format", None)).tensors)
        if broken:
            bounds_broken = [str(b.bound) for b in broken if b.bound.stat != "finite"]
            said = ["require_finite"] * (len(bounds_broken) < len(broken))
            said += [f"require {', '.join(bounds_broken)}"] if bounds_broken else []
            raise SourceError(f"{source}: {'; '.join(map(str, broken))}; nothing was written ({'; '.join(said)})",
                              uri=source)
        return call(progress)
    return run


def inspect_call(request: InspectRequest, source: str, target: str | None) -> EngineCall:
    from converters import inspect

    from .summary import summarize

    def run_inspect(progress: Callable[[Any], None] | None) -> dict[str, Any]:
        info = summarize(inspect(source, request.source_format), request.tensors)
        if request.stats:  # numpy and the statistics load only here
            from converters import scan

            info["stats"] = scan(source, source_format=request.source_format, on_progress=progress).to_dict()
        return info
    return run_inspect


def import_call(request: ImportRequest, source: str, target: str | None) -> EngineCall:
    from converters import import_hf

    return lambda _progress: import_hf(source, target or "", request.family, overwrite=request.overwrite,
                                       memory_limit=int(request.memory_limit), into=request.into,
                                       world_size=request.world_size)


#: the registry tag a scrub that found a mismatch puts on a checkpoint
DAMAGED = "damaged"


def scan_call(request: ScanRequest, source: str, target: str | None) -> EngineCall:
    from converters import scan

    keys = key_options(request)
    keys.nest = False
    return lambda progress: scan(source, source_format=request.source_format, keys=keys,
                                 memory_limit=int(request.memory_limit), on_progress=progress)


def scrub_call(request: ScrubRequest, source: str, target: str | None) -> EngineCall:
    """Re-check against the recorded checksums; a mismatch raises VerifyError carrying the report (a failed job
    that keeps it, and marks the registered checkpoint `damaged`)."""
    from converters import scrub

    def run_scrub(_progress: Callable[[Any], None] | None) -> Any:
        report = scrub(source, memory_limit=int(request.memory_limit))
        if not report.ok:
            raise VerifyError(report.summary() + ": " + "; ".join(report.damaged[:5]), report=report)
        return report
    return run_scrub


def archive_call(request: ArchiveRequest, source: str, target: str | None) -> EngineCall:
    """Archive `source` into the store `target` (`converters.archive`); the registry records it (`archived`)."""
    from converters import archive_checkpoint

    return lambda _progress: archive_checkpoint(source, target or "", request.archive_id)


def restore_call(request: RestoreRequest, source: str, target: str | None) -> EngineCall:
    """Restore archive `archive_id` of the store `source` to `target`, every chunk's hash checked."""
    from converters import restore_archive

    def run_restore(_progress: Callable[[Any], None] | None) -> dict[str, Any]:
        files = restore_archive(source, request.archive_id, target or "")
        return {"archive_id": request.archive_id, "store": source.rstrip("/"), "files": len(files)}
    return run_restore


def diff_call(request: DiffRequest, source: str, target: str | None) -> EngineCall:
    """Compare; checkpoints that differ beyond the tolerances raise VerifyError carrying the result (exit 1, a
    failed job that keeps it), as verify does."""
    from converters import diff

    keys = key_options(request)
    keys.nest = False

    def run_diff(progress: Callable[[Any], None] | None) -> Any:
        result = diff(source, target or "", rtol=request.rtol, atol=request.atol, a_format=request.source_format,
                      b_format=request.target_format, keys=keys, memory_limit=int(request.memory_limit),
                      on_progress=progress)
        if result.differs:
            raise VerifyError(result.summary(), report=result)
        return result
    return run_diff


def verify_call(request: VerifyRequest, source: str, target: str | None) -> EngineCall:
    from converters import verify

    keys = key_options(request)
    keys.nest = False
    # the default selection: the engine compares an export as it was made (its manifest says how)
    defaults = VerifyRequest()
    chosen = None if all(getattr(request, n) == getattr(defaults, n) for n in KEY_FIELDS) else keys

    def run_verify(_progress: Callable[[Any], None] | None) -> Any:
        if request.certificate:
            from converters import check_certificate

            checked = check_certificate(source, memory_limit=int(request.memory_limit))
            if not checked.ok:
                raise VerifyError(checked.summary() + ": " + "; ".join(checked.damaged[:5]), report=checked)
            return checked
        report = verify(source, target or "", keys=chosen, atol=request.atol, rtol=request.rtol,
                        a_format=request.source_format, b_format=request.target_format,
                        memory_limit=int(request.memory_limit))
        if not report.ok:
            raise VerifyError(report.summary(), report=report)
        return report
    return run_verify


def reshard_call(request: ReshardRequest, source: str, target: str | None) -> EngineCall:
    from converters import ReshardOptions, parse_dim_rules, reshard

    options = ReshardOptions(world_size=request.world_size, layout=request.layout,
                             dim_rules=parse_dim_rules(request.shard_dim_rule), keys=key_options(request),
                             source_format=request.source_format, dtype=request.dtype,
                             dtype_optim=request.dtype_optim, memory_limit=int(request.memory_limit),
                             overwrite=request.overwrite, verify=request.verify, output_layout=request.output_layout,
                             stats=request.stats)
    return lambda progress: reshard(source, target or "", options, progress)


def convert_call(request: ConvertRequest | ExportRequest, source: str, target: str | None) -> EngineCall:
    """convert and export (an export: safetensors, never optimizer state, optionally mapped to an HF model;
    or, with one of `EXPORT_MODES`, an FP8 model, a PEFT adapter folder or a merged model)."""
    from converters import ConvertOptions, convert

    export = request if isinstance(request, ExportRequest) else None
    if export is not None:
        modes = export_modes(export)
        if len(modes) == 2:
            return chained_call(export, source, target or "", *modes)
        if modes:
            return EXPORT_MODES[modes[0]][1](export, source, target or "")
    options = ConvertOptions(to=request.to if isinstance(request, ConvertRequest) else "safetensors",
                             source_format=request.source_format, keys=key_options(request), dtype=request.dtype,
                             max_shard_size=int(request.max_shard_size), memory_limit=int(request.memory_limit),
                             overwrite=request.overwrite, drop_tied=list(request.drop_tied), verify=request.verify,
                             export=export is not None, to_hf=export.to_hf if export else None,
                             config_from=export.config_from if export else None, stats=request.stats)
    return lambda progress: convert(source, target or "", options, progress)


def fp8_call(request: ExportRequest, source: str, target: str) -> EngineCall:
    from converters import export_fp8

    scheme = (request.quantize or "").upper().replace("-", "_")
    return lambda _progress: export_fp8(source, target, scheme, list(request.ignore),
                                        max_shard_size=int(request.max_shard_size),
                                        memory_limit=int(request.memory_limit), overwrite=request.overwrite,
                                        config_from=request.config_from, source_format=request.source_format)


def adapter_call(request: ExportRequest, source: str, target: str) -> EngineCall:
    from converters import export_adapter

    return lambda _progress: export_adapter(source, target, overwrite=request.overwrite,
                                            source_format=request.source_format,
                                            memory_limit=int(request.memory_limit))


def merged_call(request: ExportRequest, source: str, target: str) -> EngineCall:
    from converters import export_merged

    return lambda _progress: export_merged(source, target, request.base, dtype=request.dtype,
                                           max_shard_size=int(request.max_shard_size),
                                           memory_limit=int(request.memory_limit), overwrite=request.overwrite,
                                           config_from=request.config_from, source_format=request.source_format)


def gguf_call(request: ExportRequest, source: str, target: str) -> EngineCall:
    from converters import export_gguf

    return lambda _progress: export_gguf(source, target, request.gguf or "f16", overwrite=request.overwrite,
                                         memory_limit=int(request.memory_limit), config_from=request.config_from,
                                         source_format=request.source_format)


#: The exports other than the plain one, each chosen by one option: (the other options it takes, its engine call).
#: An option it does not take, set to other than its default, is refused with one line naming it.
_ALWAYS = frozenset({"source_format", "tag", "weights", "memory_limit", "overwrite", "require_finite", "require"})
EXPORT_MODES: dict[str, tuple[frozenset[str], Callable[[ExportRequest, str, str], EngineCall]]] = {
    "quantize": (_ALWAYS | {"ignore", "max_shard_size", "config_from"}, fp8_call),
    "adapter_only": (_ALWAYS, adapter_call),
    "merge_adapter": (_ALWAYS | {"base", "dtype", "max_shard_size", "config_from"}, merged_call),
    "gguf": (_ALWAYS | {"config_from"}, gguf_call),
}
#: each mode in words, and the options that belong to one mode only (refused without it)
MODE_WORDS = {"quantize": "an FP8 export", "adapter_only": "an adapter-only export",
              "merge_adapter": "a merged-adapter export", "gguf": "a GGUF export"}
_MODE_ONLY = {"ignore": "quantize", "base": "merge_adapter"}


#: modes that run one after the other in one export: the first's output (staged beside the target) is the
#: second's source
CHAINS = {("merge_adapter", "gguf"), ("merge_adapter", "quantize")}


def export_modes(request: ExportRequest) -> tuple[str, ...]:
    """Which export `request` asks for: () for the plain one, one mode, or a chain (`CHAINS`); refuses other
    pairs, and options the chosen modes do not take, in one line naming the option to change."""
    chosen = tuple(name for name in EXPORT_MODES if getattr(request, name))
    if len(chosen) > 1:
        chain = next((c for c in CHAINS if set(c) == set(chosen)), None)
        if chain is None:
            first, second = next((a, b) for i, a in enumerate(chosen) for b in chosen[i + 1:]
                                 if (a, b) not in CHAINS and (b, a) not in CHAINS)
            raise OptionError(f"{second}: {MODE_WORDS[first]} (`{first}`) cannot also be {MODE_WORDS[second]}; "
                              "choose one", option=second)
        chosen = chain
    # in a chain, the first output is only staged: its shard size shapes nothing the user gets
    takes = frozenset().union(*(EXPORT_MODES[m][0] - ({"max_shard_size"} if i < len(chosen) - 1 else set())
                                for i, m in enumerate(chosen)))
    words = " of ".join(MODE_WORDS[m] for m in reversed(chosen))
    defaults = ExportRequest()
    changed = [n for n in ExportRequest.model_fields
               if n not in EXPORT_MODES and getattr(request, n) != getattr(defaults, n)]
    for name in changed:
        if not chosen and name in _MODE_ONLY:
            raise OptionError(f"{name} applies only to {MODE_WORDS[_MODE_ONLY[name]]}; set `{_MODE_ONLY[name]}` or "
                              "leave it out", option=name)
        if chosen and name not in takes:
            raise OptionError(f"{name} does not apply to {words}; leave it out", option=name)
    return chosen


def chained_call(request: ExportRequest, source: str, target: str, first: str, second: str) -> EngineCall:
    """The adapter merged into a staging folder beside the target, then exported from there (`CHAINS`)."""
    from converters import through_merged

    merge = request.model_copy(update={"overwrite": False})
    then = request.model_copy(update={"source_format": None, "tag": None, "weights": None, "config_from": None,
                                      "dtype": None})
    return lambda _progress: through_merged(lambda staging: EXPORT_MODES[first][1](merge, source, staging)(None),
                                            lambda staging: EXPORT_MODES[second][1](then, staging, target)(None),
                                            target)


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
    (`.NAME.tmp-XXXXXXXX`, and a single file's manifest's `.NAME.ckpt-manifest.json.XXXXXXXX`), and, unless the
    job overwrites, the target itself with the manifest beside it (the API refused the job if it existed before,
    so it can only be this job's own, unrecorded output)."""
    if not target or not storage.is_local(target):
        return []
    path = os.path.abspath(storage.local_path(target))
    parent, base = os.path.split(path)
    beside = manifest_sidecar(base)  # a single-file output's manifest, written beside it (via `.NAME.XXXXXXXX`)
    found = []
    if os.path.isdir(parent):
        found = [os.path.join(parent, n) for n in os.listdir(parent)
                 if n.startswith(tmp_prefix(base)) or n.startswith(f".{beside}.")]
    if not overwrite:
        found += [p for p in (path, os.path.join(parent, beside)) if os.path.lexists(p)]
    for item in found:
        remove_tree(item)
    return found


class _Lost(Exception):
    """The attempt is no longer current (requeued or failed elsewhere): roll back and record nothing."""


def _summary(uri: str, source_format: str | None = None) -> dict[str, Any] | None:
    from converters import inspect

    from .summary import summarize

    try:
        return summarize(inspect(uri, source_format))
    except CkptError as exc:
        logs.event("registry.inspect_failed", uri=uri, error=str(exc))
        return None


def inspection(uri: str, source_format: str | None, tensors: bool, complete: bool) -> bytes:
    """What an inspecting job process prints (sandbox.py): `{"summary": …}`, or `{"error": {"type", "message"}}`
    with one line naming the file. `complete` reads as rules do: no unfinished upload, every file as long as
    the metadata says. Any failure while reading is the checkpoint's: it never escapes as a traceback."""
    from converters import load_index

    from .summary import summarize

    try:
        if complete and storage.is_incomplete(uri):
            raise SourceError(f"{uri}: an upload started and did not finish", uri=uri)
        summary = summarize(load_index(uri, source_format, locate=complete), tensors)
        return json.dumps({"summary": summary}, ensure_ascii=False).encode()
    except CkptError as exc:
        kind, message = type(exc).__name__, str(exc)
    except UnicodeEncodeError:
        kind, message = "FormatError", f"{uri}: names an entry that is not valid UTF-8 text; the checkpoint is damaged"
    except MemoryError:
        kind, message = "FormatError", f"{uri}: reading its metadata needs more memory than inspecting may use"
    except Exception as exc:  # RecursionError, ValueError, …: the file is damaged or hostile; no traceback
        kind, message = "FormatError", f"{uri}: cannot be read ({type(exc).__name__}); the checkpoint is damaged"
    text = " ".join(message.encode("utf-8", "backslashreplace").decode().splitlines())[:2000]
    return json.dumps({"error": {"type": kind, "message": text}}).encode()


def _succeed(store: JobStore, spec: JobSpec, job_id: str, attempt: int, value: Any) -> bool:
    from .job_kinds import kind_of
    from .registry import Registry

    kind = kind_of(spec.kind)
    result = kind.result(value)
    output = _summary(spec.target or "") if kind.writes else None
    registry = Registry(store)
    recorder = kind.record(store, spec, job_id, result) if kind.record is not None else None  # archive, restore
    source_summary = None
    if output is not None and kind.store != "source" and registry.find_uri(spec.source) is None:
        source_summary = _summary(spec.source, spec.options.source_format)
    try:
        with store.transaction() as conn:
            if output is not None:
                result["checkpoint_id"] = registry.record_output(conn, uri=spec.target or "", summary=output,
                                                                 job_id=job_id, source_uri=spec.source,
                                                                 source_summary=source_summary)
            if recorder is not None:
                recorder(conn)
            if not store.finish(conn, job_id, attempt, "succeeded", result=result):
                raise _Lost
    except _Lost:
        return False
    return True


def mark_damaged(store: JobStore, uri: str) -> None:
    """Tag the registered checkpoint at `uri` (if any) `damaged`: a scrub found it differs from its checksums."""
    from .registry import Registry

    view = Registry(store).find_uri(uri)
    if view is None or DAMAGED in view.tags:
        return
    with store.transaction() as conn:
        conn.execute("UPDATE checkpoints SET tags = ?, updated_at = ? WHERE id = ?",
                     (json.dumps([*view.tags, DAMAGED]), time.time(), view.id))
    logs.event("registry.damaged", uri=uri, checkpoint_id=view.id)


def recheck_roots(spec: JobSpec, read: list[roots.Location], write: list[roots.Location]) -> None:
    """Check the roots again where the job runs: a symlink swapped in since the job was queued is caught."""
    from .job_kinds import kind_of

    roots.check(spec.source, read, field="source", purpose="read")
    for option in ("config_from", "base"):  # an export's side files and merge base are read
        value = getattr(spec.options, option, None)
        if value is not None:
            roots.check(value, read, field=f"options.{option}", purpose="read")
    if spec.target is not None:
        writing = kind_of(spec.kind).writes_target
        roots.check(spec.target, write if writing else read, field="target", purpose="write" if writing else "read")


def run_job(store: JobStore, job_id: str, attempt: int, progress_seconds: float = 0.5,
            max_bytes_per_second: int = 0,
            allowed: tuple[list[roots.Location], list[roots.Location]] | None = None) -> int:
    """Run attempt `attempt` of `job_id` to the end and record it. Returns 0, or 3 when the job was not ours.

    `allowed` (read roots, write roots) makes the job check its paths again before it starts."""
    from .jobs import JobSpec, request_of

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
        request = request_of(spec.kind, spec.options)
        if isinstance(request, ScrubRequest):  # a checkpoint without a manifest: checked against its baseline
            from .baselines import scrub_job

            call = scrub_job(store, spec.source, job_id, int(request.memory_limit))
        else:
            call = engine_call(request, spec.source, spec.target)
        value = call(writer)
        writer.flush()
        ok = _succeed(store, spec, job_id, attempt, value)
        logs.event("job.succeeded" if ok else "job.not_current", job_id=job_id, attempt=attempt,
                   seconds=round(time.monotonic() - started, 3))
        return 0 if ok else 3
    except VerifyError as exc:
        from .job_kinds import report_result

        report = exc.report
        result = report_result(report) if report is not None else None
        message = f"checkpoints differ: {exc}" if report is not None else str(exc)
        if spec.kind == "scrub" and report is not None:
            message = str(exc)
            mark_damaged(store, spec.source)
        store.finish_now(job_id, attempt, "failed", result=result, error=("VerifyError", message))
        logs.event("job.failed", job_id=job_id, attempt=attempt, error_type="VerifyError")
    except CkptError as exc:
        store.finish_now(job_id, attempt, "failed", error=(type(exc).__name__, str(exc)))
        logs.event("job.failed", job_id=job_id, attempt=attempt, error_type=type(exc).__name__, error=str(exc))
    except Exception as exc:  # a bug, or an OS error the engine did not wrap: fail the job, keep the trace in the log
        message = f"{type(exc).__name__}: {exc}"[:500]
        store.finish_now(job_id, attempt, "failed", error=("InternalError", message))
        logs.event("job.failed", job_id=job_id, attempt=attempt, error_type="InternalError", exc_info=True)
    return 0
