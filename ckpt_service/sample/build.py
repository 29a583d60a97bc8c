"""Public entry points: make real sharded sample checkpoints, and load one back and train on."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, TypedDict, Unpack

from converters import remove_tree

from .launch import run_staged
from .model import config_for_size
from .saved_layouts import ENGINE, LAYOUTS, check_layout, expected_files
from .train import DTYPES, Job

PathLike = str | os.PathLike


def _check_common(world_size: int, dtype: str) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")


class SampleOptions(TypedDict, total=False):
    """The options `make_sample` passes on to `make_samples` (whose signature holds their defaults)."""

    world_size: int
    size: str
    dtype: str
    tie_embeddings: bool
    compile_prefix: bool
    with_optim: bool
    reference: PathLike | None
    extra_step_reference: PathLike | None
    seed: int
    train: bool


def make_samples(
    outs: Mapping[str, PathLike],
    *,
    world_size: int = 2,
    size: str = "small",
    dtype: str = "float32",
    tie_embeddings: bool = False,
    compile_prefix: bool = False,
    with_optim: bool = True,
    reference: PathLike | None = None,
    extra_step_reference: PathLike | None = None,
    seed: int = 0,
    train: bool = True,
) -> None:
    """Train once and save several layouts of the same state: ``outs`` maps layout -> output folder.

    All layouts must be written by the same FSDP flavour (``ENGINE[layout]``: ``fsdp1`` or ``fsdp2``).
    Arguments are those of :func:`make_sample`.
    """
    if not outs:
        raise ValueError("no layouts given")
    for layout in outs:
        check_layout(layout)
    engines = {ENGINE[layout] for layout in outs}
    if len(engines) != 1:
        groups = {e: [la for la in outs if ENGINE[la] == e] for e in sorted(engines)}
        raise ValueError(f"layouts of one call must share an FSDP flavour; split them: {groups}")
    _check_common(world_size, dtype)
    cfg = config_for_size(size, tie_embeddings)
    if not train and (reference is not None or extra_step_reference is not None or with_optim
                      or engines != {"fsdp2"}):
        raise ValueError("train=False makes FSDP2 model-only checkpoints without references "
                         "(with_optim=False, no reference)")

    finals = {f"out:{layout}": Path(out) for layout, out in outs.items()}
    if reference is not None:
        finals["reference"] = Path(reference)
    if extra_step_reference is not None:
        finals["step_reference"] = Path(extra_step_reference)
    if len({p.resolve() for p in finals.values()}) != len(finals):
        raise ValueError(f"output paths must be distinct: {[str(p) for p in finals.values()]}")

    def set_paths(job: Job, staged: dict[str, Path]) -> Job:
        return replace(
            job,
            outs={layout: str(staged[f"out:{layout}"]) for layout in outs},
            reference=str(staged["reference"]) if "reference" in staged else None,
            step_reference=str(staged["step_reference"]) if "step_reference" in staged else None,
        )

    def expected(staged: dict[str, Path]) -> list[Path]:
        files = [p for name, p in staged.items() if not name.startswith("out:")]
        for layout in outs:
            files += [staged[f"out:{layout}"] / f for f in expected_files(layout, world_size, with_optim)]
        return files

    job = Job(
        mode="make",
        world_size=world_size,
        port=0,
        cfg=cfg,
        dtype=dtype,
        seed=seed,
        engine=engines.pop(),
        compile_prefix=compile_prefix,
        with_optim=with_optim,
        train=train,
    )
    run_staged(job, finals, set_paths, expected)


def make_sample(out: PathLike, *, layout: str = "fsdp2-dcp", **options: Unpack[SampleOptions]) -> None:
    """Train :class:`SampleModel` one AdamW step under real FSDP on CPU and save it as ``layout`` in ``out``.

    ``world_size`` gloo processes are spawned. ``size`` is ``"tiny"``, ``"small"`` or a byte size such as
    ``"1GB"`` (fp32 parameter bytes). ``dtype`` is ``"float32"`` or ``"bfloat16"`` (parameters cast
    before sharding). ``compile_prefix`` takes state dicts from ``torch.compile(model)`` so model keys
    carry ``_orig_mod.``. ``with_optim=False`` saves the model alone (``hf-dcp``, ``torch-full`` and
    ``safetensors`` always hold the model alone).

    ``reference``: a ``torch.save`` file of the exact full state after the step,
    ``{"model": {fqn: tensor}, "optim": {"state": {fqn: {...}}, "param_groups": [...]}}``, clean FQNs.
    ``extra_step_reference``: the same after a second step on the world-size-independent batch that
    :func:`load_and_step` uses. ``out`` must not exist or be an empty folder; it appears only on success.
    """
    make_samples({layout: out}, **options)


#: The options a `ckptctl sample` folder was made with (a JSON object), so a re-run with others is noticed.
RECORD = ".ckpt-sample.json"


def recorded_options(folder: PathLike) -> dict[str, object] | None:
    """The options `folder`'s sample was made with, or None when it has no readable record."""
    path = Path(folder) / RECORD
    try:
        if path.is_file() and path.stat().st_size < 64 * 1024:
            doc = json.loads(path.read_text())
            return doc if isinstance(doc, dict) else None
    except (OSError, ValueError, RecursionError):
        pass
    return None


def make_recorded_sample(out: PathLike, options: dict[str, Any], replace_existing: bool = False) -> None:
    """`make_sample(out, **options)` with the options recorded in the folder; with `replace_existing`, the
    new sample is made beside `out` and swapped in only once it is complete."""
    final = Path(out)
    staged = final.with_name(f".{final.name}.sample-{uuid.uuid4().hex[:8]}") if replace_existing else final
    try:
        make_sample(staged, **options)
        (staged / RECORD).write_text(json.dumps(options, sort_keys=True))
        if staged != final:
            remove_tree(final)
            staged.rename(final)
    finally:
        if staged != final:
            remove_tree(staged)


def load_and_step(
    ckpt_dir: PathLike,
    *,
    world_size: int,
    size: str = "small",
    dtype: str = "float32",
    tie_embeddings: bool = False,
    reference_after_load: PathLike,
    reference_after_step: PathLike,
    seed: int = 0,
) -> None:
    """Load a DCP checkpoint into FSDP2 at ``world_size`` and take one step on the shared batch.

    ``ckpt_dir`` holds ``{"model": ..., "optim": ...}`` as the ``fsdp2-dcp`` layout writes it (clean FQNs;
    ``model.*`` alone, or a top-level model-only DCP, resumes with a fresh optimizer). Writes the full
    state after loading and after the step, in the reference format of :func:`make_sample`; with the same
    ``size``/``dtype``/``tie_embeddings``/``seed`` the latter matches ``make_sample``'s
    ``extra_step_reference`` at any world size, up to float rounding.
    """
    _check_common(world_size, dtype)
    cfg = config_for_size(size, tie_embeddings)
    ckpt = Path(ckpt_dir)
    if not (ckpt / ".metadata").is_file():
        raise FileNotFoundError(f"{ckpt} is not a DCP checkpoint folder (no .metadata)")
    finals = {"reference": Path(reference_after_load), "step_reference": Path(reference_after_step)}

    def set_paths(job: Job, staged: dict[str, Path]) -> Job:
        return replace(job, reference=str(staged["reference"]), step_reference=str(staged["step_reference"]))

    job = Job(mode="load", world_size=world_size, port=0, cfg=cfg, dtype=dtype, seed=seed, ckpt_dir=str(ckpt))
    run_staged(job, finals, set_paths, lambda staged: list(staged.values()))


__all__ = ["LAYOUTS", "RECORD", "load_and_step", "make_recorded_sample", "make_sample", "make_samples",
           "recorded_options"]
