"""Make real DeepSpeed ZeRO checkpoints on CPU (gloo) and the references to check them against.

Run by the tests and the benchmark as `python -m tests.deepspeed_job OUT --stage S --dtype D --world-size N`
(it launches its own gloo processes). Writes, under OUT:

- `ckpt/`: `engine.save_checkpoint` after each of two Adam steps (`latest` -> `global_step2/`, `global_step1/`);
- `engine.pt` (unless `--no-reference`): the engine's own per-parameter state after the save, gathered
  with DeepSpeed's `safe_get_full_*` helpers, `{"fp32": {name: t}, "exp_avg": …, "exp_avg_sq": …,
  "step": int, "param_groups": [...]}`, and the 16-bit module weights `module`.

The model has a frozen layer, tied embeddings, a buffer and sizes that split parameters mid-row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch import nn

from .ranks import end_rank

LR = 1e-2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Net(nn.Module):
    """Tied embedding/head, a frozen projection, a buffer, and odd sizes."""

    def __init__(self, vocab: int = 37, dim: int = 13, hidden: int = 29, layers: int = 2, tie: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.GELU(),
                                                  nn.Linear(hidden, dim)) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, dim), persistent=True)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.frozen((self.emb(tokens) * self.scale).to(self.emb.weight.dtype))
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def net_for_size(size_bytes: int) -> Net:
    """A Net of about `size_bytes` fp32 parameter bytes (for the benchmark: untied, since zero_to_fp32's
    safetensors output refuses tied weights)."""
    dim = 1021
    per_layer = 2 * dim * 4 * dim + 7 * dim
    layers = max(1, int(size_bytes / 4 * 0.9) // per_layer)
    vocab = max(37, int(size_bytes / 4 - layers * per_layer - dim * dim) // dim // 2)
    return Net(vocab, dim, 4 * dim + 3, layers, tie=False)


def config(stage: int, dtype: str, world_size: int, aligned: bool = False) -> dict:
    cfg: dict = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": LR, "torch_adam": True, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if stage == 3:
        cfg["zero_optimization"].update({"stage3_param_persistence_threshold": 0})
    if aligned:  # per-parameter alignment paddings and round-robin gradient order in the flat groups
        cfg["zero_optimization"].update({"parameter_alignment": True, "round_robin_gradients": True})
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(args.world_size),
                       "LOCAL_WORLD_SIZE": str(args.world_size), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "DS_ACCELERATOR": "cpu"})
    torch.set_num_threads(1)
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = net_for_size(args.size) if args.size else Net()
    vocab = model.emb.num_embeddings
    cfg = config(args.stage, args.dtype, args.world_size, args.aligned)
    if args.universal:  # DeepSpeed 0.19 clips at 1.0 by default and ZeRO-1/2 keep that in the checkpoint
        cfg["gradient_clipping"] = 0.0
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    steps = 1 if args.size else 2
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        tokens = torch.randint(0, vocab, (2, 9), generator=g)
        logits = engine(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        if step == 0 and steps == 2:  # an older tag beside the latest one
            engine.save_checkpoint(str(Path(args.out) / "ckpt"), client_state=universal_info(args))
    engine.save_checkpoint(str(Path(args.out) / "ckpt"), client_state=universal_info(args))
    if args.no_reference:
        return
    ref: dict = {"fp32": {}, "exp_avg": {}, "exp_avg_sq": {}, "module": {}}
    names = {id(p): n for n, p in engine.module.named_parameters()}
    if hasattr(engine.optimizer, "_hp_optimizer_states_linked"):
        # ZeRO-1/2 link the per-parameter views of the Adam state after stepping the first group only, so
        # safe_get_full_optimizer_state misses the later groups' state: link again now that all exist
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    for name, param in engine.module.named_parameters():
        if not param.requires_grad:
            continue
        ref["fp32"][name] = safe_get_full_fp32_param(param).detach().cpu().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            ref[key][name] = safe_get_full_optimizer_state(param, key).detach().cpu().clone()
    base = engine.optimizer.optimizer
    ref["step"] = {int(v["step"]) for v in base.state.values()}
    ref["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in base.param_groups]
    if args.stage == 3:
        import deepspeed.runtime.zero as zero

        with zero.GatheredParameters(list(engine.module.parameters())):
            ref["module"] = {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}
    else:
        ref["module"] = {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}
    ref["names"] = sorted(names.values())
    if rank == 0:
        torch.save(ref, Path(args.out) / "engine.pt")


def universal_info(args: argparse.Namespace) -> dict:
    """`--universal`: the client state ds_to_universal needs to convert a ZeRO-1/2 save (Megatron-DeepSpeed writes
    it; a plain model has no tensor parallelism, so the version alone says "no patterns")."""
    return {"universal_checkpoint_info": {"universal_checkpoint_version": 0.2}} if args.universal else {}


def _resume_universal(rank: int, args: argparse.Namespace, port: int) -> None:
    """DeepSpeed's own resume of a universal checkpoint (OUT/ckpt, `latest_universal`) at world size N: writes
    OUT/universal-loaded.pt with the per-parameter fp32 masters and Adam state it loaded, then (fp32 only) the
    masters after one step on `shared_batch` (the same batch on every rank)."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(args.world_size),
                       "LOCAL_WORLD_SIZE": str(args.world_size), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "DS_ACCELERATOR": "cpu"})
    torch.set_num_threads(1)
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(1)  # other values than the checkpoint: loading must overwrite them all
    model = Net()
    # except the frozen layer: a universal checkpoint holds only trainable parameters and DeepSpeed's universal
    # load leaves frozen ones as the model was built, so build them as training did (seed 0, never changed)
    torch.manual_seed(0)
    model.frozen.load_state_dict(Net().frozen.state_dict())
    cfg = config(args.stage, args.dtype, args.world_size)
    cfg["checkpoint"] = {"load_universal": True}
    cfg["gradient_clipping"] = 0.0  # as the save was made (--universal); the FSDP2 resume step does not clip
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    engine.load_checkpoint(str(Path(args.out) / "ckpt"))

    def masters(with_state: bool) -> dict:
        if with_state and hasattr(engine.optimizer, "_hp_optimizer_states_linked"):
            engine.optimizer._hp_optimizer_states_linked = False
            engine.optimizer._lazy_init_hp_params_optimizer_state()
        out: dict = {"fp32": {}, "exp_avg": {}, "exp_avg_sq": {}}
        for name, param in engine.module.named_parameters():
            if param.requires_grad:
                out["fp32"][name] = safe_get_full_fp32_param(param).detach().cpu().clone()
                for key in ("exp_avg", "exp_avg_sq") if with_state else ():
                    out[key][name] = safe_get_full_optimizer_state(param, key).detach().cpu().clone()
        return out

    loaded = masters(True)
    if args.stage == 3:
        import deepspeed.runtime.zero as zero

        with zero.GatheredParameters(list(engine.module.parameters())):
            loaded["module"] = {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}
    else:
        loaded["module"] = {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}
    loaded["step"] = sorted({int(v["step"]) for v in engine.optimizer.optimizer.state.values()})
    tokens = shared_batch(model.emb.num_embeddings)
    logits = engine(tokens[:, :-1])
    vocab = model.emb.num_embeddings
    loss = nn.functional.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
    engine.backward(loss)
    engine.step()
    stepped = masters(True)
    if rank == 0:
        torch.save({"loaded": loaded, "stepped": stepped}, Path(args.out) / "universal-loaded.pt")
    end_rank()


def shared_batch(vocab: int) -> torch.Tensor:
    """The batch of the resume step: the same on every rank and in the unsharded reference."""
    return torch.randint(0, vocab, (4, 9), generator=torch.Generator().manual_seed(4242))


def step_on(model: nn.Module, optim: torch.optim.Optimizer, tokens: torch.Tensor) -> None:
    vocab = model.emb.num_embeddings
    loss = nn.functional.cross_entropy(model(tokens[:, :-1]).reshape(-1, vocab), tokens[:, 1:].reshape(-1))
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def param_groups(model: nn.Module) -> list[dict]:
    """Two groups as the Hugging Face Trainer makes them: weight decay for matrices, none for vectors."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in trainable if p.dim() > 1], "weight_decay": 0.01},
            {"params": [p for p in trainable if p.dim() <= 1], "weight_decay": 0.0}]


def adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(model), lr=LR)


def _resume(rank: int, args: argparse.Namespace, port: int) -> None:
    """Load a DCP checkpoint (`model.*`, `optim.*`) into FSDP2 at world size N, take one AdamW step."""
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(args.world_size), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", rank=rank, world_size=args.world_size)
    torch.manual_seed(1)  # other values than the checkpoint: loading must overwrite them all
    model = Net()
    mesh = init_device_mesh("cpu", (args.world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = adamw(model)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=args.out)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    step_on(model, optim, shared_batch(model.emb.num_embeddings))
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, optim, options=full)
    if rank == 0:
        torch.save({"model": msd, "optim": osd}, Path(args.out).parent / "resumed.pt")
    end_rank()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--size", type=int, default=0, help="fp32 parameter bytes (benchmark); 0: the test Net")
    parser.add_argument("--no-reference", action="store_true")
    parser.add_argument("--aligned", action="store_true", help="ZeRO-1/2 parameter_alignment + round_robin_gradients")
    parser.add_argument("--resume", action="store_true", help="OUT is a DCP folder: load it into FSDP2 and step")
    parser.add_argument("--universal", action="store_true", help="save the client state ds_to_universal needs")
    parser.add_argument("--resume-universal", action="store_true",
                        help="OUT/ckpt holds a universal checkpoint: DeepSpeed loads it at --world-size and steps")
    args = parser.parse_args(argv)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if args.resume:
        mp.start_processes(_resume, args=(args, port), nprocs=args.world_size, start_method="spawn")
        return
    if args.resume_universal:
        mp.start_processes(_resume_universal, args=(args, port), nprocs=args.world_size, start_method="spawn")
        return
    Path(args.out).mkdir(parents=True, exist_ok=True)
    mp.start_processes(_worker, args=(args, port), nprocs=args.world_size, start_method="spawn")
    print(json.dumps({"out": args.out, "files": sorted(os.listdir(Path(args.out) / "ckpt"))}))


if __name__ == "__main__":
    sys.exit(main())
