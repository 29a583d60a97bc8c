"""Optimizer state matched to its parameter by the checkpoint's own param_groups, whatever it is keyed by.

Checkpoints are made at 2 ranks (CPU, gloo, FSDP2) by the frameworks' own checkpointers, resharded to 3 by
`ckptctl reshard`, and resumed at 3 ranks by the frameworks' own load calls:
- torchtitan 0.3.0: `CheckpointManager` with its `OptimizersContainer` (flat, FQN-keyed state) and
  `LRSchedulersContainer`, around a model with a fused `wqkv` parameter saved split into `wq`/`wk`/`wv` (the
  state-dict hooks of torchtitan's `FusedQKVLinear`, copied: importing torchtitan's models needs triton);
- torchtune 0.6.1: `DistributedCheckpointer` async save of the recipe's dict (`TrainingProgress`, model,
  `optimizer.state_dict()`: integer ids), resumed the way `CheckpointClient.load_distributed_checkpoint` does;
- a plain `{"model": model.state_dict(), "optimizer": optimizer.state_dict()}` written with torch.save.
The loaded optimizer state equals the source's exactly, and one more step equals, bit for bit, the step taken
after resuming the original checkpoint at 3 ranks.

Packages (not in the `test` extra: their own pins would downgrade fsspec and pull triton-free-incompatible torchao):
`pip install --no-deps torchtitan==0.3.0 torchtune==0.6.1 torchao==0.14.1 datasets==4.7.0 spmd_types==0.2.3` plus
tyro omegaconf pyarrow pandas dill multiprocess xxhash pillow tiktoken sentencepiece blobfile (torch stays 2.13.0);
torchtune 0.6.1 needs torchao <= 0.14 (`torchao.dtypes.nf4tensor`). Without them those two tests are skipped.
Run as a script (`python -m tests.test_frameworks_optim JOB WORLD_SIZE FOLDER`) for the rank processes.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from .conftest import ckptctl
from .ranks import end_rank

pytestmark = pytest.mark.slow  # frameworks, gloo ranks and ckptctl subprocesses


# ---- the models and the rank-side jobs -------------------------------------------------------------------------


class FusedQKV(nn.Module):
    """torchtitan's `FusedQKVLinear` checkpoint hooks: one `wqkv` parameter, stored as `wq`/`wk`/`wv`."""

    def __init__(self, dim: int = 8, head_dim: int = 2, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.hd, self.hpk = head_dim, heads // kv_heads
        self.r = self.hpk + 2
        self.wqkv = nn.Linear(dim, kv_heads * self.r * head_dim, bias=False)
        self.register_state_dict_post_hook(self._split)
        self.register_load_state_dict_pre_hook(self._merge)

    @staticmethod
    def _split(module: FusedQKV, sd: dict, prefix: str, meta: Any) -> None:
        from torch.distributed.tensor import DTensor, Replicate

        t = sd.pop(f"{prefix}wqkv.weight")
        if isinstance(t, DTensor):
            t = t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim)
        w = t.reshape(-1, module.r, module.hd, t.shape[1])
        sd[f"{prefix}wq.weight"] = w[:, :module.hpk].reshape(-1, t.shape[1]).contiguous()
        sd[f"{prefix}wk.weight"] = w[:, module.hpk].reshape(-1, t.shape[1]).contiguous()
        sd[f"{prefix}wv.weight"] = w[:, module.hpk + 1].reshape(-1, t.shape[1]).contiguous()

    @staticmethod
    def _merge(module: FusedQKV, sd: dict, prefix: str, *args: Any) -> None:
        from torch.distributed.tensor import DTensor, Replicate

        keys = [f"{prefix}{w}.weight" for w in ("wq", "wk", "wv")]
        if not all(k in sd for k in keys):
            return
        wq, wk, wv = (sd.pop(k) for k in keys)
        if isinstance(wq, DTensor):
            wq, wk, wv = (t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim) for t in (wq, wk, wv))
        n_kv, d = wk.shape[0] // module.hd, wq.shape[1]
        sd[f"{prefix}wqkv.weight"] = torch.cat([wq.reshape(n_kv, module.hpk, module.hd, d),
                                                wk.reshape(n_kv, 1, module.hd, d),
                                                wv.reshape(n_kv, 1, module.hd, d)], 1).reshape(-1, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wqkv(x)


class Tiny(nn.Module):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.tok = nn.Embedding(16, 8)
        self.attn = FusedQKV() if fused else nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.attn(self.tok(x))))


class Position:
    """A dataloader / train state: one counter (Stateful)."""

    def __init__(self) -> None:
        self.pos = 0

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.pos = sd["pos"]


def _train(model: nn.Module, opt: Any, rank: int, step: int) -> None:
    torch.manual_seed(1000 * step + rank)
    model(torch.randint(0, 16, (2, 5))).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _full(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """The full model state (as saved: `wqkv` split) and FQN-keyed optimizer state; every rank gathers."""
    from torch.distributed.tensor import DTensor

    def full(value: Any) -> Any:
        return value.full_tensor() if isinstance(value, DTensor) else value

    names = {id(p): n for n, p in model.named_parameters()}
    state = {names[id(p)]: {k: full(v) for k, v in sorted(st.items())} for p, st in opt.state.items()}
    groups = [{**{k: v for k, v in g.items() if k not in ("params", "param_names")},
               "params": [names[id(p)] for p in g["params"]]} for g in opt.param_groups]
    return {"model": {k: full(v) for k, v in model.state_dict().items()},
            "optim": {"state": dict(sorted(state.items())), "param_groups": groups}}


def _model_and_adamw(fused: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Tiny(fused)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _titan(folder: Path) -> tuple[nn.Module, Any, Any]:
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig

    torch.manual_seed(0)
    model = Tiny(fused=True)
    fully_shard(model)
    groups = [ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})]
    opt = OptimizersContainer(OptimizersContainer.Config(param_groups=groups, implementation="for-loop"),
                              model_parts=[model])
    sched = LRSchedulersContainer(opt, lambda s: 1.0 / (1 + s))
    config = CheckpointManager.Config(enable=True, folder="checkpoint", interval=1, last_save_model_only=False)
    mgr = CheckpointManager(config, dataloader=Position(), model_parts=[model], optimizers=opt,  # type: ignore[arg-type]
                            lr_schedulers=sched, states={"train_state": Position()}, sd_adapter=None,
                            base_folder=str(folder))
    return model, opt, (sched, mgr)


def job(rank: int, world_size: int, name: str, folder: Path) -> None:
    """One rank of `name`; rank 0 writes what it saw to `folder/<name>.pt`."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    seen: dict[str, Any] = {}
    if name.startswith("titan"):
        model, opt, (sched, mgr) = _titan(folder)
        if name == "titan-save":
            for step in (1, 2):
                _train(model, opt, rank, step)
                sched.step()
                mgr.save(step)
        else:
            assert mgr.load(step=2)
        inner, stepper = opt.optimizers[0], opt
    else:
        model, inner = _model_and_adamw(fused=False)
        stepper = inner
        sd = {"model": model.state_dict(), "optimizer": inner.state_dict()}
        if name == "tune-save":
            from torchtune.training import DistributedCheckpointer
            from torchtune.training.checkpointing._checkpoint_client import TrainingProgress

            for step in (1, 2):
                _train(model, inner, rank, step)
            progress = TrainingProgress(seed=0, epochs_run=1, total_epochs=3, max_steps_per_epoch=2,
                                        dataloader_state_dict={"pos": 2})
            ckpt = {**progress.state_dict(), "model": model.state_dict(), "optimizer": inner.state_dict()}
            saver = DistributedCheckpointer(checkpoint_dir=str(folder), output_dir=str(folder))
            saver.save_checkpoint(ckpt, epoch=1, save_async=True)
            saver._checkpoint_future.result()  # the recipe waits for it before the next save or exit
        elif name == "plain-save":
            for step in (1, 2):
                _train(model, inner, rank, step)
        else:  # tune-resume, plain-resume, plain-original: CheckpointClient.load_distributed_checkpoint's calls
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.format_utils import torch_save_to_dcp
            from torch.distributed.checkpoint.state_dict import _init_optim_state, set_state_dict

            if name == "plain-original" and rank == 0:  # the torch.save file as torch's own converter reads it
                torch_save_to_dcp(folder / "plain.pt", folder / "ckpt")
            dist.barrier()
            _init_optim_state(inner)
            sd = {"model": model.state_dict(), "optimizer": inner.state_dict()}
            dcp.load(sd, checkpoint_id=str(folder / "ckpt"))
            set_state_dict(model, inner, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
    seen["loaded"] = _full(model, inner)
    if name == "plain-save" and rank == 0:
        torch.save({"model": seen["loaded"]["model"], "optimizer": _plain_ids(seen["loaded"]["optim"], model)},
                   folder / "plain.pt")
    if not name.endswith("save"):
        _train(model, stepper, rank, 3)
        seen["stepped"] = _full(model, inner)
    if rank == 0:
        torch.save(seen, folder / f"{name}.pt")
    end_rank()


def _plain_ids(optim: dict, model: nn.Module) -> dict:
    """`optimizer.state_dict()` as torch writes it for an unwrapped model: ids in `model.parameters()` order."""
    ids = {n: i for i, (n, _) in enumerate(model.named_parameters())}
    return {"state": {ids[n]: s for n, s in optim["state"].items()},
            "param_groups": [{**g, "params": [ids[n] for n in g["params"]]} for g in optim["param_groups"]]}


def _spawn(rank: int, world_size: int, name: str, folder: str) -> None:
    job(rank, world_size, name, Path(folder))


if __name__ == "__main__":
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    mp.spawn(_spawn, args=(int(sys.argv[2]), sys.argv[1], sys.argv[3]), nprocs=int(sys.argv[2]))


# ---- the tests --------------------------------------------------------------------------------------------------


def run_job(name: str, world_size: int, folder: Path) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "tests.test_frameworks_optim", name, str(world_size), str(folder)],
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).parent.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(folder / f"{name}.pt", weights_only=True)


def assert_same(got: Any, want: Any, where: str = "") -> None:
    """Equal nested state: tensors bit for bit (dtype and shape too), everything else by ==."""
    if isinstance(want, dict):
        assert sorted(map(str, got)) == sorted(map(str, want)), where
        for key in want:
            assert_same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), where
    else:
        assert got == want, where


def assert_resumes_alike(original: dict, resharded: dict, source: dict, skip: tuple[str, ...] = ()) -> None:
    """Loaded from the resharded copy: the source's optimizer state and weights exactly (but `skip`ped keys), and
    everything as loaded from the original; one more step: bit for bit as after resuming the original."""
    def kept(state: dict) -> dict:
        return {fqn: {k: v for k, v in entry.items() if k not in skip} for fqn, entry in state.items()}

    assert_same(kept(resharded["loaded"]["optim"]["state"]), kept(source["loaded"]["optim"]["state"]), "optimizer")
    assert_same(resharded["loaded"]["model"], source["loaded"]["model"], "loaded model")
    assert_same(original["loaded"], resharded["loaded"], "loaded")
    assert_same(resharded["stepped"], original["stepped"], "after one more step")


@pytest.fixture(scope="module")
def frameworks() -> None:
    pytest.importorskip("torchtitan.components.checkpoint")
    pytest.importorskip("torchtune.training")


def test_torchtitan_fused_wqkv_reshards_and_resumes(frameworks: None, tmp_path: Path) -> None:
    src = run_job("titan-save", 2, tmp_path / "ws2")
    step2 = tmp_path / "ws2" / "checkpoint" / "step-2"
    assert "torchtitan" in ckptctl("inspect", step2).stdout
    ckptctl("reshard", step2, tmp_path / "out", "--world-size", "3")
    for base, folder in (("orig3", step2), ("new3", tmp_path / "out")):
        shutil.copytree(folder, tmp_path / base / "checkpoint" / "step-2")
    original, resharded = run_job("titan-resume", 3, tmp_path / "orig3"), run_job("titan-resume", 3, tmp_path / "new3")
    assert "attn.wqkv.weight" in src["loaded"]["optim"]["state"]
    # torch 2.13's load path (init_optim_state's zero-lr step, then load) leaves Adam's `step` one past the saved
    # one, from the original as from the resharded copy (compared with each other below); the rest loads as saved
    assert_resumes_alike(original, resharded, src, skip=("step",))


def test_torchtune_integer_ids_reshard_and_resume(frameworks: None, tmp_path: Path) -> None:
    src = run_job("tune-save", 2, tmp_path / "ws2")
    saved = tmp_path / "ws2" / "dist_epoch_1"
    assert len(list(saved.glob("*.distcp"))) > 2  # one file per tensor (async save, single_file_per_rank=False)
    assert "producer: torchtune" in ckptctl("inspect", saved).stdout
    ckptctl("reshard", saved, tmp_path / "new3" / "ckpt", "--world-size", "3")
    shutil.copytree(saved, tmp_path / "orig3" / "ckpt")
    original, resharded = run_job("tune-resume", 3, tmp_path / "orig3"), run_job("tune-resume", 3, tmp_path / "new3")
    assert_resumes_alike(original, resharded, src, skip=("step",))  # `step`: as in the titan test


def test_plain_optimizer_state_dict_with_integer_ids(tmp_path: Path) -> None:
    src = run_job("plain-save", 2, tmp_path / "ws2")
    plain = tmp_path / "ws2" / "plain.pt"
    assert sorted(torch.load(plain, weights_only=True)["optimizer"]["state"]) == list(range(6))
    ckptctl("reshard", plain, tmp_path / "new3" / "ckpt", "--world-size", "3")
    (tmp_path / "orig3").mkdir()
    shutil.copy(plain, tmp_path / "orig3" / "plain.pt")
    original = run_job("plain-original", 3, tmp_path / "orig3")
    resharded = run_job("plain-resume", 3, tmp_path / "new3")
    assert_resumes_alike(original, resharded, src, skip=("step",))  # `step`: as in the titan test


def test_integer_ids_that_cannot_be_matched_are_refused_in_one_line(tmp_path: Path) -> None:
    model = {"a.weight": torch.ones(4, 2), "b.weight": torch.ones(3, 2), "b.running": torch.ones(3)}  # a buffer
    optim = {"state": {0: {"exp_avg": torch.ones(4, 2)}, 1: {"exp_avg": torch.ones(3, 2)}},
             "param_groups": [{"lr": 0.1, "params": [0, 1]}]}
    torch.save({"model": model, "optimizer": optim}, tmp_path / "count.pt")
    proc = ckptctl("reshard", tmp_path / "count.pt", tmp_path / "c", "--world-size", "3", check=False)
    assert proc.returncode == 2 and "lists 2 parameter ids but the model stores 3 tensors" in proc.stderr
    del model["b.running"]
    optim["state"][1]["exp_avg"] = torch.ones(2, 3)
    torch.save({"model": model, "optimizer": optim}, tmp_path / "shape.pt")
    proc = ckptctl("reshard", tmp_path / "shape.pt", tmp_path / "s", "--world-size", "3", check=False)
    assert proc.returncode == 2 and "'optimizer.state.1.exp_avg' has shape [2, 3]" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "s").exists()
