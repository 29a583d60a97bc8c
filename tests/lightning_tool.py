"""Make a real Lightning Fabric FSDP checkpoint on CPU (2 processes, gloo) for the tests.

`python tests/lightning_tool.py OUT`: trains a small model one step under Fabric's `FSDPStrategy` and saves
`OUT/sharded` (`state_dict_type="sharded"`: DCP + meta.pt). `python tests/lightning_tool.py OUT CKPT N`
resumes CKPT with Fabric's own `fabric.load` at N ranks, trains two more steps and saves `OUT/resumed`.
`python tests/lightning_tool.py trainer OUT N STEPS [CKPT]` does the same with Lightning's `Trainer` (`fit` with
`ckpt_path=CKPT`), saving `OUT/last.ckpt`.
Fabric refuses FSDP on CPU (`_check_strategy_and_fallback` accepts only exactly `FSDPStrategy` on a GPU), and
torch's FSDP needs `device_id=cpu` to wrap on CPU: the test uses a trivial `FSDPStrategy` subclass and hands
Fabric a module already wrapped in FSDP, after which Fabric's own setup, backward, optimizer step and save run
unchanged.
(`state_dict_type="full"` crashes on CPU inside torch's FSDP1 full-state-dict offload, see FORMATS.md;
Lightning's own consolidation, `lightning.fabric.utilities.consolidate_checkpoint`, writes that format.)
"""

from __future__ import annotations

import json
import sys

import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import FSDPStrategy
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import FSDPStrategy as TrainerFSDP
from ranks import end_rank  # run as a script (each rank too): tests/ is on sys.path


class CpuFSDPStrategy(FSDPStrategy):
    """FSDPStrategy itself; a subclass only so that Fabric's GPU-only check lets it run on CPU."""


def main(out: str, resume: str | None = None, devices: int = 2) -> None:
    """Without `resume`: train one step and save `out/sharded`. With it: load that checkpoint with `fabric.load`
    at `devices` ranks, train two more steps and save `out/resumed`, writing rank 0's losses to `out/losses.json`."""
    fabric = Fabric(accelerator="cpu", devices=devices, strategy=CpuFSDPStrategy(state_dict_type="sharded"))
    fabric.launch()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = fabric.setup_module(FullyShardedDataParallel(model, device_id=torch.device("cpu")))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    state = {"model": model, "optimizer": optimizer, "step": 3, "hparams": {"lr": 1e-3, "name": "tiny"}}
    if resume is None:
        loss = model(torch.randn(4, 8)).square().sum()
        fabric.backward(loss)
        optimizer.step()
        fabric.save(f"{out}/sharded", state)
        return
    state["step"] = 0
    fabric.load(resume, state)
    losses = []
    for step in range(state["step"], state["step"] + 2):
        batch = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 100 + fabric.global_rank))
        loss = model(batch).square().sum()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    state["step"] += 2
    fabric.save(f"{out}/resumed", state)
    if fabric.global_rank == 0:
        with open(f"{out}/losses.json", "w") as fh:
            json.dump({"step": state["step"], "losses": losses}, fh)
    end_rank()


class TrainerFSDPStrategy(TrainerFSDP):
    """The Trainer's FSDPStrategy itself; a subclass only so that the Trainer's GPU-only check lets it run on CPU."""


class Tiny(LightningModule):
    """The Fabric run's model, wrapped in FSDP on CPU in `configure_model` (the strategy then keeps that
    wrapping); rank r trains on its own seeded batches, 4 a epoch; the losses it trained on are kept."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        self.net = FullyShardedDataParallel(net, device_id=torch.device("cpu"))

    def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
        loss = self.net(batch).square().sum()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        data = torch.randn(16, 8, generator=torch.Generator().manual_seed(7 + self.global_rank))
        return torch.utils.data.DataLoader(data, batch_size=4)


def trainer_main(out: str, devices: str, steps: str, resume: str | None = None) -> None:
    """Lightning's `Trainer` with `FSDPStrategy(state_dict_type="sharded")`: fit to STEPS (from RESUME with
    `trainer.fit(ckpt_path=RESUME)`), save `out/last.ckpt`, rank 0's losses to `out/losses.json`."""
    trainer = Trainer(accelerator="cpu", devices=int(devices), strategy=TrainerFSDPStrategy(state_dict_type="sharded"),
                      max_steps=int(steps), default_root_dir=out, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, use_distributed_sampler=False)
    model = Tiny()
    trainer.fit(model, ckpt_path=resume)
    trainer.save_checkpoint(f"{out}/last.ckpt")
    if trainer.global_rank == 0:
        with open(f"{out}/losses.json", "w") as fh:
            json.dump(model.losses, fh)
    end_rank()


if __name__ == "__main__":
    if sys.argv[1] == "trainer":
        trainer_main(*sys.argv[2:])
    elif len(sys.argv) == 2:
        main(sys.argv[1])
    else:
        main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
