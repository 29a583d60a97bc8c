"""The on-disk layouts the sample generator writes, and how each rank writes them.

Everything here runs inside a rank process of an initialised gloo job, except :data:`LAYOUTS`,
:data:`ENGINE` and :func:`expected_files`, which the launcher uses too.
"""

from __future__ import annotations

import json
import os
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

#: Layout name -> the FSDP flavour that writes it.
ENGINE: dict[str, str] = {
    "fsdp2-dcp": "fsdp2",
    "fsdp1-dcp": "fsdp1",
    "accelerate": "fsdp1",
    "rank-files-dtensor": "fsdp2",
    "rank-files-sharded": "fsdp1",
    "accelerate-rank-files": "fsdp1",
    "hf-dcp": "fsdp2",
    "torch-full": "fsdp2",
    "safetensors": "fsdp2",
}
LAYOUTS: tuple[str, ...] = tuple(ENGINE)

#: Layouts that hold optimizer state when ``with_optim`` is true.
WITH_OPTIM_LAYOUTS = frozenset(LAYOUTS) - {"hf-dcp", "torch-full", "safetensors"}

ACCEL_MODEL_DIR = "pytorch_model_fsdp_0"
ACCEL_OPTIM_DIR = "optimizer_0"
SAFETENSORS_FILES = 3  # how many model-0000i-of-0000N.safetensors files (fewer if fewer tensors)


def check_layout(layout: str) -> None:
    if layout not in ENGINE:
        raise ValueError(f"unknown layout {layout!r}: choose one of {', '.join(LAYOUTS)}")


def expected_files(layout: str, world_size: int, with_optim: bool) -> list[str]:
    """Paths, relative to the output folder, that a finished sample of ``layout`` must contain."""
    optim = with_optim and layout in WITH_OPTIM_LAYOUTS
    ranks = range(world_size)
    if layout in ("fsdp2-dcp", "fsdp1-dcp"):
        return [".metadata"]
    if layout == "accelerate":
        return [f"{ACCEL_MODEL_DIR}/.metadata"] + ([f"{ACCEL_OPTIM_DIR}/.metadata"] if optim else [])
    if layout in ("rank-files-dtensor", "rank-files-sharded"):
        return [f"rank{r}.pt" for r in ranks] + ([f"optim_rank{r}.pt" for r in ranks] if optim else [])
    if layout == "accelerate-rank-files":
        files = [f"{ACCEL_MODEL_DIR}_rank{r}.bin" for r in ranks]
        return files + ([f"{ACCEL_OPTIM_DIR}_rank{r}.bin" for r in ranks] if optim else [])
    if layout == "hf-dcp":  # save_distributed without consolidation writes no metadata file
        return [f"shard-{r + 1:05d}-model-00001-of-00001.safetensors" for r in ranks]
    if layout == "torch-full":
        return ["model.pt"]
    if layout == "safetensors":
        return ["model.safetensors.index.json"]
    check_layout(layout)
    raise AssertionError(layout)


def accelerate_available() -> bool:
    """Whether to call Accelerate itself (set CKPT_SAMPLE_NO_ACCELERATE=1 to force the hand-written path)."""
    if os.environ.get("CKPT_SAMPLE_NO_ACCELERATE", "") not in ("", "0"):
        return False
    try:
        import accelerate.utils  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class Trained:
    """What a rank holds after training: the FSDP model, its optimizer, and where state dicts come from."""

    model: nn.Module  # FSDP2 module or FSDP1 wrapper; train through this one
    optim: torch.optim.Optimizer
    sd_module: nn.Module  # `model`, or torch.compile(model) whose state_dict() keys carry `_orig_mod.`
    engine: str
    rank: int
    world_size: int
    with_optim: bool

    @property
    def compiled(self) -> bool:
        return self.sd_module is not self.model


def save_layout(layout: str, t: Trained, out: Path) -> None:
    """Write ``layout`` into ``out`` (a folder); every rank of the job must call this."""
    check_layout(layout)
    if ENGINE[layout] != t.engine:
        raise AssertionError(f"{layout} needs {ENGINE[layout]}, the job runs {t.engine}")
    out.mkdir(parents=True, exist_ok=True)
    _SAVERS[layout](t, out)


# --- FSDP2 layouts ---------------------------------------------------------------------------------


def _fsdp2_sharded(t: Trained) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(model, optim or None) sharded state dicts of an FSDP2 model, DTensor values.

    Plain models use ``get_state_dict`` (clean FQNs). A compiled model's model part is the wrapper's own
    ``state_dict()``, which is where real ``_orig_mod.`` keys come from (``get_state_dict`` strips them);
    its optimizer part stays ``get_optimizer_state_dict`` and so has clean FQNs.
    """
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        get_state_dict,
    )

    if t.compiled:
        msd = t.sd_module.state_dict()
        osd = get_optimizer_state_dict(t.sd_module, t.optim) if t.with_optim else None
        return msd, osd
    if t.with_optim:
        return get_state_dict(t.model, t.optim)
    return get_model_state_dict(t.model), None


def _save_fsdp2_dcp(t: Trained, out: Path) -> None:
    import torch.distributed.checkpoint as dcp

    msd, osd = _fsdp2_sharded(t)
    dcp.save({"model": msd, "optim": osd} if osd is not None else msd, checkpoint_id=out)


def _save_rank_files_dtensor(t: Trained, out: Path) -> None:
    torch.save(t.sd_module.state_dict(), out / f"rank{t.rank}.pt")
    if t.with_optim:
        torch.save(t.optim.state_dict(), out / f"optim_rank{t.rank}.pt")


def _save_hf_dcp(t: Trained, out: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    msd = t.sd_module.state_dict() if t.compiled else get_model_state_dict(t.model)
    # The writer's safetensors refuse tensors that share memory (tied embeddings): keep both names, as
    # the other DCP layouts do, and give the second one its own copy.
    seen: set[int] = set()
    for key, value in msd.items():
        if not isinstance(value, torch.Tensor):
            continue  # a model state dict holds tensors (a DTensor is one) only
        local = value.to_local() if isinstance(value, DTensor) else value
        ptr = local.untyped_storage().data_ptr()
        if ptr in seen and local.numel() > 0:
            msd[key] = value.detach().clone()
        seen.add(ptr)
    dcp.save(msd, storage_writer=HuggingFaceStorageWriter(path=str(out), save_distributed=True))


def gather_full(t: Trained) -> dict[str, torch.Tensor] | None:
    """The full model state dict on rank 0 (None elsewhere), gathered tensor by tensor.

    Keys come from ``sd_module.state_dict()`` (so a compiled model gives ``_orig_mod.`` keys). Tied
    parameters stay one tensor under both names, as in an ordinary ``model.state_dict()``. Other ranks
    drop each gathered tensor at once, so only rank 0 holds a full copy.
    """
    from torch.distributed.tensor import DTensor

    full: dict[str, torch.Tensor] = {}
    seen: dict[int, torch.Tensor] = {}
    # keep_vars=True: the Parameter objects themselves, so a tied parameter is the same object twice.
    state = t.sd_module.state_dict(keep_vars=True)
    with torch.no_grad():
        for key, value in state.items():
            if id(value) in seen:
                tensor = seen[id(value)]
            elif isinstance(value, DTensor):
                tensor = value.full_tensor().detach().cpu()
            else:
                tensor = value.detach().cpu().clone()
            if t.rank != 0:
                tensor = torch.empty(0)  # other ranks drop their copy at once
            seen[id(value)] = tensor
            full[key] = tensor
    return full if t.rank == 0 else None


def _save_torch_full(t: Trained, out: Path) -> None:
    full = gather_full(t)
    if full is not None:
        torch.save(full, out / "model.pt")


def _shard_groups(sd: dict[str, torch.Tensor], n: int) -> list[list[str]]:
    """Split keys, in order, into at most ``n`` consecutive groups of about equal bytes."""
    sizes = [v.numel() * v.element_size() for v in sd.values()]
    budget = max(sum(sizes), 1) / max(1, n)
    groups: list[list[str]] = [[] for _ in range(max(1, n))]
    done = 0
    for key, size in zip(sd, sizes):
        groups[min(len(groups) - 1, int((done + size / 2) // budget))].append(key)  # by the tensor's middle
        done += size
    return [g for g in groups if g]


def _save_safetensors(t: Trained, out: Path) -> None:
    from safetensors.torch import save_file

    full = gather_full(t)
    if full is None:
        return
    seen: set[int] = set()
    sd: dict[str, torch.Tensor] = {}
    for key, tensor in full.items():  # save_file refuses tensors that share storage: clone the second name
        ptr = tensor.untyped_storage().data_ptr()
        sd[key] = tensor.clone() if ptr in seen else tensor.contiguous()
        seen.add(ptr)
    groups = _shard_groups(sd, SAFETENSORS_FILES)
    weight_map: dict[str, str] = {}
    for i, keys in enumerate(groups, start=1):
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: sd[k] for k in keys}, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, name))
    total = sum(v.numel() * v.element_size() for v in sd.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# --- FSDP1 layouts ---------------------------------------------------------------------------------


def _fsdp1_sharded(t: Trained) -> AbstractContextManager[None]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    return FSDP.state_dict_type(t.model, StateDictType.SHARDED_STATE_DICT)


def _fsdp1_optim(t: Trained) -> dict[str, Any]:
    """FSDP1 optimizer state dict; through a compiled wrapper its keys carry `_orig_mod.` too."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return FSDP.optim_state_dict(t.sd_module, t.optim)


def _save_fsdp1_dcp(t: Trained, out: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with _fsdp1_sharded(t):
        msd = t.sd_module.state_dict()
        state = {"model": msd, "optim": _fsdp1_optim(t)} if t.with_optim else msd
        dcp.save(state, checkpoint_id=out)


def _save_rank_files_sharded(t: Trained, out: Path) -> None:
    with _fsdp1_sharded(t):
        torch.save(t.sd_module.state_dict(), out / f"rank{t.rank}.pt")
        if t.with_optim:
            torch.save(_fsdp1_optim(t), out / f"optim_rank{t.rank}.pt")


def _accelerate_handles() -> tuple[Any, Any]:
    """(FSDP plugin, PartialState) for calling Accelerate's save helpers directly on CPU."""
    from accelerate import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin

    state = PartialState(cpu=True)  # picks up the running gloo group (RANK/WORLD_SIZE are set)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=1, state_dict_type="SHARDED_STATE_DICT")
    return plugin, state


def _save_accelerate(t: Trained, out: Path, use_dcp: bool = True) -> None:
    if accelerate_available():
        from accelerate.checkpointing import save_accelerator_state
        from accelerate.utils import save_fsdp_model, save_fsdp_optimizer

        plugin, state = _accelerate_handles()
        save_fsdp_model(plugin, state, t.sd_module, str(out), use_dcp=use_dcp)
        if t.with_optim:
            save_fsdp_optimizer(plugin, state, t.optim, t.sd_module, str(out), use_dcp=use_dcp)
        # What Accelerator.save_state writes beside the FSDP folders (no scheduler/sampler here).
        save_accelerator_state(str(out), [], [], [], [], process_index=t.rank, step=1)
        return
    # Accelerate is not installed: write what its helpers write, the same way.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType

    with FSDP.state_dict_type(
        t.model,
        StateDictType.SHARDED_STATE_DICT,
        ShardedStateDictConfig(offload_to_cpu=True),
        ShardedOptimStateDictConfig(offload_to_cpu=True),
    ):
        msd = t.sd_module.state_dict()
        if use_dcp:
            dcp.save({"model": msd}, checkpoint_id=out / ACCEL_MODEL_DIR)
        else:
            torch.save(msd, out / f"{ACCEL_MODEL_DIR}_rank{t.rank}.bin")
        if t.with_optim:
            osd = _fsdp1_optim(t)
            if use_dcp:
                dcp.save({"optimizer": osd}, checkpoint_id=out / ACCEL_OPTIM_DIR)
            else:
                torch.save(osd, out / f"{ACCEL_OPTIM_DIR}_rank{t.rank}.bin")


def _save_accelerate_rank_files(t: Trained, out: Path) -> None:
    _save_accelerate(t, out, use_dcp=False)


_SAVERS = {
    "fsdp2-dcp": _save_fsdp2_dcp,
    "fsdp1-dcp": _save_fsdp1_dcp,
    "accelerate": _save_accelerate,
    "rank-files-dtensor": _save_rank_files_dtensor,
    "rank-files-sharded": _save_rank_files_sharded,
    "accelerate-rank-files": _save_accelerate_rank_files,
    "hf-dcp": _save_hf_dcp,
    "torch-full": _save_torch_full,
    "safetensors": _save_safetensors,
}
