"""The job kinds: each declared once, here, and everything kind-specific derived from the declaration.

A declaration names the kind, its request model (its options: `job_requests`), whether it writes its
target (checked against the write roots, cleaned up on retry, registered as a checkpoint when it
succeeds), its positional arguments on the command line, its engine call (request, source, target ->
a callable the executor runs with a progress callback), and how the engine's return value becomes the
job's result. From these come the REST schema (`jobs.Kind`, `JobOptions`), the service's checks, rules'
job templates, the `ckptctl` job commands and `ckptctl submit` commands, the dashboard's form, and the
executor's dispatch.

Adding a kind is one `declare(JobKind(...))` plus its engine function, made before the service's job
models are built (`ckpt_service.jobs` freezes the set when it is imported).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

from .executor import (
    EngineCall,
    archive_call,
    convert_call,
    diff_call,
    import_call,
    inspect_call,
    reshard_call,
    restore_call,
    scan_call,
    scrub_call,
    verify_call,
)
from .job_requests import (
    ArchiveRequest,
    ConvertRequest,
    DiffRequest,
    ExportRequest,
    ImportRequest,
    InspectRequest,
    JobRequest,
    ReshardRequest,
    RestoreRequest,
    ScanRequest,
    ScrubRequest,
    VerifyRequest,
)

SOURCE = ("source", "Checkpoint path or URI.")


def as_is(value: Any) -> dict[str, Any]:
    """The engine's return value is the result already (a dict, e.g. inspect's summary)."""
    return dict(value)


def report_result(report: Any) -> dict[str, Any]:
    """A verify report and its one-line summary (also the result of a verify that found differences)."""
    return {**report.to_dict(), "summary": report.summary()}


def written_result(value: Any) -> dict[str, Any]:
    """A written output: its files, their total bytes, and the summary of the verify that ran after it."""
    result: dict[str, Any] = value.to_dict()
    result["total_bytes"] = sum(o["bytes"] for o in result["outputs"])
    verify = getattr(value, "verify", None)  # FP8 and adapter exports run no verify
    if verify is not None:
        result["verify_summary"] = verify.summary()
    return result


def record_archive(*args: Any) -> Callable[[Any], None]:
    """`archived.archive_job_recorder`, imported when an archive job succeeds (not by every command's start-up)."""
    from .archived import archive_job_recorder

    return archive_job_recorder(*args)


def record_restore(*args: Any) -> Callable[[Any], None]:
    """`archived.restore_job_recorder`, imported when a restore job succeeds."""
    from .archived import restore_job_recorder

    return restore_job_recorder(*args)


@dataclass(frozen=True)
class JobKind:
    """One job kind. `arguments` are the (name, help) of its positional arguments: a second one is the
    target (the output, or what the source is compared with), so a kind with one takes no target."""

    name: str
    request: type[JobRequest]
    engine: Callable[[Any, str, str | None], EngineCall]
    result: Callable[[Any], dict[str, Any]]
    writes: bool = False
    arguments: tuple[tuple[str, str], ...] = (SOURCE, ("target", "The output."))
    #: which argument is an archive store: a target store is checked against the write roots but is never
    #: cleaned up, refused for existing nor registered; a source store is not registered as a checkpoint
    store: Literal["source", "target"] | None = None
    #: what a succeeded job records in the registry besides its output: (store, spec, job id, result) -> a
    #: writer run inside the transaction that marks the job succeeded (`archived`)
    record: Callable[[Any, Any, str, dict[str, Any]], Callable[[Any], None]] | None = None
    #: whether `ckptctl KIND` (offline) is derived from it; archive and restore have their own (ckptctl/offline.py)
    offline: bool = True

    @property
    def writes_target(self) -> bool:
        """Its target is written (an output, or an archive store): checked against the write roots."""
        return self.writes or self.store == "target"

    @property
    def takes_target(self) -> bool:
        return len(self.arguments) > 1

    @property
    def help(self) -> str:
        return (self.request.__doc__ or self.name).strip()


_KINDS: dict[str, JobKind] = {}
_frozen: list[str] = []


def declare(kind: JobKind) -> JobKind:
    """Add a kind (its request model learns its name and whether it takes a target)."""
    if _frozen:
        raise RuntimeError(f"job kind {kind.name}: declare it before {_frozen[0]} is imported (the job models "
                           "are built from the kinds declared by then)")
    if kind.name in _KINDS or any(k.request is kind.request for k in _KINDS.values()):
        raise ValueError(f"job kind {kind.name}: declared twice, or its request model is another kind's")
    kind.request.kind = kind.name
    kind.request.takes_target = kind.takes_target
    _KINDS[kind.name] = kind
    return kind


def freeze(by: str) -> Mapping[str, JobKind]:
    """The kinds, from now on fixed (`by` built models from them)."""
    if not _frozen:
        _frozen.append(by)
    return kinds()


def kinds() -> Mapping[str, JobKind]:
    """Every kind by name, in declaration order."""
    return MappingProxyType(_KINDS)


def kind_of(name: str) -> JobKind:
    return _KINDS[name]


def names(writes: bool | None = None) -> tuple[str, ...]:
    """The kinds' names (only those that write, or only those that do not, when `writes` is given)."""
    return tuple(k.name for k in _KINDS.values() if writes is None or k.writes == writes)


declare(JobKind("convert", ConvertRequest, convert_call, written_result, writes=True,
                arguments=(SOURCE, ("target", "The output (a folder, or a .safetensors/.pt file)."))))
declare(JobKind("export", ExportRequest, convert_call, written_result, writes=True,
                arguments=(SOURCE, ("target", "The output folder or file."))))
declare(JobKind("reshard", ReshardRequest, reshard_call, written_result, writes=True,
                arguments=(SOURCE, ("target", "The output DCP folder."))))
declare(JobKind("import", ImportRequest, import_call, written_result, writes=True,
                arguments=(("source", "The Hugging Face model folder (config.json and safetensors)."),
                           ("target", "The Megatron save folder."))))
declare(JobKind("verify", VerifyRequest, verify_call, report_result,
                arguments=(("a", "The first checkpoint."), ("b", "The second checkpoint."))))
declare(JobKind("inspect", InspectRequest, inspect_call, as_is, arguments=(SOURCE,)))
declare(JobKind("scan", ScanRequest, scan_call, report_result, arguments=(SOURCE,)))
declare(JobKind("scrub", ScrubRequest, scrub_call, report_result, arguments=(SOURCE,)))
declare(JobKind("diff", DiffRequest, diff_call, report_result,
                arguments=(("a", "The first checkpoint."), ("b", "The second checkpoint."))))
declare(JobKind("archive", ArchiveRequest, archive_call, lambda r: r.to_dict(), store="target",
                record=record_archive, offline=False,
                arguments=(SOURCE, ("store", "The archive store: a folder or URI (s3://bucket/archive)."))))
declare(JobKind("restore", RestoreRequest, restore_call, as_is, writes=True, store="source",
                record=record_restore, offline=False,
                arguments=(("store", "The archive store: a folder or URI."), ("target", "The new folder (or file)."))))
