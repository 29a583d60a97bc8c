"""Two FSDP2 (fully_shard) training steps of tests/stats_job.py's model at 2 gloo ranks, for
tests/test_guards.py.

    python -m tests.guards_job OUT_DIR

Each AdamW step's model and optimizer state is saved with torch.distributed.checkpoint to OUT_DIR/step-N. Before
saving step 2 the training code blows up `layers.2.weight` (every rank scales its shard by `BLOWUP`: large but
finite, so only a bound on the statistics catches it), and rank 0 writes the unsharded model tensors every rank
gathered to OUT_DIR/full-N.pt, flat under the names scan gives them, for the test to compare with.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from tests.stats_job import VOCAB, Net, flat

STEPS = 2
BLOWN = "layers.2.weight"
BLOWUP = 1000.0


def job(rank: int, world_size: int, out: Path) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    from tests.ranks import end_rank

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = Net()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    for step in range(1, STEPS + 1):
        torch.manual_seed(100 * step + rank)
        batch = torch.randint(0, VOCAB, (4, 6))
        nn.functional.cross_entropy(model(batch).flatten(0, 1), batch.flatten()).backward()
        opt.step()
        opt.zero_grad()
        if step == STEPS:
            with torch.no_grad():
                dict(model.named_parameters())[BLOWN].mul_(BLOWUP)
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=str(out / f"step-{step}"))
        gathered = get_model_state_dict(model, options=full)
        if rank == 0:
            tensors: dict[str, torch.Tensor] = {}
            flat("model", gathered, tensors)
            torch.save({name.removeprefix("model."): t for name, t in tensors.items()}, out / f"full-{step}.pt")
    end_rank()


def _spawn(rank: int, world_size: int, out: str) -> None:
    job(rank, world_size, Path(out))


if __name__ == "__main__":
    from tests.ranks import spawn

    Path(sys.argv[1]).mkdir(parents=True, exist_ok=True)
    spawn(_spawn, 2, sys.argv[1])
