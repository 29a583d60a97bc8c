"""`ckptctl`: inspect, convert, export, verify, reshard and sample checkpoints from the shell.

Errors from the engine become one line on stderr and exit code 2 (1 for a failed verify); torch is
imported only by the commands that need it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from converters.errors import CkptError

from .summary import summarize
from .units import human, parse_size

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_show_locals=False,
                  help="Convert, reshard, export and verify sharded PyTorch checkpoints, offline and streaming.")
out = Console()
err = Console(stderr=True)

From = Annotated[str | None, typer.Option("--from", help="Force the source format (dcp, accelerate, hf-dcp, "
                                          "safetensors, torch, rank-files, megatron, lightning, deepspeed).")]
Only = Annotated[str, typer.Option(help="Which entries to write: model, optim or all.")]
Rename = Annotated[list[str] | None, typer.Option("--rename", help="REGEX=REPLACEMENT applied to parameter names "
                                                  "(repeatable).")]
Include = Annotated[list[str] | None, typer.Option("--include", help="Keep only names matching this glob.")]
Exclude = Annotated[list[str] | None, typer.Option("--exclude", help="Drop names matching this glob.")]
DType = Annotated[str | None, typer.Option("--dtype", help="Cast floating-point tensors: float32, bfloat16, "
                                           "float16.")]
ShardSize = Annotated[str, typer.Option("--max-shard-size", help="Largest safetensors shard, e.g. 5GB.")]
MemLimit = Annotated[str, typer.Option("--memory-limit", help="Cap on tensor bytes held in memory.")]
Overwrite = Annotated[bool, typer.Option("--overwrite", help="Replace an existing target.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print a JSON document.")]
Tag = Annotated[str | None, typer.Option("--tag", help="DeepSpeed: the tag folder to read (default: `latest`).")]
Weights = Annotated[str | None, typer.Option("--weights", help="DeepSpeed: fp32 (master weights, the default) or "
                                             "module (the 16-bit module weights).")]


def source_for(source: str, fmt: str | None, tag: str | None, weights: str | None) -> tuple[str, str | None]:
    from converters.formats.deepspeed import source_for as resolve

    return resolve(source, fmt, tag, weights)


def fail(message: str, code: int = 2) -> None:
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@contextmanager
def errors() -> Iterator[None]:
    try:
        yield
    except CkptError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        fail("interrupted; nothing was left behind", 130)


@contextmanager
def progress_bar(quiet: bool) -> Iterator[Callable[[Any], None] | None]:
    if quiet or not sys.stderr.isatty():
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task("converting", total=None)

        def update(p: Any) -> None:
            bar.update(task, completed=p.done_bytes, total=p.total_bytes or None)

        yield update


def key_options(only: str, clean: bool | None, rename: list[str] | None, include: list[str] | None,
                exclude: list[str] | None) -> Any:
    from converters.transforms import KeyOptions

    return KeyOptions(only=only, clean=clean, renames=KeyOptions.parse_renames(rename or []),  # type: ignore[arg-type]
                      include=include or [], exclude=exclude or [])


def print_result(result: Any, as_json: bool) -> None:
    if as_json:
        out.print_json(json.dumps(result.to_dict()))
        return
    for line in result.report:
        err.print(f"[dim]{line}[/]", highlight=False)
    total = sum(size for _, size in result.outputs)
    out.print(f"wrote {result.target}: {len(result.outputs)} file(s), {human(total)}", highlight=False)
    if result.verify is not None:
        out.print(f"verify: {result.verify.summary()}", highlight=False)


@app.command()
def inspect(source: Annotated[str, typer.Argument(help="Checkpoint path or URI.")], source_format: From = None,
            tensors: Annotated[bool, typer.Option("--tensors", help="List every tensor.")] = False,
            as_json: AsJson = False, tag: Tag = None, weights: Weights = None) -> None:
    """Describe a checkpoint from its metadata alone (no tensor data is read)."""
    from converters.api import inspect as inspect_index

    with errors():
        source, source_format = source_for(source, source_format, tag, weights)
        info = summarize(inspect_index(source, source_format), tensors)
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
    for note in info.get("notes", []):
        out.print(f"{'note':>14}: {note}", highlight=False)
    if tensors:
        table = Table("name", "dtype", "shape", "chunks")
        for row in info["tensor_table"]:
            table.add_row(row["name"], row["dtype"], str(row["shape"]), str(row["chunks"]))
        out.print(table)


def _convert(source: str, target: str, to: str, source_format: str | None, keys: Any, dtype: str | None,
             max_shard_size: str, memory_limit: str, overwrite: bool, drop_tied: list[str] | None,
             verify: bool, quiet: bool, as_json: bool, export: bool = False, to_hf: str | None = None,
             ray: str | None = None) -> None:
    from converters.api import ConvertOptions, convert
    from converters.plan import Execution

    with errors():
        options = ConvertOptions(to=to, source_format=source_format, keys=keys, dtype=dtype,  # type: ignore[arg-type]
                                 max_shard_size=parse_size(max_shard_size), memory_limit=parse_size(memory_limit),
                                 overwrite=overwrite, drop_tied=drop_tied or [], verify=verify, export=export,
                                 to_hf=to_hf, execution=Execution(address=ray))
        with progress_bar(quiet or as_json) as update:
            result = convert(source, target, options, update)
    print_result(result, as_json)


DropTied = Annotated[list[str] | None, typer.Option("--drop-tied", help="Leave out NAME, a tensor equal to "
                                                    "another (e.g. lm_head.weight); the tie is recorded.")]
Verify = Annotated[bool, typer.Option("--verify", help="Compare the output with the source before finishing.")]
Ray = Annotated[str | None, typer.Option("--ray", metavar="ADDRESS", help="Run the output files as Ray tasks on "
                                         "the cluster at ADDRESS (ray://host:10001, auto); default: "
                                         "CKPT_EXECUTOR / CKPT_RAY_ADDRESS, else this process.")]


@app.command()
def convert(source: str, target: str,
            to: Annotated[str, typer.Option("--to", help="Output format: safetensors or torch.")] = "safetensors",
            source_format: From = None, only: Only = "all",
            clean_keys: Annotated[bool, typer.Option("--clean-keys/--keep-keys", help="Strip wrapper prefixes "
                                                     "and containers.")] = False,
            rename: Rename = None, include: Include = None, exclude: Exclude = None, dtype: DType = None,
            max_shard_size: ShardSize = "5GB", memory_limit: MemLimit = "256MiB", overwrite: Overwrite = False,
            drop_tied: DropTied = None, verify: Verify = False, quiet: Quiet = False, as_json: AsJson = False,
            tag: Tag = None, weights: Weights = None, ray: Ray = None) -> None:
    """Convert a checkpoint to one safetensors/torch output (model and optimizer by default, keys as they are)."""
    with errors():
        source, source_format = source_for(source, source_format, tag, weights)
        keys = key_options(only, clean_keys, rename, include, exclude)
    _convert(source, target, to, source_format, keys, dtype, max_shard_size, memory_limit, overwrite, drop_tied,
             verify, quiet, as_json, ray=ray)


@app.command()
def export(source: str, target: str, source_format: From = None,
           only: Annotated[str, typer.Option(help="model (an export never holds optimizer state).")] = "model",
           keep_keys: Annotated[bool, typer.Option("--keep-keys", help="Keep names exactly as stored.")] = False,
           rename: Rename = None, include: Include = None, exclude: Exclude = None, dtype: DType = None,
           max_shard_size: ShardSize = "5GB", memory_limit: MemLimit = "256MiB", overwrite: Overwrite = False,
           drop_tied: DropTied = None, verify: Verify = False, quiet: Quiet = False, as_json: AsJson = False,
           to_hf: Annotated[str | None, typer.Option("--to-hf", help="Map a Megatron / NeMo GPT model to a Hugging "
                                                     "Face architecture (llama) and write its config.json.")] = None,
           tag: Tag = None, weights: Weights = None, ray: Ray = None) -> None:
    """Export model weights to HF-style sharded safetensors for serving (clean keys by default)."""
    with errors():
        source, source_format = source_for(source, source_format, tag, weights)
        keys = key_options(only, not keep_keys, rename, include, exclude)
    _convert(source, target, "safetensors", source_format, keys, dtype, max_shard_size, memory_limit, overwrite,
             drop_tied, verify, quiet, as_json, export=True, to_hf=to_hf, ray=ray)


@app.command()
def verify(a: str, b: str, only: Only = "all",
           keep_keys: Annotated[bool, typer.Option("--keep-keys", help="Compare names exactly as stored.")] = False,
           rename: Rename = None, include: Include = None, exclude: Exclude = None,
           atol: Annotated[float, typer.Option(help="Absolute tolerance (for cast outputs).")] = 0.0,
           rtol: Annotated[float, typer.Option(help="Relative tolerance (for cast outputs).")] = 0.0,
           a_format: Annotated[str | None, typer.Option("--from-a")] = None,
           b_format: Annotated[str | None, typer.Option("--from-b")] = None,
           memory_limit: MemLimit = "256MiB", as_json: AsJson = False) -> None:
    """Compare two checkpoints tensor by tensor (exact unless --atol/--rtol); exit 1 when they differ."""
    from converters.api import verify as verify_checkpoints

    with errors():
        keys = key_options(only, not keep_keys, rename, include, exclude)
        keys.nest = False
        report = verify_checkpoints(a, b, keys=keys, atol=atol, rtol=rtol, a_format=a_format, b_format=b_format,
                                    memory_limit=parse_size(memory_limit))
    if as_json:
        out.print_json(json.dumps(report.to_dict()))
    else:
        out.print(("OK " if report.ok else "DIFFERENT ") + report.summary(), highlight=False)
        for name, diff in list(report.max_abs_diff.items())[:20]:
            out.print(f"  {name}: max |a-b| = {diff:g}", highlight=False)
    if not report.ok:
        raise typer.Exit(1)


@app.command()
def reshard(source: str, target: str, world_size: Annotated[int, typer.Option("--world-size", help="Target ranks.")],
            layout: Annotated[str, typer.Option(help="Sharding policy: fsdp2 (dim-0 torch.chunk pieces).")] = "fsdp2",
            shard_dim_rule: Annotated[list[str] | None, typer.Option("--shard-dim-rule", help="REGEX=DIM: split "
                                                                     "matching parameters on DIM instead.")] = None,
            source_format: From = None, only: Only = "model",
            clean_keys: Annotated[bool | None, typer.Option("--clean-keys/--keep-keys", help="Strip wrapper "
                                                            "prefixes and containers (default: kept with --only "
                                                            "all, cleaned otherwise).")] = None,
            rename: Rename = None, include: Include = None, exclude: Exclude = None, dtype: DType = None,
            dtype_optim: Annotated[bool, typer.Option("--dtype-optim", help="Cast optimizer state too.")] = False,
            memory_limit: MemLimit = "256MiB", overwrite: Overwrite = False, verify: Verify = False,
            quiet: Quiet = False, as_json: AsJson = False, tag: Tag = None, weights: Weights = None,
            ray: Ray = None) -> None:
    """Write a DCP checkpoint laid out for WORLD_SIZE ranks (FSDP2 loads it with dcp.load)."""
    from converters.layouts import parse_dim_rules
    from converters.plan import Execution
    from converters.reshard import ReshardOptions
    from converters.reshard import reshard as run_reshard

    with errors():
        source, source_format = source_for(source, source_format, tag, weights)
        options = ReshardOptions(world_size=world_size, layout=layout, dim_rules=parse_dim_rules(shard_dim_rule or []),
                                 source_format=source_format, keys=key_options(only, clean_keys, rename, include,
                                                                               exclude),
                                 dtype=dtype, dtype_optim=dtype_optim, memory_limit=parse_size(memory_limit),
                                 overwrite=overwrite, verify=verify, execution=Execution(address=ray))
        with progress_bar(quiet or as_json) as update:
            result = run_reshard(source, target, options, update)
    print_result(result, as_json)


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
                                                  "without the memory of a full model per rank.")] = False) -> None:
    """Train a small model one step with real FSDP on CPU (gloo) and save its checkpoint.

    A TARGET that already holds a checkpoint is kept as it is (so the command can be re-run)."""
    import os

    from .sample import make_sample

    if os.path.isdir(target) and os.listdir(target):
        from converters.errors import CkptError
        from converters.formats import detect

        try:
            detect(target)
        except CkptError:
            fail(f"{target}: exists and is not a checkpoint; choose an empty or new folder")
        out.print(f"{target} already holds a checkpoint; keeping it", highlight=False)
        return
    with errors():
        try:
            make_sample(target, world_size=world_size, layout=layout, size=size, dtype=dtype,
                        tie_embeddings=tie_embeddings, with_optim=not (model_only or no_train), train=not no_train)
        except ValueError as exc:
            fail(str(exc))
    out.print(f"wrote {layout} sample at world size {world_size}: {target}", highlight=False)


from . import cli_client, cli_service  # noqa: E402, F401  (service and client commands, registered on `app`)


def main() -> None:
    app()


if __name__ == "__main__":  # `python -m ckpt_service.cli`: run the package module's app, where all commands live
    from ckpt_service.cli import main as package_main

    package_main()
