"""Make a real Lightning Fabric FSDP checkpoint on CPU (2 processes, gloo) for the tests.

`python tests/lightning_tool.py OUT`: trains a small model one step under Fabric's `FSDPStrategy` and saves
`OUT/sharded` (`state_dict_type="sharded"`: DCP + meta.pt). Fabric refuses FSDP on CPU
(`_check_strategy_and_fallback` accepts only exactly `FSDPStrategy` on a GPU), and torch's FSDP needs
`device_id=cpu` to wrap on CPU: the test uses a trivial `FSDPStrategy` subclass and hands Fabric a module
already wrapped in FSDP, after which Fabric's own setup, backward, optimizer step and save run unchanged.
(`state_dict_type="full"` crashes on CPU inside torch's FSDP1 full-state-dict offload, see FORMATS.md;
Lightning's own consolidation, `lightning.fabric.utilities.consolidate_checkpoint`, writes that format.)
"""

from __future__ import annotations

import sys

import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import FSDPStrategy


class CpuFSDPStrategy(FSDPStrategy):
    """FSDPStrategy itself; a subclass only so that Fabric's GPU-only check lets it run on CPU."""


def main(out: str) -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=CpuFSDPStrategy(state_dict_type="sharded"))
    fabric.launch()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = fabric.setup_module(FullyShardedDataParallel(model, device_id=torch.device("cpu")))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    loss = model(torch.randn(4, 8)).square().sum()
    fabric.backward(loss)
    optimizer.step()
    fabric.save(f"{out}/sharded", {"model": model, "optimizer": optimizer, "step": 3,
                                   "hparams": {"lr": 1e-3, "name": "tiny"}})


if __name__ == "__main__":
    main(sys.argv[1])
