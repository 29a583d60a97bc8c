"""The per-rank worker of a sample job: train one step under FSDP on CPU (gloo), save, write references.

A job is one :class:`Job`, run by :func:`worker` in ``world_size`` spawned processes. Two modes:

- ``"make"``: build the model, shard it (FSDP1 or FSDP2), take one AdamW step on per-rank data, write the
  reference (full state after that step), save every requested layout, then optionally take a second
  step on the world-size-independent :func:`shared_batch` and write that reference too.
- ``"load"``: FSDP2 at any world size, load a DCP checkpoint in the ``fsdp2-dcp`` key convention, write
  the reference after loading, take one step on :func:`shared_batch`, write the reference after it.

Because every rank computes the loss on the same full :func:`shared_batch` and FSDP averages gradients,
the step on it gives the same result at every world size (up to float rounding): the second step of a
``"make"`` job and the step of a ``"load"`` job are comparable across world sizes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .model import Block, SampleConfig, SampleModel, build_model, next_token_loss
from .saved_layouts import Trained, save_layout

LR = 1e-2
SEQ = 17
BATCH = 2  # per rank, first step
SHARED_BATCH = 4  # the same on every rank, second step / load_and_step

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Job:
    mode: str  # "make" | "load"
    world_size: int
    port: int
    cfg: SampleConfig
    dtype: str
    seed: int
    engine: str = "fsdp2"  # "fsdp1" | "fsdp2"
    outs: dict[str, str] = field(default_factory=dict)  # layout -> output folder (make)
    compile_prefix: bool = False
    with_optim: bool = True
    train: bool = True  # False: init the shards in place (meta device), no step: big benchmark checkpoints
    ckpt_dir: str | None = None  # load
    reference: str | None = None  # after the first step (make) / after loading (load)
    step_reference: str | None = None  # after the step on the shared batch
    done_dir: str = ""  # each rank touches done_dir/rank{r} once everything is written


def first_batch(cfg: SampleConfig, seed: int, rank: int) -> torch.Tensor:
    """Per-rank tokens for the first training step (different on each rank)."""
    g = torch.Generator().manual_seed(seed * 7919 + 1 + rank)
    return torch.randint(0, cfg.vocab, (BATCH, SEQ), generator=g)


def shared_batch(cfg: SampleConfig, seed: int) -> torch.Tensor:
    """The batch every rank uses for the world-size-independent step."""
    g = torch.Generator().manual_seed(seed * 7919 + 104_729)
    return torch.randint(0, cfg.vocab, (SHARED_BATCH, SEQ), generator=g)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, tokens: torch.Tensor) -> None:
    optim.zero_grad(set_to_none=True)
    next_token_loss(model, tokens).backward()
    optim.step()
    optim.zero_grad(set_to_none=True)  # no gradient memory held while saving


def shard(model: SampleModel, engine: str, world_size: int) -> nn.Module:
    """FSDP2 (fully_shard per block, then the root) or FSDP1 (one unit per block, use_orig_params)."""
    if engine == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    policy = ModuleWrapPolicy({Block})
    return FSDP(model, auto_wrap_policy=policy, use_orig_params=True, device_id=torch.device("cpu"))


def _plain(obj: Any) -> Any:
    """Detached, compact CPU tensors throughout a nested state dict (dicts and lists updated in place).

    Gathered tensors may be views into padded all-gather buffers: those are cloned, one at a time, so
    the peak stays at one extra tensor rather than a second copy of the whole state.
    """
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        compact = t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()
        return t if compact else t.clone()
    if isinstance(obj, dict):
        for key in list(obj):
            obj[key] = _plain(obj[key])
        return obj
    if isinstance(obj, list):
        for i, value in enumerate(obj):
            obj[i] = _plain(value)
        return obj
    if isinstance(obj, tuple):
        return tuple(_plain(v) for v in obj)
    return obj


def full_reference(model: nn.Module, optim: torch.optim.Optimizer, engine: str) -> dict[str, Any] | None:
    """``{"model": {fqn: tensor}, "optim": {"state": ..., "param_groups": ...}}`` on rank 0, else None.

    Collective: every rank must call it. FSDP2: ``get_state_dict(full_state_dict=True, cpu_offload=True)``.
    FSDP1 must not offload (FULL_STATE_DICT with offload_to_cpu=True segfaults on CPU) and
    ``get_state_dict`` ties rank0_only to cpu_offload, which would make every rank hold a full copy; so
    FSDP1 asks FSDP directly for a rank0_only full state dict without offload (same keys and values).
    """
    if engine == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        msd, osd = get_state_dict(model, optim, options=opts)
    else:
        from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.state_dict_type(
            model,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
            FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True),
        ):
            msd = model.state_dict()
            osd = FSDP.optim_state_dict(model, optim)
    if dist.get_rank() != 0:
        return None
    return {"model": _plain(msd), "optim": _plain(osd)}


def _write_reference(ref: dict[str, Any] | None, path: str | None) -> None:
    if ref is not None and path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        torch.save(ref, path)
    del ref
    _trim_heap()


def _trim_heap() -> None:
    """Hand freed heap memory back to the OS (glibc keeps it otherwise; matters for GB-sized samples)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


_T0 = time.monotonic()


def log(phase: str) -> None:
    """With CKPT_SAMPLE_DEBUG=1, print the phase, seconds since start and this rank's RSS (now / peak)."""
    if os.environ.get("CKPT_SAMPLE_DEBUG", "") in ("", "0"):
        return
    mem = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                key, value = line.split(":")
                mem[key] = int(value.split()[0]) // 1024
    rank = dist.get_rank() if dist.is_initialized() else -1
    rss, peak = mem.get("VmRSS", -1), mem.get("VmHWM", -1)
    elapsed = time.monotonic() - _T0
    print(f"[sample rank {rank}] {elapsed:7.2f}s {phase}: rss {rss} MB, peak {peak} MB", flush=True)


def _setup_env(rank: int, job: Job) -> None:
    # Accelerate's PartialState(cpu=True) reads these to join the running group.
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(job.port),
        RANK=str(rank),
        WORLD_SIZE=str(job.world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(job.world_size),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)  # one process per core at most; oversubscription is much slower
    # FSDP1 / ShardedTensor deprecation chatter, printed once per rank and call.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.")
    warnings.filterwarnings("ignore", message=r".*(_get_pg_default_device|Multiple backends are registered)")


def worker(rank: int, job: Job) -> None:
    """Entry point of one rank (torch.multiprocessing.start_processes calls it)."""
    _setup_env(rank, job)
    dist.init_process_group("gloo", rank=rank, world_size=job.world_size)
    try:
        if job.mode == "make":
            _make(rank, job)
        elif job.mode == "load":
            _load(rank, job)
        else:
            raise ValueError(f"unknown job mode {job.mode!r}")
        dist.barrier()
        Path(job.done_dir, f"rank{rank}").touch()
    except (KeyboardInterrupt, SystemExit, Exception):
        raise
    except BaseException as e:
        # DCP's CheckpointException derives from BaseException, which torch.multiprocessing does not
        # report to the parent: re-raise it as an Exception so its message reaches the caller.
        raise RuntimeError(f"{type(e).__name__}: {e}") from e
    finally:
        dist.destroy_process_group()


def _untrained(rank: int, job: Job) -> nn.Module:
    """FSDP2 model whose shards are initialised in place: no rank ever holds the full model."""
    with torch.device("meta"):
        built = build_model(job.cfg, job.seed, DTYPES[job.dtype])
    model = shard(built, job.engine, job.world_size)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(job.seed * 7919 + 31 * rank + 7)
    with torch.no_grad():
        for param in model.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            local.normal_(0.0, 0.02, generator=g)
        for buffer in model.buffers():
            buffer.fill_(1.0)
    return model


def _make(rank: int, job: Job) -> None:
    log("start")
    if not job.train:
        model = _untrained(rank, job)
        optim = torch.optim.AdamW(model.parameters(), lr=LR)
        trained = Trained(model, optim, model, job.engine, rank, job.world_size, False)
        for layout, out in job.outs.items():
            save_layout(layout, trained, Path(out))
            dist.barrier()
        log("saved untrained shards")
        return
    model = shard(build_model(job.cfg, job.seed, DTYPES[job.dtype]), job.engine, job.world_size)
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    log("built and sharded")
    # torch.compile only wraps (the compiled forward never runs): training goes through the inner
    # module, state dicts through the wrapper, whose keys then carry `_orig_mod.`.
    sd_module = torch.compile(model) if job.compile_prefix else model
    assert isinstance(sd_module, nn.Module)  # torch.compile of a module is a module (OptimizedModule)
    train_step(model, optim, first_batch(job.cfg, job.seed, rank))
    log("trained")

    if job.reference is not None:
        _write_reference(full_reference(model, optim, job.engine), job.reference)
        log("reference written")
    trained = Trained(model, optim, sd_module, job.engine, rank, job.world_size, job.with_optim)
    for layout, out in job.outs.items():
        save_layout(layout, trained, Path(out))
        dist.barrier()
        log(f"saved {layout}")

    if job.step_reference is not None:
        train_step(model, optim, shared_batch(job.cfg, job.seed))
        _write_reference(full_reference(model, optim, job.engine), job.step_reference)
        log("second step reference written")


def _load(rank: int, job: Job) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    assert job.ckpt_dir is not None
    model = shard(build_model(job.cfg, job.seed, DTYPES[job.dtype]), "fsdp2", job.world_size)
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    keys = dcp.FileSystemReader(job.ckpt_dir).read_metadata().state_dict_metadata.keys()
    nested = any(k.startswith("model.") for k in keys)
    has_optim = nested and any(k.startswith("optim.") for k in keys)
    if has_optim:
        # get_state_dict runs a zero-lr, zero-grad step so the optimizer state exists to load into.
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=job.ckpt_dir)
        set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)  # loaded in place
    else:
        msd = get_model_state_dict(model)
        dcp.load({"model": msd} if nested else msd, checkpoint_id=job.ckpt_dir)
        set_model_state_dict(model, msd)
    _write_reference(full_reference(model, optim, "fsdp2"), job.reference)
    if not has_optim:
        # A model-only checkpoint resumes with a fresh optimizer (full_reference has just given this one
        # a zero-lr step to have state to report).
        optim = torch.optim.AdamW(model.parameters(), lr=LR)
    train_step(model, optim, shared_batch(job.cfg, job.seed))
    _write_reference(full_reference(model, optim, "fsdp2"), job.step_reference)
