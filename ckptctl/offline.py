"""The offline commands: inspect, convert, export, verify, reshard (generated from the request models and run
in-process through `executor.engine_call`, like a job), and sample.

Errors become one line on stderr and exit code 2 (1 when verify finds differences); torch is imported
only by the commands that need it.
"""

from __future__ import annotations

import json
import os
from typing import Annotated, Any

import typer

from ckpt_service.executor import engine_call
from ckpt_service.job_kinds import kinds
from ckpt_service.job_requests import REQUESTS, InspectRequest, JobRequest, dtype_name
from ckpt_service.service_errors import DIFFERENT
from ckpt_service.units import human
from converters import OptionError, VerifyError

from .common import (
    AsJson,
    Quiet,
    app,
    engine_config,
    err,
    errors,
    fail,
    make_table,
    out,
    progress_bar,
)
from .flags import job_command, keyword


def print_result(result: Any, as_json: bool) -> None:
    if as_json:
        out.print_json(json.dumps(result.to_dict()))
        return
    for line in result.report:
        err.print(f"[dim]{line}[/]", highlight=False)
    total = sum(size for _, size in result.outputs)
    out.print(f"wrote {result.target}: {len(result.outputs)} file(s), {human(total)}", highlight=False)
    verify = getattr(result, "verify", None)  # FP8 and adapter exports run none
    if verify is not None:
        out.print(f"verify: {verify.summary()}", highlight=False)


def run_inspect(request: InspectRequest, source: str, as_json: bool = False) -> None:
    with errors(), engine_config():
        info = engine_call(request, source)(None)
    if as_json:
        out.print_json(json.dumps(info))
        return
    for key in ("uri", "format", "producer", "world_size", "tensors", "objects", "has_optimizer", "files"):
        out.print(f"{key:>14}: {info[key]}", highlight=False)
    out.print(f"{'total_bytes':>14}: {info['total_bytes']} ({human(info['total_bytes'])})", highlight=False)
    out.print(f"{'dtypes':>14}: " + ", ".join(f"{k} x{v}" for k, v in info["dtypes"].items()), highlight=False)
    if "bytes_per_file" in info:
        out.print(f"{'balance':>14}: {info['balance']} (smallest / largest file)", highlight=False)
        for name, size in info["bytes_per_file"].items():
            out.print(f"{'':>14}  {name}: {human(size)}", highlight=False)
    if "non_tensor_entries" in info:
        names = info["non_tensor_entries"]
        out.print(f"{'non-tensor':>14}: " + ", ".join(names[:8]) + (" ..." if len(names) > 8 else ""),
                  highlight=False)
    if "unclassified" in info:
        out.print(f"{'unclassified':>14}: " + ", ".join(info["unclassified"][:8]), highlight=False)
    if "adapter" in info:
        print_adapter(info["adapter"])
    for note in info.get("notes", []):
        out.print(f"{'note':>14}: {note}", highlight=False)
    if "stats" in info:
        print_stats(info["stats"])
    if request.tensors:
        table = make_table("name", "dtype", "shape", "chunks")
        for row in info["tensor_table"]:
            table.add_row(row["name"], row["dtype"], str(row["shape"]), str(row["chunks"]))
        out.print(table)


def run_write(request: JobRequest, source: str, target: str, quiet: bool = False, as_json: bool = False,
              ray: str | None = None) -> None:
    """convert, export and reshard: one output, a progress bar on a terminal; with `--ray`, its files are
    written by Ray tasks (what CKPT_EXECUTOR=ray / CKPT_RAY_ADDRESS select, for this run)."""
    with errors(), engine_config(ray), progress_bar(quiet or as_json) as update:
        result = engine_call(request, source, target)(update)
    print_result(result, as_json)


def compared(request: JobRequest, a: str, b: str, update: Any = None) -> Any:
    """A comparison's report (verify's or diff's), also when the checkpoints differ (its VerifyError carries it)."""
    try:
        return engine_call(request, a, b)(update)
    except VerifyError as exc:
        if exc.report is None:
            raise
        return exc.report


def run_verify(request: JobRequest, a: str, b: str | None = None, as_json: bool = False) -> None:
    """Compare; exit 1 when the checkpoints differ. With --certificate, re-check output A against its certificate
    (exit 1 naming each damaged file and byte range)."""
    if getattr(request, "certificate", False):
        return run_certificate(request, a, as_json)
    if b is None:
        with errors():
            raise OptionError("verify needs two checkpoints A and B (or --certificate OUT)", option="b")
    with errors(), engine_config():
        report = compared(request, a, b)
    print_report(report, as_json, "DIFFERENT",
                 [f"{name}: max |a-b| = {diff:g}" for name, diff in list(report.max_abs_diff.items())[:20]])


def run_certificate(request: JobRequest, uri: str, as_json: bool = False) -> None:
    """verify --certificate and scrub: re-check an output against what its manifest recorded; exit 1 naming each
    damaged file and byte range."""
    with errors(), engine_config():
        report = compared(request, uri, "")
    print_report(report, as_json, "DAMAGED", list(report.damaged))


def print_report(report: Any, as_json: bool, bad: str, details: list[str]) -> None:
    """A verify or certificate report: its notes, OK or `bad` with the summary, a line per detail; exit 1 when
    not ok."""
    if as_json:
        out.print_json(json.dumps(report.to_dict()))
    else:
        for note in report.notes:
            err.print(f"[dim]{note}[/]", highlight=False)
        out.print(("OK " if report.ok else f"{bad} ") + report.summary(), highlight=False)
        for line in details:
            out.print(f"  {line}", highlight=False)
    if not report.ok:
        raise typer.Exit(DIFFERENT)


def print_stats(stats: dict[str, Any]) -> None:
    """Per-tensor statistics (converters.scan's result), one row each."""
    table = make_table("name", "dtype", "shape", "nan", "+inf", "-inf", "zeros", "min", "max", "mean", "std", "l2")
    for t in stats["tensors"]:
        table.add_row(t["name"], t["dtype"], str(t["shape"]), str(t["nan"]), str(t["posinf"]), str(t["neginf"]),
                      str(t["zeros"]), *(number(t[k]) for k in ("min", "max", "mean", "std", "l2")))
    out.print(table)


def number(value: Any) -> str:
    return "-" if value is None else f"{value:.6g}" if isinstance(value, float) else str(value)


def run_scan(request: JobRequest, source: str, quiet: bool = False, as_json: bool = False) -> None:
    """Statistics of every tensor; exit 1 when one holds NaN or Inf."""
    with errors(), engine_config(), progress_bar(quiet or as_json) as update:
        result = engine_call(request, source)(update)
    if as_json:
        out.print_json(json.dumps(result.to_dict()))
    else:
        print_stats(result.to_dict())
        err.print(result.summary(), highlight=False)
    if not result.finite:
        raise typer.Exit(DIFFERENT)


def run_diff(request: JobRequest, a: str, b: str, quiet: bool = False, as_json: bool = False) -> None:
    """Compare; exit 1 when the checkpoints differ beyond the tolerances."""
    with errors(), engine_config(), progress_bar(quiet or as_json) as update:
        result = compared(request, a, b, update)
    if as_json:
        out.print_json(json.dumps(result.to_dict()))
    else:
        table = make_table("layer", "tensors", "changed", "max |a-b|", "relative L2")
        for layer in result.layers:
            row = layer.to_dict()
            table.add_row(row["name"], str(row["tensors"]), str(row["changed"]), number(row["max_abs_diff"]),
                          number(row["rel_l2"]))
        out.print(table)
        out.print(("DIFFERENT " if result.differs else "SAME ") + result.summary(), highlight=False)
    if result.differs:
        raise typer.Exit(DIFFERENT)


PATH = "Checkpoint path or URI."
Ray = Annotated[str | None, typer.Option("--ray", metavar="ADDRESS", help="Write the output files as Ray tasks on "
                                         "the cluster at ADDRESS (ray://host:10001, auto); default: "
                                         "CKPT_EXECUTOR / CKPT_RAY_ADDRESS, else this process.")]
WRITE_EXTRAS = [keyword("quiet", Quiet, False), keyword("as_json", AsJson, False), keyword("ray", Ray, None)]

def print_adapter(adapter: dict) -> None:
    """The LoRA adapter's lines of `inspect` (converters.adapters.adapter_info)."""
    if "error" in adapter:
        out.print(f"{'adapter':>14}: {adapter['error']}", highlight=False)
        return
    alpha = "unknown (no adapter_config.json)" if adapter["alpha"] is None else f"{adapter['alpha']:g}"
    ranks = ", ".join(map(str, adapter["ranks"]))
    out.print(f"{'adapter':>14}: {adapter['name']!r} {adapter['variant']}, {adapter['modules']} modules, rank {ranks}, "
              f"alpha {alpha}, {human(adapter['bytes'])} ({adapter['parameters']} parameters)", highlight=False)
    out.print(f"{'targets':>14}: " + ", ".join(adapter["target_modules"]), highlight=False)
    if adapter["modules_to_save"]:
        out.print(f"{'saved':>14}: " + ", ".join(adapter["modules_to_save"]), highlight=False)


job_command(app, REQUESTS["inspect"], [("source", PATH)], [keyword("as_json", AsJson, False)], run_inspect)
for _kind in kinds().values():  # every kind that writes an output, as its declaration says (`job_kinds`)
    if _kind.writes and _kind.offline:
        job_command(app, _kind.request, list(_kind.arguments), WRITE_EXTRAS, run_write)
job_command(app, REQUESTS["verify"], [("a", "The first checkpoint.")],
            [keyword("b", Annotated[str | None, typer.Argument(help="The second checkpoint (not with --certificate).",
                                                                show_default=False)], None),
             keyword("as_json", AsJson, False)], run_verify,
            help="Compare two checkpoints tensor by tensor (exact unless --atol/--rtol); exit 1 when they differ. "
                 "--certificate OUT re-checks an output against its certificate.")
READ_EXTRAS = [keyword("quiet", Quiet, False), keyword("as_json", AsJson, False)]
job_command(app, REQUESTS["scrub"], [("source", PATH)], [keyword("as_json", AsJson, False)], run_certificate,
            help="Re-read a stored output and compare it with the CRC-32s its manifest and certificate recorded; "
                 "exit 1 naming each damaged file and byte range.")
job_command(app, REQUESTS["scan"], [("source", PATH)], READ_EXTRAS,
            run_scan, help="Read every tensor once for its statistics (NaN, +Inf, -Inf and zero counts, min, max, "
                           "mean, std, L2 norm); exit 1 when a tensor holds NaN or Inf.")
job_command(app, REQUESTS["diff"], [("a", "The first checkpoint."), ("b", "The second checkpoint.")],
            READ_EXTRAS, run_diff,
            help="Compare two checkpoints of any formats tensor by tensor: identical or not, max |a-b|, relative L2 "
                 "change, by layer; exit 1 when they differ beyond --rtol/--atol.")


@app.command()
def sample(target: str, world_size: Annotated[int, typer.Option("--world-size")] = 2,
           size: Annotated[str, typer.Option(help="tiny, small, or a size such as 1GB.")] = "small",
           layout: Annotated[str, typer.Option(help="fsdp2-dcp, fsdp1-dcp, accelerate, rank-files-dtensor, "
                                               "rank-files-sharded, hf-dcp, torch-full, ...")] = "fsdp2-dcp",
           dtype: Annotated[str, typer.Option(help="float32 or bfloat16 parameters.")] = "float32",
           tie_embeddings: Annotated[bool, typer.Option("--tie-embeddings")] = False,
           model_only: Annotated[bool, typer.Option("--model-only", help="No optimizer state.")] = False,
           no_train: Annotated[bool, typer.Option("--no-train", help="Initialise each rank's shards in place and "
                                                  "skip the step (FSDP2, model only): for large checkpoints "
                                                  "without the memory of a full model per rank.")] = False,
           overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a sample made with other "
                                                   "options.")] = False) -> None:
    """Train a small model one step with real FSDP on CPU (gloo) and save its checkpoint.

    A TARGET that already holds a sample made with the same options is kept as it is (so the command can be
    re-run); one made with other options is refused unless --overwrite."""
    from ckpt_service.sample import make_recorded_sample, recorded_options

    options: dict[str, object] = {"world_size": world_size, "layout": layout, "size": size, "dtype": dtype_name(dtype),
                                  "tie_embeddings": tie_embeddings, "with_optim": not (model_only or no_train),
                                  "train": not no_train}
    present = os.path.isdir(target) and bool(os.listdir(target))
    if present:
        from converters import CkptError, detect

        try:
            detect(target)
        except CkptError:
            fail(f"{target}: exists and is not a checkpoint; choose an empty or new folder")
        recorded = recorded_options(target)
        if recorded == options:
            out.print(f"{target} already holds this sample; keeping it", highlight=False)
            return
        if not overwrite:
            made = ("with " + ", ".join(f"{k.replace('_', ' ')} {recorded.get(k)} (asked: {options[k]})"
                                        for k in options if recorded.get(k) != options[k])
                    if recorded else "by other means or an older version")
            fail(f"{target}: holds a checkpoint made {made}; pass --overwrite to remake it, or choose another "
                 "folder")
    with errors():
        try:
            make_recorded_sample(target, options, replace_existing=present)
        except ValueError as exc:
            fail(str(exc))
    out.print(f"wrote {layout} sample at world size {world_size}: {target}", highlight=False)


# -- the archive tier (converters.archive): offline commands on a store at any fsspec location ------------------

Store = Annotated[str, typer.Argument(help="The archive store: a folder or URI (s3://bucket/archive).")]


@app.command("archive")
def archive_command(source: Annotated[str, typer.Argument(help=PATH)], store: Store,
                    archive_id: Annotated[str | None, typer.Option("--id", help="The archive's id (default: a hash "
                                                                   "of its content).")] = None,
                    as_json: AsJson = False) -> None:
    """Keep a checkpoint in an archive store: content-addressed chunks, stored once across every checkpoint
    there and losslessly compressed; restore gives it back byte for byte."""
    from converters import archive_checkpoint

    with errors(), engine_config():
        result = archive_checkpoint(source, store, archive_id)
    done = result.to_dict()
    if as_json:
        out.print_json(json.dumps(done))
        return
    out.print(f"archived {source} as {result.archive_id}: {result.files} file(s), {human(result.logical_bytes)} "
              f"logical, {human(result.new_stored_bytes)} new in the store ({human(result.stored_bytes)} stored in "
              f"all)", highlight=False)


@app.command("restore")
def restore_command(store: Store, archive_id: Annotated[str, typer.Argument(help="The archive's id.")],
                    target: Annotated[str, typer.Argument(help="Where to write the checkpoint (must not exist).")],
                    as_json: AsJson = False) -> None:
    """Write an archived checkpoint back, byte for byte, every chunk's hash checked."""
    from converters import restore_archive

    with errors(), engine_config():
        files = restore_archive(store, archive_id, target)
    if as_json:
        out.print_json(json.dumps({"target": target, "files": files}))
        return
    out.print(f"restored {archive_id} to {target}: {len(files)} file(s)", highlight=False)


@app.command("archives")
def archives_command(store: Store, as_json: AsJson = False) -> None:
    """The checkpoints an archive store holds: id, source, files, logical and stored bytes."""
    from converters import list_archives

    with errors(), engine_config():
        found = list_archives(store)
    if as_json:
        out.print_json(json.dumps(found))
        return
    table = make_table("id", "source", "files", "logical", "stored")
    for a in found:
        table.add_row(str(a.get("id")), str(a.get("source")), str(a.get("files")), human(a.get("logical_bytes") or 0),
                      human(a.get("stored_bytes") or 0))
    out.print(table)


@app.command("archive-gc")
def archive_gc_command(store: Store,
                       grace: Annotated[float, typer.Option("--grace", metavar="SECONDS", help="Keep unreferenced "
                                                            "chunks younger than this.")] = 3600.0,
                       as_json: AsJson = False) -> None:
    """Delete the chunks no archived checkpoint uses (safe while archives run: it then deletes nothing)."""
    from converters import archive_gc

    with errors(), engine_config():
        result = archive_gc(store, grace_s=grace)
    if as_json:
        out.print_json(json.dumps(result.to_dict()))
        return
    out.print(result.skipped or f"deleted {len(result.deleted)} chunk(s), {human(result.freed_bytes)} freed; "
              f"{result.kept} kept", highlight=False)
