"""Three FSDP2 (fully_shard) training steps of a small model at 2 gloo ranks, for tests/test_stats.py.

    python -m tests.stats_job OUT_DIR

`layers.1` is frozen (requires_grad False: no gradient, no optimizer state). After each AdamW step the model
and optimizer state are saved with torch.distributed.checkpoint to OUT_DIR/step-N, and rank 0 writes the
unsharded tensors every rank gathered (`full_state_dict`) to OUT_DIR/full-N.pt, flat under DCP's keys, for the
test to compare with. After step 3 the training code writes a NaN into `layers.2.weight` (rank 0's shard)
before saving.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

STEPS = 3
FROZEN = "layers.1"
POISONED = "layers.2.weight"
VOCAB = 41  # odd: the embedding and head rows shard unevenly (21 + 20)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 24)
        self.layers = nn.ModuleList([nn.Linear(24, 24) for _ in range(3)])
        self.head = nn.Linear(24, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


def flat(prefix: str, value: Any, out: dict[str, torch.Tensor]) -> None:
    """The tensors of a nested state dict under dotted keys, as DCP names them."""
    if isinstance(value, dict):
        for key, item in value.items():
            flat(f"{prefix}.{key}", item, out)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            flat(f"{prefix}.{i}", item, out)
    elif isinstance(value, torch.Tensor):
        out[prefix] = value.detach().clone()


def job(rank: int, world_size: int, out: Path) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    from tests.ranks import end_rank

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = Net()
    model.layers[1].requires_grad_(False)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    for step in range(1, STEPS + 1):
        torch.manual_seed(100 * step + rank)
        batch = torch.randint(0, VOCAB, (4, 6))
        nn.functional.cross_entropy(model(batch).flatten(0, 1), batch.flatten()).backward()
        opt.step()
        opt.zero_grad()
        if step == STEPS:
            with torch.no_grad():
                poisoned = dict(model.named_parameters())[POISONED]
                if rank == 0:
                    poisoned.to_local()[1, 2] = float("nan")  # type: ignore[attr-defined]
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.save(state, checkpoint_id=str(out / f"step-{step}"))
        gathered = {"model": get_model_state_dict(model, options=full),
                    "optim": get_optimizer_state_dict(model, opt, options=full)}
        if rank == 0:
            tensors: dict[str, torch.Tensor] = {}
            flat("model", gathered["model"], tensors)
            flat("optim", gathered["optim"], tensors)
            torch.save(tensors, out / f"full-{step}.pt")
    end_rank()


def _spawn(rank: int, world_size: int, out: str) -> None:
    job(rank, world_size, Path(out))


if __name__ == "__main__":
    from tests.ranks import spawn

    Path(sys.argv[1]).mkdir(parents=True, exist_ok=True)
    spawn(_spawn, 2, sys.argv[1])
